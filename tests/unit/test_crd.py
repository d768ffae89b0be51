"""The CRD agrees with the code that reads it (catalogs, enums, the fields printer columns show)."""

from __future__ import annotations

from pathlib import Path

import yaml

from specdeploy.engine.plan import GPUS, TENSOR_PARALLEL_SIZES
from specdeploy.engine.shapes import ALGORITHMS
from specdeploy.operator import render, status

CRD_PATH = Path(__file__).resolve().parents[2] / "manifests" / "crd" / "specdeploy.dev_specdecodedeployments.yaml"


def load():
    crd = yaml.safe_load(CRD_PATH.read_text())
    (version,) = crd["spec"]["versions"]
    return crd, version, version["schema"]["openAPIV3Schema"]


def test_names_and_version():
    crd, version, _ = load()
    assert crd["metadata"]["name"] == f"{render.PLURAL}.{render.GROUP}"
    assert crd["spec"]["names"]["kind"] == render.KIND
    assert crd["spec"]["names"]["shortNames"] == ["sdd"]
    assert version["name"] == render.VERSION and version["served"] and version["storage"]
    assert version["subresources"]["status"] == {}
    assert version["subresources"]["scale"] == {
        "specReplicasPath": ".spec.replicas",
        "statusReplicasPath": ".status.serving.replicas",
        "labelSelectorPath": ".status.serving.selector",
    }


def test_enums_follow_the_catalogs():
    _, _, schema = load()
    spec = schema["properties"]["spec"]["properties"]
    assert spec["gpu"]["properties"]["product"]["enum"] == list(GPUS)
    assert spec["speculative"]["properties"]["algorithm"]["enum"] == list(ALGORITHMS)
    assert spec["gpu"]["properties"]["perNode"]["enum"] == list(TENSOR_PARALLEL_SIZES)
    phases = schema["properties"]["status"]["properties"]["phase"]["enum"]
    assert set(phases) == {v for k, v in vars(status).items() if k.startswith("PHASE_")}


def test_printer_columns_point_at_fields_the_operator_writes():
    _, version, schema = load()
    columns = {c["name"]: c["jsonPath"] for c in version["additionalPrinterColumns"]}
    assert list(columns) == ["Ready", "Phase", "GPUs", "Max tokens", "Accept length", "Age"]
    assert columns["GPUs"] == ".status.plan.tensorParallelSize"
    assert columns["Max tokens"] == ".status.plan.maxTotalTokens"
    assert columns["Accept length"] == ".status.serving.meanAcceptLength"
    written = status.status_plan({"tensor_parallel_size": 1, "max_total_tokens": 2, "target": {}})
    status_props = schema["properties"]["status"]["properties"]
    for path in (columns["GPUs"], columns["Max tokens"]):
        key = path.rsplit(".", 1)[1]
        assert key in written and key in status_props["plan"]["properties"]
    assert "meanAcceptLength" in status_props["serving"]["properties"]


def test_every_model_source_rule_applies_to_target_and_draft():
    _, _, schema = load()
    spec = schema["properties"]["spec"]["properties"]
    for model in ("target", "draft"):
        rules = [r["rule"] for r in spec[model]["x-kubernetes-validations"]]
        assert any("has(self.config) && has(self.configMapRef)" in r for r in rules)
