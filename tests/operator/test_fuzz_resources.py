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
import yaml
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
    for _ in range(draw(st.sampled_from((0, 0, 0, 1, 2)))):
        key = draw(st.sampled_from(sorted(config)))
        if draw(st.booleans()):
            config.pop(key)
        else:
            config[key] = draw(odd_values)
    return config


@st.composite
def model_ref(draw, hub_models: tuple[str, ...], config_names: tuple[str, ...]) -> dict[str, Any]:
    source = draw(st.sampled_from(("hub", "hub", "inline", "inline", "path-inline", "configMapRef")))
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
    if draw(st.integers(0, 3)) == 0:
        ref["revision"] = draw(st.sampled_from(("main", "v1.0", "0123456789abcdef0123456789abcdef01234567")))
    return ref


quantities = st.one_of(st.sampled_from(("1", "500m", "2Gi", "3G", "1e3", "abc", "-1", "1.5Ti", "0")), st.integers(-2, 64))

# Edits that break a rule of the CRD, applied to some of the otherwise schema-valid resources.
BREAKS = (
    lambda s: s["speculative"].update(algorithm="MEDUSA"),
    lambda s: s["speculative"].update(numSteps=0),
    lambda s: s["speculative"].update(topk=1, numSteps=3, numDraftTokens=7),
    lambda s: s.update(cpu={"memoryGiB": 4}, gpu={"product": "h200"}),
    lambda s: (s.pop("gpu", None), s.pop("cpu", None)),
    lambda s: s["target"].update(model="../etc/passwd"),
    lambda s: s["target"].update(model="/abs/path", config=None) or s["target"].pop("config"),
    lambda s: s.update(replicas=-1),
    lambda s: s.setdefault("engine", {}).update(maxRunningRequests=0),
    lambda s: s.update(modelCache={"claimName": "c", "size": "1Gi"}),
    lambda s: s.update(modelCache={"size": "lots"}),
    lambda s: s.update(hub={"endpoint": "ftp://x"}),
    lambda s: s["target"].update(model="a b"),
    lambda s: s["target"].update(revision="bad rev"),
    lambda s: s["target"].update(configMapRef={"name": "x"}, config={}),
)


@st.composite
def spec(draw) -> dict[str, Any]:
    algorithm = draw(st.sampled_from(("EAGLE", "EAGLE3", "MTP", "NONE")))
    out: dict[str, Any] = {"target": draw(model_ref(HUB_TARGETS, TARGET_CONFIGS))}
    if algorithm in ("EAGLE", "EAGLE3") or (algorithm == "MTP" and draw(st.integers(0, 3)) == 0):
        out["draft"] = draw(model_ref(HUB_DRAFTS, DRAFT_CONFIGS))
    speculative: dict[str, Any] = {"algorithm": algorithm}
    steps = draw(st.integers(1, 8))
    speculative["numSteps"] = steps
    if draw(st.booleans()):
        speculative["topk"] = 1
        if draw(st.booleans()):
            speculative["numDraftTokens"] = steps + 1
    else:
        topk = draw(st.integers(2, 4))
        speculative["topk"] = topk
        speculative["numDraftTokens"] = draw(st.integers(2, 1 + topk + (steps - 1) * topk * topk))
    out["speculative"] = speculative
    on_gpu = draw(st.booleans())
    if on_gpu:
        gpu: dict[str, Any] = {"product": draw(st.sampled_from(("h200", "h100", "a100-80g", "l40s")))}
        if draw(st.booleans()):
            gpu["perNode"] = draw(st.sampled_from((1, 2, 4, 8)))
        if draw(st.integers(0, 3)) == 0:
            gpu["memoryGiB"] = draw(st.integers(1, 1024))
        out["gpu"] = gpu
    else:
        out["cpu"] = {"memoryGiB": draw(st.integers(1, 4096))}
    if draw(st.booleans()):
        engine: dict[str, Any] = {}
        running = draw(st.integers(1, 4096))
        if draw(st.booleans()):
            engine["maxRunningRequests"] = running
        if on_gpu and "maxRunningRequests" in engine and draw(st.integers(0, 2)) == 0:
            engine["cudaGraphMaxBatchSize"] = draw(st.integers(1, running))
        if draw(st.booleans()):
            engine["contextLength"] = draw(st.integers(1, 2**24))
        if draw(st.integers(0, 3)) == 0:
            engine["terminationGracePeriodSeconds"] = draw(st.integers(0, 3600))
        if draw(st.integers(0, 3)) == 0:
            engine["dtype"] = draw(st.sampled_from(("bfloat16", "float16", "float32")))
        if draw(st.integers(0, 3)) == 0:
            engine["image"] = draw(st.sampled_from(("registry.local/engine:1", " spaced ", "UPPER/Case:tag", "a@sha256:zz")))
        if draw(st.integers(0, 3)) == 0:
            key = draw(st.sampled_from(("cpu", "memory", "ephemeral-storage", "bad key!", "example.com/widget")))
            engine["resources"] = {draw(st.sampled_from(("requests", "limits"))): {key: draw(quantities)}}
        if draw(st.integers(0, 3)) == 0:
            engine["env"] = [{"name": draw(st.sampled_from(("A", "HF_HOME", "1BAD", "X=Y", "PATH"))),
                              "value": draw(st.text(max_size=8))} for _ in range(draw(st.integers(1, 3)))]
        if draw(st.integers(0, 5)) == 0:
            engine["imagePullPolicy"] = draw(st.sampled_from(("Always", "IfNotPresent", "Never")))
        out["engine"] = engine
    if draw(st.integers(0, 3)) == 0:
        out["modelCache"] = draw(st.sampled_from((
            {}, {"claimName": "missing-claim"}, {"size": "50Gi"}, {"size": "1"}, {"size": "0.5Ti"},
            {"accessModes": ["ReadWriteMany"], "storageClassName": "fast"}, {"accessModes": ["ReadOnlyMany"]},
        )))
    # The test hub wants the token of the hub-token Secret; now and then a wrong one, or no hub.
    out["hub"] = draw(st.sampled_from((
        {"tokenSecretRef": {"name": "hub-token"}}, {"tokenSecretRef": {"name": "hub-token"}},
        {"tokenSecretRef": {"name": "hub-token"}}, {"endpoint": "http://127.0.0.1:9"},
        {"tokenSecretRef": {"name": "no-such-secret"}}, {"tokenSecretRef": {"name": "hub-token", "key": "nope"}}, {},
    )))
    if draw(st.booleans()):
        out["replicas"] = draw(st.integers(0, 3))
    if draw(st.integers(0, 3)) == 0:
        draw(st.sampled_from(BREAKS))(out)
    return out


class Fuzzer:
    def __init__(self, cluster, namespace: str, operator):
        self.api_client = cluster.api_client()
        self.custom = client.CustomObjectsApi(self.api_client)
        self.namespace = namespace
        self.operator = operator
        self.count = 0
        self.outcomes: dict[str, int] = {}
        self.rejections: list[str] = []

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
            self.rejections.append(message.split("is invalid:", 1)[1].strip()[:160])
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
              + json.dumps(dict(sorted(fuzzer.outcomes.items())), indent=1)
              + "\nrejections, e.g.:\n  " + "\n  ".join(sorted(set(fuzzer.rejections))[:12]))
    assert operator.proc.poll() is None
    logs = operator.logs()
    assert "Traceback" not in logs, logs[-5000:]
    # The generator reaches both sides of the validation.
    assert fuzzer.outcomes.get("rejected by the apiserver", 0) > 0
    assert sum(v for k, v in fuzzer.outcomes.items() if k != "rejected by the apiserver") > 0


def test_a_spec_whose_deployment_the_apiserver_refuses_fails_with_its_message(
    kube_cluster, kube_namespace, operator, sdd_of,
):
    """Found by the fuzzer: an extended resource requested without a limit passes the CRD, but
    the API server refuses the Deployment it renders (422). The resource used to stay in
    Planning while the handler raised and retried with a traceback; now it is Failed with the API
    server's own message, and no engine is left from an earlier spec."""
    example = yaml.safe_load((Path(__file__).resolve().parents[2] / "manifests/examples/tiny-cpu-demo.yaml").read_text())
    example["metadata"]["name"] = "widget"
    kube_cluster.apply(example, namespace=kube_namespace)
    sdd = sdd_of("widget")
    sdd.wait_ready()
    kube_cluster.kubectl("patch", "sdd", "widget", "-n", kube_namespace, "--type=merge", "-p",
                         json.dumps({"spec": {"engine": {"resources": {"requests": {"example.com/widget": 1}}}}}))
    failed = wait_for(lambda: (s := sdd.status()).get("phase") == "Failed" and s, timeout_s=30, what="Failed")
    condition = sdd.condition("PlanReady")
    assert condition["status"] == "False" and condition["reason"] == "EngineSpecInvalid"
    assert "Limit must be set for non overcommitable resources" in condition["message"]
    assert failed["observedGeneration"] == sdd.get()["metadata"]["generation"]
    wait_for(lambda: sdd.deployment() is None, timeout_s=30, what="the old engine Deployment removed")
