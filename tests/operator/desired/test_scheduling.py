"""spec.pod rendered into the engine pods (and each role's): merges with the operator's GPU
affinity and toleration, the router's share, and the security contexts with their writable
volumes (pure; tests/operator/test_pods.py applies them on the real apiserver)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

from specdeploy.operator.desired import render, roles, scheduling, security
from specdeploy.operator.desired.planning import plan_engine

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
DEFAULTS = render.EngineDefaults(image="registry.local/specdeploy-engine:test", hub_endpoint="https://hub.local")


def config(name: str) -> dict:
    return json.loads((CONFIGS / f"{name}.json").read_text())


def make_sdd(**spec_overrides) -> dict:
    spec = {
        "target": {"model": "meta-llama/Llama-3.3-70B-Instruct"},
        "draft": {"model": "yuhuili/EAGLE3-LLaMA3.3-Instruct-70B"},
        "speculative": {"algorithm": "EAGLE3", "numSteps": 3, "topk": 1, "numDraftTokens": 4},
        "engine": {"maxRunningRequests": 32, "contextLength": 8192},
        "gpu": {"product": "h200", "perNode": 8},
        "replicas": 2,
        **spec_overrides,
    }
    return {"apiVersion": "specdeploy.dev/v1alpha1", "kind": "SpecDecodeDeployment",
            "metadata": {"name": "llama70b", "namespace": "serving", "uid": "0000-uid", "generation": 1}, "spec": spec}


def planned_for(sdd: dict):
    return plan_engine(sdd["spec"], config("llama-3.3-70b-instruct"), config("eagle3-llama3.3-instruct-70b"))


def make_roles_sdd(**disaggregation) -> dict:
    sdd = make_sdd(target={"model": "meta-llama/Llama-3.1-8B-Instruct"},
                   draft={"model": "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B"}, replicas=1)
    sdd["metadata"]["name"] = "llama8b"
    sdd["spec"]["disaggregation"] = {"prefill": {"replicas": 1}, "decode": {"replicas": 3},
                                     "router": {"replicas": 2}, **disaggregation}
    return sdd


def planned_roles(sdd: dict):
    return plan_engine(sdd["spec"], config("llama-3.1-8b-instruct"), config("eagle3-llama3.1-instruct-8b"))

GPU_EXPRESSION = {"key": "nvidia.com/gpu.product", "operator": "In", "values": ["NVIDIA-H200"]}
GPU_TOLERATION = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
POD = {
    "labels": {"team": "search", "cost-center": "42"},
    "annotations": {"prometheus.io/scrape": "true"},
    "nodeSelector": {"pool": "inference"},
    "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "inference", "effect": "NoSchedule"},
                    GPU_TOLERATION],
    "affinity": {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
                {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]},
                {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["b"]}]},
            ]},
            "preferredDuringSchedulingIgnoredDuringExecution": [
                {"weight": 10, "preference": {"matchExpressions": [{"key": "fast", "operator": "Exists"}]}}],
        },
        "podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
            {"weight": 1, "podAffinityTerm": {"topologyKey": "kubernetes.io/hostname",
                                              "labelSelector": {"matchLabels": {"team": "search"}}}}]},
    },
    "topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "zone", "whenUnsatisfiable": "DoNotSchedule"}],
    "priorityClassName": "inference-high",
    "runtimeClassName": "nvidia",
    "serviceAccountName": "engine",
    "imagePullSecrets": [{"name": "registry-creds"}],
}


def pod_template(deployment):
    return deployment["spec"]["template"]


def test_pod_fields_reach_the_engine_pod_template_merged_with_the_gpu_placement():
    sdd = make_sdd(pod=copy.deepcopy(POD))
    children = render.render_children(sdd, planned_for(sdd), DEFAULTS)
    template = pod_template(children.deployment)
    pod = template["spec"]
    assert pod["nodeSelector"] == {"pool": "inference"}
    assert pod["priorityClassName"] == "inference-high" and pod["runtimeClassName"] == "nvidia"
    assert pod["serviceAccountName"] == "engine" and pod["imagePullSecrets"] == [{"name": "registry-creds"}]
    # The GPU toleration first and once, the user's after it.
    assert pod["tolerations"] == [GPU_TOLERATION, POD["tolerations"][0]]
    # Both of the user's terms (zone a OR zone b) keep the planned GPU product.
    terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert terms == [{"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}, GPU_EXPRESSION]},
                     {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["b"]}, GPU_EXPRESSION]}]
    assert pod["affinity"]["nodeAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"] == \
        POD["affinity"]["nodeAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert pod["affinity"]["podAntiAffinity"] == POD["affinity"]["podAntiAffinity"]
    # A spread constraint without a selector counts this resource's engine pods.
    (spread,) = pod["topologySpreadConstraints"]
    assert spread["labelSelector"] == {"matchLabels": children.deployment["spec"]["selector"]["matchLabels"]}
    # Labels and annotations added; the operator's own stay (the selector must still match).
    assert template["metadata"]["labels"]["team"] == "search"
    assert template["metadata"]["labels"]["app.kubernetes.io/instance"] == "llama70b"
    assert template["metadata"]["annotations"]["prometheus.io/scrape"] == "true"
    assert "specdeploy.dev/config-hash" in template["metadata"]["annotations"]
    # Not on the Deployment's own labels: spec.pod is about the pods.
    assert "team" not in children.deployment["metadata"]["labels"]


def test_without_spec_pod_the_gpu_placement_is_unchanged():
    sdd = make_sdd()
    pod = pod_template(render.render_children(sdd, planned_for(sdd), DEFAULTS).deployment)["spec"]
    assert pod["tolerations"] == [GPU_TOLERATION]
    assert pod["affinity"] == {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchExpressions": [GPU_EXPRESSION]}]}}}
    for key in ("nodeSelector", "priorityClassName", "serviceAccountName", "topologySpreadConstraints"):
        assert key not in pod


def test_cpu_mode_takes_the_users_affinity_as_given():
    affinity = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchExpressions": [{"key": "pool", "operator": "In", "values": ["cpu"]}]}]}}}
    assert scheduling.merge_affinity(None, affinity) == affinity
    assert scheduling.merge_affinity(None, None) == {}
    # A user's term of matchFields only still gets the GPU expression ANDed in.
    fields = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["n1"]}]}]}}}
    merged = scheduling.merge_affinity(GPU_EXPRESSION, fields)
    assert merged["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"] == [
        {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["n1"]}], "matchExpressions": [GPU_EXPRESSION]}]


def test_roles_merge_their_own_pod_block_and_the_router_takes_no_gpu_placement():
    sdd = make_roles_sdd(decode={"replicas": 3, "pod": {"nodeSelector": {"tier": "decode"}, "labels": {"role-owner": "d"},
                                                         "priorityClassName": "decode-high"}},
                         router={"replicas": 1, "pod": {"nodeSelector": {"pool": "cpu"}}})
    sdd["spec"]["pod"] = copy.deepcopy(POD)
    children = roles.render_roles(sdd, planned_roles(sdd), DEFAULTS)
    deployments = {o["metadata"]["name"]: o for o in children.all() if o["kind"] == "Deployment"}
    prefill, decode, router = (pod_template(deployments[f"llama8b-{r}"]) for r in ("prefill", "decode", "router"))
    assert prefill["spec"]["nodeSelector"] == {"pool": "inference"}
    assert prefill["spec"]["priorityClassName"] == "inference-high"
    assert decode["spec"]["nodeSelector"] == {"pool": "inference", "tier": "decode"}
    assert decode["spec"]["priorityClassName"] == "decode-high"
    assert decode["metadata"]["labels"]["team"] == "search" and decode["metadata"]["labels"]["role-owner"] == "d"
    # A role's spread constraint counts that role's pods.
    assert decode["spec"]["topologySpreadConstraints"][0]["labelSelector"]["matchLabels"]["specdeploy.dev/role"] == "decode"
    # The router: labels, priority, account and pull secrets from spec.pod; placement only its own.
    assert router["spec"]["nodeSelector"] == {"pool": "cpu"}
    assert "affinity" not in router["spec"] and "tolerations" not in router["spec"]
    assert "runtimeClassName" not in router["spec"] and "topologySpreadConstraints" not in router["spec"]
    assert router["spec"]["serviceAccountName"] == "engine" and router["metadata"]["labels"]["team"] == "search"


def test_every_pod_runs_restricted_with_writable_volumes_for_what_it_writes():
    sdd = make_sdd()
    pod = pod_template(render.render_children(sdd, planned_for(sdd), DEFAULTS).deployment)["spec"]
    assert pod["securityContext"] == {"runAsNonRoot": True, "runAsUser": 65532, "runAsGroup": 65532, "fsGroup": 65532,
                                      "seccompProfile": {"type": "RuntimeDefault"}}
    (container,) = pod["containers"]
    assert container["securityContext"] == {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                            "runAsNonRoot": True, "capabilities": {"drop": ["ALL"]}}
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    for path in ("/tmp", security.ENGINE_HOME, render.MODEL_CACHE_PATH, "/dev/shm"):
        assert path in mounts and mounts[path] in volumes
    assert volumes[mounts["/tmp"]] == {"name": "tmp", "emptyDir": {}}
    env = {v["name"]: v.get("value") for v in container["env"]}
    assert env["HOME"] == security.ENGINE_HOME and env["TMPDIR"] == "/tmp"


def test_security_contexts_are_merged_with_the_users_and_rdma_roles_keep_ipc_lock():
    sdd = make_roles_sdd(transferProtocol="rdma")
    sdd["spec"]["pod"] = {"securityContext": {"runAsUser": 1000770000, "fsGroup": 1000770000},
                          "containerSecurityContext": {"readOnlyRootFilesystem": False}}
    sdd["spec"]["engine"]["env"] = [{"name": "HOME", "value": "/data/home"}]
    children = roles.render_roles(sdd, planned_roles(sdd), DEFAULTS)
    deployments = {o["metadata"]["name"]: o for o in children.all() if o["kind"] == "Deployment"}
    decode = pod_template(deployments["llama8b-decode"])["spec"]
    assert decode["securityContext"]["runAsUser"] == 1000770000 and decode["securityContext"]["runAsNonRoot"] is True
    (container,) = decode["containers"]
    assert container["securityContext"]["readOnlyRootFilesystem"] is False
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["IPC_LOCK"]}
    assert [v["value"] for v in container["env"] if v["name"] == "HOME"] == ["/data/home"]
    router = pod_template(deployments["llama8b-router"])["spec"]
    assert router["containers"][0]["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    # The router's writable volumes, and the split roles' shared secret (read-only).
    assert {m["mountPath"] for m in router["containers"][0]["volumeMounts"]} == {
        "/tmp", security.ENGINE_HOME, roles.DISAGG_SECRET_MOUNT_PATH}
