"""Hypothesis-generated SpecDecodeDeployments through the real kube-apiserver and the operator.

Each generated resource is created as a user would (the apiserver runs the CRD's schema and CEL
rules), then watched until the operator has answered its generation. Whatever the input:
- a rejection by the apiserver is a 422 whose message carries the rule's own text;
- an accepted resource gets observedGeneration == generation, a phase other than Planning, and a
  PlanReady condition with a reason (False: a reason and a message saying why) within a bound;
  nothing stays stuck in Planning or without a condition;
- the operator process never crashes and never logs a traceback.

SPECDEPLOY_FUZZ_RESOURCES sets the number of examples (CI: a few dozen, about a minute).
"""

from __future__ import annotations

import copy
import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kubernetes import client
from kubernetes.client.exceptions import ApiException
from testcluster import wait_for

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
EXAMPLES = int(os.environ.get("SPECDEPLOY_FUZZ_RESOURCES", "40"))
ANSWER_TIMEOUT_S = 30
HUB_TARGETS = ("meta-llama/Llama-3.1-8B-Instruct", "meta-llama/Llama-3.3-70B-Instruct", "meta-llama/Nope")
HUB_DRAFTS = ("yuhuili/EAGLE3-LLaMA3.1-Instruct-8B", "nobody/missing-head")
SETTLED_PHASES = {"Pending", "Deploying", "Ready", "Failed", "Paused"}


def shipped(name: str) -> dict[str, Any]:
    return json.loads((CONFIGS / f"{name}.json").read_text())


TARGET_CONFIGS = ("llama-3.1-8b-instruct", "llama-3.3-70b-instruct", "qwen3-8b", "deepseek-v3", "mistral-7b-instruct-v0.3")
DRAFT_CONFIGS = ("eagle3-llama3.1-instruct-8b", "eagle-llama3.1-instruct-8b")

# Values a config.json field might hold when someone got it wrong.
odd_values = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**40), 2**40), st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=12), st.lists(st.integers(-4, 4), max_size=3), st.just({}),
)


@st.composite
def model_config(draw, names: tuple[str, ...]) -> dict[str, Any]:
    config = copy.deepcopy(shipped(draw(st.sampled_from(names))))
    for _ in range(draw(st.integers(0, 3))):
        key = draw(st.sampled_from(sorted(config)))
        if draw(st.booleans()):
            config.pop(key)
        else:
            config[key] = draw(odd_values)
    return config


@st.composite
def model_ref(draw, hub_models: tuple[str, ...], config_names: tuple[str, ...]) -> dict[str, Any]:
    source = draw(st.sampled_from(("hub", "inline", "path-inline", "configMapRef", "bad-name")))
    if source == "hub":
        ref = {"model": draw(st.sampled_from(hub_models))}
    elif source == "inline":
        ref = {"model": draw(st.sampled_from(hub_models)), "config": draw(model_config(config_names))}
    elif source == "path-inline":
        ref = {"model": "/models/" + draw(st.from_regex(r"[a-z0-9]{1,8}", fullmatch=True)),
               "config": draw(model_config(config_names))}
    elif source == "configMapRef":
        ref = {"model": draw(st.sampled_from(hub_models)), "configMapRef": {"name": "missing-config"}}
    else:
        ref = {"model": draw(st.sampled_from(("../etc", "/abs/path", "a b", "", "x" * 300)))}
    if draw(st.booleans()):
        ref["revision"] = draw(st.sampled_from(("main", "v1.0", "0123456789abcdef0123456789abcdef01234567", "bad rev")))
    return ref


quantities = st.one_of(st.sampled_from(("1", "500m", "2Gi", "3G", "1e3", "abc", "-1", "1.5Ti")), st.integers(-2, 64))


@st.composite
def spec(draw) -> dict[str, Any]:
    algorithm = draw(st.sampled_from(("EAGLE", "EAGLE3", "MTP", "NONE", "MEDUSA")))
    out: dict[str, Any] = {"target": draw(model_ref(HUB_TARGETS, TARGET_CONFIGS))}
    if algorithm in ("EAGLE", "EAGLE3") or (algorithm == "MTP" and draw(st.booleans())) or draw(st.integers(0, 9)) == 0:
        out["draft"] = draw(model_ref(HUB_DRAFTS, DRAFT_CONFIGS))
    speculative: dict[str, Any] = {"algorithm": algorithm}
    for key, hi in (("numSteps", 40), ("topk", 40), ("numDraftTokens", 1100)):
        if draw(st.booleans()):
            speculative[key] = draw(st.integers(-1, hi))
    out["speculative"] = speculative
    if draw(st.booleans()):
        engine: dict[str, Any] = {}
        for key, hi in (("maxRunningRequests", 5000), ("contextLength", 2**25), ("cudaGraphMaxBatchSize", 5000),
                        ("terminationGracePeriodSeconds", 4000)):
            if draw(st.integers(0, 2)) == 0:
                engine[key] = draw(st.integers(0, hi))
        if draw(st.integers(0, 3)) == 0:
            engine["dtype"] = draw(st.sampled_from(("bfloat16", "float16", "float32", "int8")))
        if draw(st.integers(0, 3)) == 0:
            engine["image"] = draw(st.sampled_from(("registry.local/engine:1", " spaced ", "UPPER/Case:tag", "a@sha256:zz")))
        if draw(st.integers(0, 3)) == 0:
            engine["resources"] = {"requests": {draw(st.sampled_from(("cpu", "memory", "nvidia.com/gpu", "bad key!"))): draw(quantities)}}
        if draw(st.integers(0, 3)) == 0:
            engine["env"] = [{"name": draw(st.sampled_from(("A", "HF_HOME", "1BAD", "X"))), "value": draw(st.text(max_size=8))}
                             for _ in range(draw(st.integers(1, 3)))]
        out["engine"] = engine
    placement = draw(st.sampled_from(("gpu", "cpu", "both", "neither")))
    if placement in ("gpu", "both"):
        gpu: dict[str, Any] = {"product": draw(st.sampled_from(("h200", "h100", "a100-80g", "l40s", "b200")))}
        if draw(st.booleans()):
            gpu["perNode"] = draw(st.sampled_from((1, 2, 3, 4, 8, 16)))
        if draw(st.integers(0, 3)) == 0:
            gpu["memoryGiB"] = draw(st.integers(0, 2000))
        out["gpu"] = gpu
    if placement in ("cpu", "both"):
        out["cpu"] = {"memoryGiB": draw(st.integers(0, 5000))}
    if draw(st.integers(0, 3)) == 0:
        out["modelCache"] = draw(st.sampled_from((
            {}, {"claimName": "missing-claim"}, {"size": "50Gi"}, {"size": "lots"}, {"claimName": "c", "size": "1Gi"},
            {"accessModes": ["ReadWriteMany"], "storageClassName": "fast"}, {"accessModes": []},
        )))
    if draw(st.integers(0, 3)) == 0:
        out["hub"] = draw(st.sampled_from(({"endpoint": "http://127.0.0.1:9"}, {"endpoint": "ftp://x"},
                                           {"tokenSecretRef": {"name": "no-such-secret"}})))
    if draw(st.booleans()):
        out["replicas"] = draw(st.integers(-1, 3))
    return out


class Fuzzer:
    def __init__(self, cluster, namespace: str, operator):
        self.api_client = cluster.api_client()
        self.custom = client.CustomObjectsApi(self.api_client)
        self.namespace = namespace
        self.operator = operator
        self.count = 0
        self.outcomes: dict[str, int] = {}

    def note(self, outcome: str) -> None:
        self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1

    def create(self, body_spec: dict[str, Any]) -> dict[str, Any] | None:
        self.count += 1
        name = f"fuzz-{self.count}"
        body = {"apiVersion": "specdeploy.dev/v1alpha1", "kind": "SpecDecodeDeployment",
                "metadata": {"name": name}, "spec": body_spec}
        try:
            return self.custom.create_namespaced_custom_object("specdeploy.dev", "v1alpha1", self.namespace,
                                                               "specdecodedeployments", body)
        except ApiException as err:
            assert err.status == 422, f"{err.status} for {body_spec}: {err.body}"
            message = json.loads(err.body)["message"]
            assert "is invalid" in message and message.split("is invalid:", 1)[1].strip(), message
            self.note("rejected by the apiserver")
            return None

    def get(self, name: str) -> dict[str, Any]:
        return self.custom.get_namespaced_custom_object("specdeploy.dev", "v1alpha1", self.namespace,
                                                        "specdecodedeployments", name)

    def answered(self, created: dict[str, Any]) -> dict[str, Any]:
        name = created["metadata"]["name"]

        def settled() -> dict[str, Any] | None:
            obj = self.get(name)
            st_ = obj.get("status") or {}
            plan_ready = next((c for c in st_.get("conditions") or [] if c["type"] == "PlanReady"), None)
            if (st_.get("observedGeneration") == obj["metadata"]["generation"] and st_.get("phase") in SETTLED_PHASES
                    and plan_ready is not None):
                return obj
            return None

        try:
            obj = wait_for(settled, timeout_s=ANSWER_TIMEOUT_S, interval_s=0.2, what=f"the operator's answer to {name}")
        except TimeoutError:
            pytest.fail(f"{name} stuck: status {self.get(name).get('status')!r}\nspec {created['spec']!r}\n"
                        f"operator log tail:\n{self.operator.logs()[-3000:]}")
        st_ = obj["status"]
        for condition in st_["conditions"]:
            assert condition.get("reason"), condition
            if condition["status"] == "False" and condition["type"] in ("PlanReady", "Ready"):
                assert condition.get("message"), condition
        plan_ready = next(c for c in st_["conditions"] if c["type"] == "PlanReady")
        self.note(f"{st_['phase']}/{plan_ready['reason']}")
        return obj

    def delete(self, name: str) -> None:
        try:
            self.custom.delete_namespaced_custom_object("specdeploy.dev", "v1alpha1", self.namespace,
                                                        "specdecodedeployments", name)
        except ApiException:
            pass


def test_generated_resources_are_rejected_with_a_reason_or_answered(
    kube_cluster, kube_namespace, operator_process, hub_secret, capsys,
):
    operator = operator_process(metrics_interval_s=0)
    fuzzer = Fuzzer(kube_cluster, kube_namespace, operator)

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(spec())
    def one(body_spec):
        assert operator.proc.poll() is None, f"the operator exited:\n{operator.logs()[-3000:]}"
        created = fuzzer.create(body_spec)
        if created is not None:
            fuzzer.answered(created)
            fuzzer.delete(created["metadata"]["name"])

    t0 = time.monotonic()
    try:
        one()
    finally:
        fuzzer.api_client.close()
    with capsys.disabled():
        print(f"\nresource fuzz: {fuzzer.count} resources in {time.monotonic() - t0:.0f} s: "
              + json.dumps(dict(sorted(fuzzer.outcomes.items())), indent=1))
    assert operator.proc.poll() is None
    logs = operator.logs()
    assert "Traceback" not in logs, logs[-5000:]
    # The generator reaches both sides of the validation.
    assert fuzzer.outcomes.get("rejected by the apiserver", 0) > 0
    assert sum(v for k, v in fuzzer.outcomes.items() if k != "rejected by the apiserver") > 0
