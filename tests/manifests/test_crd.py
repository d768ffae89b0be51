"""The CRD agrees with the code that reads it (catalogs, enums, the fields printer columns show)."""

from __future__ import annotations

import functools
from pathlib import Path

import yaml

import pytest

from specdeploy.engine.planner.plan import GPUS, TENSOR_PARALLEL_SIZES, PlanError, SpecSettings
from specdeploy.engine.planner.shapes import ALGORITHMS, KV_CACHE_DTYPES
from specdeploy.engine.planner.weights import SOURCES
from specdeploy.operator import api
from specdeploy.operator.desired import status

CRD_PATH = Path(__file__).resolve().parents[2] / "manifests" / "crd" / "specdeploy.dev_specdecodedeployments.yaml"


def load():
    crd = yaml.safe_load(CRD_PATH.read_text())
    (version,) = crd["spec"]["versions"]
    return crd, version, version["schema"]["openAPIV3Schema"]


def test_names_and_version():
    crd, version, _ = load()
    assert crd["metadata"]["name"] == f"{api.PLURAL}.{api.GROUP}"
    assert crd["spec"]["names"]["kind"] == api.KIND
    assert crd["spec"]["names"]["shortNames"] == ["sdd"]
    assert version["name"] == api.VERSION and version["served"] and version["storage"]
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
    assert spec["engine"]["properties"]["kvCacheDtype"]["enum"] == list(KV_CACHE_DTYPES)
    plan = schema["properties"]["status"]["properties"]["plan"]["properties"]
    assert plan["weightsSource"]["enum"] == list(SOURCES)
    phases = schema["properties"]["status"]["properties"]["phase"]["enum"]
    assert set(phases) == {v for k, v in vars(status).items() if k.startswith("PHASE_")}


def test_printer_columns_point_at_fields_the_operator_writes():
    _, version, schema = load()
    columns = {c["name"]: c["jsonPath"] for c in version["additionalPrinterColumns"]}
    assert list(columns) == ["Ready", "Phase", "GPUs", "Nodes", "Max tokens", "Accept length", "Tok/s", "Shape", "Age",
                             "Message"]
    assert columns["Message"] == '.status.conditions[?(@.type=="Ready")].message'
    assert columns["Nodes"] == ".status.plan.nodes"
    assert columns["Shape"] == ".status.serving.speculativeShape"
    assert columns["Tok/s"] == ".status.serving.tokensPerSecond"
    assert columns["GPUs"] == ".status.plan.gpusPerReplica"
    assert columns["Max tokens"] == ".status.plan.maxTotalTokens"
    assert columns["Accept length"] == ".status.serving.meanAcceptLength"
    written = status.status_plan({"tensor_parallel_size": 1, "max_total_tokens": 2, "target": {}})
    status_props = schema["properties"]["status"]["properties"]
    for path in (columns["GPUs"], columns["Nodes"], columns["Max tokens"]):
        key = path.rsplit(".", 1)[1]
        assert key in written and key in status_props["plan"]["properties"]
    assert {"meanAcceptLength", "tokensPerSecond", "speculativeShape"} <= set(status_props["serving"]["properties"])


def test_every_model_source_rule_applies_to_target_and_draft():
    _, _, schema = load()
    spec = schema["properties"]["spec"]["properties"]
    for model in ("target", "draft"):
        rules = [r["rule"] for r in spec[model]["x-kubernetes-validations"]]
        assert any("has(self.config) && has(self.configMapRef)" in r for r in rules)


def cel_to_python(rule: str) -> str:
    """The subset of CEL the speculative rules use (field access, has(), !, ||, &&, arithmetic,
    comparisons, string literals) as a Python expression over a dict named self."""
    import re

    expr = re.sub(r"!has\(self\.(\w+)\)", r"('\1' not in self)", rule)
    expr = re.sub(r"has\(self\.(\w+)\)", r"('\1' in self)", expr)
    expr = re.sub(r"self\.(\w+)", r"self['\1']", expr)
    expr = re.sub(r"!self\['(\w+)'\]", r"(not self['\1'])", expr)
    assert not re.search(r"!(?!=)", expr), f"unsupported CEL in {rule!r}"
    return expr.replace("||", " or ").replace("&&", " and ")


@functools.cache
def speculative_schema() -> dict:
    return load()[2]["properties"]["spec"]["properties"]["speculative"]


def crd_accepts_speculative(spec: dict) -> bool:
    """Whether the CRD admits this spec.speculative: field bounds, defaults, then every CEL rule."""
    node = speculative_schema()
    props = node["properties"]
    for name, value in spec.items():
        if isinstance(value, int) and not props[name].get("minimum", value) <= value <= props[name].get("maximum", value):
            return False
    full = {k: props[k]["default"] for k in props if "default" in props[k]} | spec
    return all(eval(cel_to_python(v["rule"]), {}, {"self": full}) for v in node["x-kubernetes-validations"])


def plan_accepts(num_steps: int, topk: int, num_draft_tokens: int) -> bool:
    try:
        SpecSettings("EAGLE3", num_steps, topk, num_draft_tokens)
    except PlanError:
        return False
    return True


@pytest.mark.parametrize("steps,topk,n,accepted", [
    (3, 4, 20, True), (3, 4, 37, True), (3, 4, 38, False),
    (3, 1, 4, True), (3, 1, 5, False), (3, 1, 3, False),
    (1, 3, 4, True), (1, 3, 5, False), (2, 2, 7, True), (2, 2, 8, False),
])
def test_num_draft_tokens_bound_table(steps, topk, n, accepted):
    spec = {"algorithm": "EAGLE3", "numSteps": steps, "topk": topk, "numDraftTokens": n}
    assert crd_accepts_speculative(spec) == accepted
    assert plan_accepts(steps, topk, n) == accepted


def test_adaptive_needs_a_draft():
    assert crd_accepts_speculative({"algorithm": "EAGLE3", "adaptive": True})
    assert crd_accepts_speculative({"algorithm": "NONE", "adaptive": False})
    assert not crd_accepts_speculative({"algorithm": "NONE", "adaptive": True})


def test_crd_and_plan_agree_on_num_draft_tokens():
    """The CEL rules on numDraftTokens and SpecSettings (the plan, the runner) accept the same
    (numSteps, topk, numDraftTokens) over a grid around every bound."""
    from specdeploy.engine.planner.plan import max_draft_tokens

    for steps in range(1, 6):
        for topk in range(1, 6):
            for n in range(2, max_draft_tokens(steps, topk) + 3):
                spec = {"algorithm": "EAGLE3", "numSteps": steps, "topk": topk, "numDraftTokens": n}
                assert crd_accepts_speculative(spec) == plan_accepts(steps, topk, n), (steps, topk, n)
