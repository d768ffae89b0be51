"""`specdeploy plan -f` (operator/plan_file.py) on files: the operator's defaults, ConfigMaps and
Secrets from the same file, and one line with the operator's reason for what it refuses."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from specdeploy.cli import main
from specdeploy.operator.desired.planning import plan_engine

MODELS = Path(__file__).resolve().parents[2] / "manifests" / "models"


def config(name: str) -> dict:
    return json.loads((MODELS / name / "config.json").read_text())


def resource(**spec) -> dict:
    base = {"target": {"model": "meta-llama/Llama-3.1-8B-Instruct", "config": config("llama-3.1-8b-instruct")},
            "draft": {"model": "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B", "config": config("eagle3-llama3.1-instruct-8b")},
            "speculative": {"algorithm": "EAGLE3"}, "gpu": {"product": "h100"}}
    return {"apiVersion": "specdeploy.dev/v1alpha1", "kind": "SpecDecodeDeployment",
            "metadata": {"name": "x"}, "spec": {**base, **spec}}


def write(tmp_path: Path, *docs: dict) -> str:
    path = tmp_path / "resource.yaml"
    path.write_text(yaml.safe_dump_all(docs))
    return str(path)


def plan_json(capsys, *argv: str) -> dict:
    capsys.readouterr()
    assert main(["plan", *argv, "--json"]) == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out)


def refusal(capsys, *argv: str) -> str:
    capsys.readouterr()
    assert main(["plan", *argv]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("specdeploy plan: ")
    return err


def test_the_crds_defaults_are_the_operators(capsys, tmp_path):
    """No numSteps, no engine section: the plan is the operator's, with steps 3, 32 requests of
    8192 tokens and 8 GPUs a node."""
    sdd = resource()
    got = plan_json(capsys, "-f", write(tmp_path, sdd))
    assert got == plan_engine(sdd["spec"], config("llama-3.1-8b-instruct"), config("eagle3-llama3.1-instruct-8b")).plan
    assert (got["num_steps"], got["num_draft_tokens"], got["max_running_requests"], got["context_length"],
            got["gpus_per_node"]) == (3, 4, 32, 8192, 8)


def test_a_config_map_in_the_same_file_is_read(capsys, tmp_path):
    sdd = resource(draft={"model": "/models/head", "configMapRef": {"name": "head"}})
    cm = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "head"},
          "data": {"config.json": json.dumps(config("eagle3-llama3.1-instruct-8b"))}}
    assert plan_json(capsys, "-f", write(tmp_path, sdd, cm))["draft"]["num_layers"] == 1
    err = refusal(capsys, "-f", write(tmp_path, sdd))
    assert "ConfigNotFound" in err and "ConfigMap default/head not found" in err


def test_a_mismatched_pair_is_the_operators_draft_incompatible(capsys, tmp_path):
    sdd = resource(target={"model": "Qwen/Qwen3-8B", "config": config("qwen3-8b")})
    err = refusal(capsys, "-f", write(tmp_path, sdd))
    assert "DraftIncompatible" in err and "151936" in err and "128256" in err


def test_a_hub_token_secret_that_lives_in_the_cluster_says_what_to_do(capsys, tmp_path, monkeypatch):
    monkeypatch.delenv("HF_TOKEN", raising=False)
    sdd = resource(target={"model": "meta-llama/Llama-3.1-8B-Instruct"}, hub={"tokenSecretRef": {"name": "hf"}})
    err = refusal(capsys, "-f", write(tmp_path, sdd))
    assert "HubTokenNotFound" in err and "HF_TOKEN" in err


@pytest.mark.parametrize("docs,words", [
    ([], ("expected one SpecDecodeDeployment, found 0",)),
    ([{"kind": "SpecDecodeDeployment", "apiVersion": "v1", "spec": {}}], ("apiVersion 'v1'",)),
    ([{**resource(), "spec": {"target": {"model": "a/b"}, "speculative": {"algorithm": "NONE"}}}],
     ("spec.gpu or spec.cpu",)),
])
def test_files_that_are_no_resource(capsys, tmp_path, docs, words):
    err = refusal(capsys, "-f", write(tmp_path, *docs) if docs else str(tmp_path / "missing.yaml"))
    if not docs:
        assert "No such file" in err
        return
    for word in words:
        assert word in err


def test_model_flags_do_not_mix_with_a_file(capsys, tmp_path):
    err = refusal(capsys, "-f", write(tmp_path, resource()), "--algorithm", "EAGLE")
    assert "--algorithm: not used with -f" in err
