"""SpecShape.validate(), the one check of a speculative shape (the plan's SpecSettings, the runner's
configured shape and every adaptive candidate use it), refuses exactly what the CRD's CEL rules on
spec.speculative refuse, read from the chart's CRD."""

from __future__ import annotations

import functools
import re
from pathlib import Path

import pytest
import yaml

from specdeploy.engine.planner.plan import NONE, PlanError, SpecSettings, SpecShape, max_draft_tokens

CRD = Path(__file__).resolve().parents[3] / "charts" / "specdeploy" / "crds" / "specdeploy.dev_specdecodedeployments.yaml"


@functools.cache
def speculative_node() -> dict:
    (version,) = yaml.safe_load(CRD.read_text())["spec"]["versions"]
    return version["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["speculative"]


def cel(rule: str) -> str:
    """The CEL these rules use (field access, has(), !, ||, &&, arithmetic, comparisons, string
    literals) as Python over a dict named self."""
    expr = re.sub(r"!has\(self\.(\w+)\)", r"('\1' not in self)", rule)
    expr = re.sub(r"has\(self\.(\w+)\)", r"('\1' in self)", expr)
    expr = re.sub(r"self\.(\w+)", r"self['\1']", expr)
    expr = re.sub(r"!self\['(\w+)'\]", r"(not self['\1'])", expr)
    assert not re.search(r"!(?!=)", expr), f"CEL this test does not read: {rule!r}"
    return expr.replace("||", " or ").replace("&&", " and ")


def crd_accepts(spec: dict) -> bool:
    """The apiserver's verdict on spec.speculative: each field's minimum / maximum, the defaults,
    then every x-kubernetes-validations rule."""
    node = speculative_node()
    props = node["properties"]
    for name, value in spec.items():
        low, high = props[name].get("minimum", value), props[name].get("maximum", value)
        if isinstance(value, int) and not low <= value <= high:
            return False
    full = {k: p["default"] for k, p in props.items() if "default" in p} | spec
    return all(eval(cel(v["rule"]), {}, {"self": full}) for v in node["x-kubernetes-validations"])


def validate_accepts(num_steps: int, topk: int, num_draft_tokens: int) -> bool:
    try:
        SpecShape(num_steps, topk, num_draft_tokens).validate()
    except PlanError as err:
        assert err.reason == "InvalidSpeculativeSettings"
        return False
    return True


def settings_accept(num_steps: int, topk: int, num_draft_tokens: int) -> bool:
    try:
        SpecSettings("EAGLE3", num_steps, topk, num_draft_tokens)
    except PlanError:
        return False
    return True


def test_the_crd_has_the_rules_this_test_reads():
    rules = [v["rule"] for v in speculative_node()["x-kubernetes-validations"]]
    assert sum("numDraftTokens" in r for r in rules) == 3


@pytest.mark.parametrize("steps,topk,n,accepted", [
    (3, 1, 4, True), (3, 1, 5, False), (3, 1, 3, False), (1, 1, 2, True), (1, 1, 1, False),
    (3, 4, 2, True), (3, 4, 37, True), (3, 4, 38, False), (3, 4, 1, False),
    (1, 3, 4, True), (1, 3, 5, False), (2, 2, 7, True), (2, 2, 8, False),
])
def test_cases_refused_and_accepted_by_both(steps, topk, n, accepted):
    spec = {"algorithm": "EAGLE3", "numSteps": steps, "topk": topk, "numDraftTokens": n}
    assert crd_accepts(spec) == accepted
    assert validate_accepts(steps, topk, n) == accepted
    assert settings_accept(steps, topk, n) == accepted


def test_validate_and_the_crd_agree_around_every_bound():
    """Over every (numSteps, topk) up to 6 and numDraftTokens from 0 to two past the pool; within
    these the schema's maximum of 1024 is never reached, so the CEL rules alone decide."""
    for steps in range(1, 7):
        for topk in range(1, 7):
            for n in range(0, max_draft_tokens(steps, topk) + 3):
                spec = {"algorithm": "EAGLE3", "numSteps": steps, "topk": topk, "numDraftTokens": n}
                want = crd_accepts(spec)
                assert validate_accepts(steps, topk, n) == want, (steps, topk, n)
                assert settings_accept(steps, topk, n) == want, (steps, topk, n)


def test_a_chain_without_num_draft_tokens_is_the_shape_the_operator_fills_in():
    # The CRD admits a chain with numDraftTokens absent; the operator then passes numSteps + 1.
    for steps in (1, 3, 32):
        assert crd_accepts({"algorithm": "EAGLE3", "numSteps": steps, "topk": 1})
        assert validate_accepts(steps, 1, steps + 1)
    assert not crd_accepts({"algorithm": "EAGLE3", "numSteps": 3, "topk": 2})


def test_none_is_not_a_speculative_shape_but_settings_of_none_are_valid():
    assert crd_accepts({"algorithm": "NONE", "numSteps": 3, "topk": 1, "numDraftTokens": 9})
    assert SpecSettings("NONE", 3, 1, 9).shape == NONE
    assert not validate_accepts(0, 1, 1)
    assert not settings_accept(0, 1, 1)
