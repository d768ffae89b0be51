"""Pair compatibility (engine/planner/compat.py) over every config in manifests/models: each
published pair plans, every other pairing is refused with one line naming both numbers, the same
from `specdeploy plan` (exit 2), plan_from_configs and the operator's planning."""

from __future__ import annotations

import copy
import itertools
import json
from pathlib import Path

import pytest

from specdeploy.cli import main
from specdeploy.engine.planner.compat import DRAFT_INCOMPATIBLE, draft_kind, pair_incompatibility
from specdeploy.engine.planner.plan import GPUS, Limits, PlanError, SpecSettings, plan_from_configs
from specdeploy.operator.desired.planning import PlanningError, plan_engine

MODELS = Path(__file__).resolve().parents[3] / "manifests" / "models"
# Each published head and the target it was trained for (manifests/models/README.md).
PAIRS = {
    "eagle-llama3.1-instruct-8b": ("EAGLE", "llama-3.1-8b-instruct"),
    "eagle3-llama3.1-instruct-8b": ("EAGLE3", "llama-3.1-8b-instruct"),
    "eagle3-llama3.3-instruct-70b": ("EAGLE3", "llama-3.3-70b-instruct"),
    "eagle3-llama3.1-instruct-405b": ("EAGLE3", "llama-3.1-405b-instruct"),
}
TARGETS = ("llama-3.1-8b-instruct", "llama-3.3-70b-instruct", "llama-3.1-405b-instruct", "qwen3-8b",
           "deepseek-v4-flash")


def load(name: str) -> dict:
    return json.loads((MODELS / name / "config.json").read_text())


def test_every_shipped_model_is_a_target_or_a_listed_head():
    names = {p.parent.name for p in MODELS.glob("*/config.json")}
    assert names == set(PAIRS) | set(TARGETS)


@pytest.mark.parametrize("head", sorted(PAIRS))
def test_each_published_pair_is_compatible_and_plans(head):
    algorithm, target = PAIRS[head]
    assert draft_kind(load(head)) == algorithm
    assert pair_incompatibility(algorithm, load(target), load(head)) is None
    p = plan_from_configs(load(target), load(head), SpecSettings(algorithm, 3, 1, 4), GPUS["h200"], Limits())
    assert p.algorithm == algorithm and p.max_total_tokens >= p.required_tokens


def test_the_mtp_target_is_its_own_draft():
    assert pair_incompatibility("MTP", load("deepseek-v4-flash"), None) is None
    for target in ("llama-3.1-8b-instruct", "llama-3.3-70b-instruct", "qwen3-8b"):
        problem = pair_incompatibility("MTP", load(target), None)
        assert problem and "num_nextn_predict_layers 0" in problem


PAIRINGS = [(t, h, a) for t, h, a in itertools.product(TARGETS, sorted(PAIRS), ("EAGLE", "EAGLE3"))
            if (a, t) != PAIRS[h] and t != "deepseek-v4-flash"]


@pytest.mark.parametrize("target,head,algorithm", PAIRINGS, ids=lambda v: str(v))
def test_every_other_pairing_is_refused(target, head, algorithm):
    problem = pair_incompatibility(algorithm, load(target), load(head))
    assert problem and "\n" not in problem
    with pytest.raises(PlanError) as err:
        plan_from_configs(load(target), load(head), SpecSettings(algorithm, 3, 1, 4), GPUS["h200"], Limits())
    assert err.value.reason == DRAFT_INCOMPATIBLE and str(err.value) == problem


def test_a_deepseek_v4_target_drafts_only_with_its_mtp_layer():
    with pytest.raises(PlanError) as err:
        plan_from_configs(load("deepseek-v4-flash"), load("eagle3-llama3.1-instruct-8b"),
                          SpecSettings("EAGLE3", 3, 1, 4), GPUS["h200"], Limits())
    assert err.value.reason == "InvalidSpeculativeSettings" and "MTP" in str(err.value)


# The mismatches of the issue, each with the numbers its line must name.
MISMATCHES = [
    ("qwen3-8b", "eagle3-llama3.1-instruct-8b", "EAGLE3", ("vocab_size", "128256", "151936")),
    ("llama-3.3-70b-instruct", "eagle3-llama3.1-instruct-8b", "EAGLE3", ("hidden_size", "4096", "8192")),
    ("llama-3.1-8b-instruct", "eagle3-llama3.3-instruct-70b", "EAGLE3", ("hidden_size", "8192", "4096")),
    ("llama-3.1-8b-instruct", "eagle-llama3.1-instruct-8b", "EAGLE3", ("EAGLE-1/2 head", "algorithm EAGLE, not EAGLE3")),
    ("llama-3.1-8b-instruct", "eagle3-llama3.1-instruct-8b", "EAGLE", ("EAGLE-3 head", "algorithm EAGLE3, not EAGLE")),
    ("llama-3.1-8b-instruct", "llama-3.1-8b-instruct", "EAGLE3", ("32 layers", "whole causal LM", "LlamaForCausalLMEagle3")),
    ("llama-3.1-8b-instruct", "qwen3-8b", "EAGLE", ("36 layers", "whole causal LM", "algorithm NONE")),
    ("qwen3-8b", "eagle-llama3.1-instruct-8b", "EAGLE", ("vocab_size", "128256", "151936")),
]


@pytest.mark.parametrize("target,draft,algorithm,words", MISMATCHES, ids=lambda v: str(v))
def test_plan_cli_refuses_each_mismatch_with_one_line(capsys, target, draft, algorithm, words):
    argv = ["plan", "--target", str(MODELS / target / "config.json"),
            "--draft", str(MODELS / draft / "config.json"), "--algorithm", algorithm]
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("specdeploy plan: ")
    for word in words:
        assert word in err


def test_the_operator_refuses_a_mismatch_as_draft_incompatible():
    spec = {"target": {"model": "Qwen/Qwen3-8B"}, "draft": {"model": "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B"},
            "speculative": {"algorithm": "EAGLE3", "numSteps": 3, "topk": 1}, "gpu": {"product": "h200"}}
    with pytest.raises(PlanningError) as err:
        plan_engine(spec, load("qwen3-8b"), load("eagle3-llama3.1-instruct-8b"))
    assert err.value.reason == "DraftIncompatible"
    assert "128256" in err.value.message and "151936" in err.value.message


def test_eagle3_draft_vocabulary_must_fit_the_target():
    head = {**load("eagle3-llama3.1-instruct-8b"), "draft_vocab_size": 200000}
    problem = pair_incompatibility("EAGLE3", load("llama-3.1-8b-instruct"), head)
    assert "draft_vocab_size" in problem and "200000" in problem and "128256" in problem


def test_eagle3_heads_are_recognised_by_each_published_marker():
    base = {k: v for k, v in load("eagle3-llama3.1-instruct-8b").items() if k != "draft_vocab_size"}
    assert draft_kind(base) == "EAGLE3"                                     # the architecture
    plain = {**base, "architectures": ["LlamaForCausalLM"]}
    assert draft_kind(plain) == "EAGLE"                                     # one layer, nothing else
    assert draft_kind({**plain, "draft_vocab_size": 32000}) == "EAGLE3"
    assert draft_kind({**plain, "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 16, 29]}}) == "EAGLE3"
    assert draft_kind({**plain, "architectures": ["LlamaForCausalLMEagle"]}) == "EAGLE"


def test_a_head_naming_its_base_model_is_checked_against_the_target():
    head = {**load("eagle3-llama3.1-instruct-8b"),
            "speculators_config": {"verifier": {"name_or_path": "Qwen/Qwen3-8B", "architectures": ["Qwen3ForCausalLM"]}}}
    problem = pair_incompatibility("EAGLE3", load("llama-3.1-8b-instruct"), head)
    assert "Qwen/Qwen3-8B" in problem and "LlamaForCausalLM" in problem
    named = {**load("llama-3.1-8b-instruct"), "_name_or_path": "meta-llama/Llama-3.3-70B-Instruct"}
    head["speculators_config"]["verifier"] = {"name_or_path": "meta-llama/Meta-Llama-3.1-8B-Instruct",
                                              "architectures": ["LlamaForCausalLM"]}
    problem = pair_incompatibility("EAGLE3", named, head)
    assert "Meta-Llama-3.1-8B-Instruct" in problem and "Llama-3.3-70B-Instruct" in problem
    named["_name_or_path"] = "meta-llama/Llama-3.1-8B-Instruct"   # the same model, renamed
    assert pair_incompatibility("EAGLE3", named, head) is None


def test_configs_are_only_read():
    target, head = load("qwen3-8b"), load("eagle3-llama3.1-instruct-8b")
    before = copy.deepcopy((target, head))
    pair_incompatibility("EAGLE3", target, head)
    assert (target, head) == before


def test_a_config_that_does_not_say_is_left_to_the_shapes():
    # No layer count, no architecture: derive_shapes names the missing field (ConfigInvalid).
    assert pair_incompatibility("EAGLE3", load("llama-3.1-8b-instruct"), {"model_type": "llama"}) is None
