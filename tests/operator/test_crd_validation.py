"""`kubectl apply` refuses what the CRD's schema and CEL rules can judge (no operator running)."""

from __future__ import annotations

import pytest
from testcluster import KubeCluster, KubectlError

LLAMA = {"model": "meta-llama/Llama-3.1-8B-Instruct"}
EAGLE3 = {"model": "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B"}


def spec(**overrides):
    base = {
        "target": dict(LLAMA),
        "draft": dict(EAGLE3),
        "speculative": {"algorithm": "EAGLE3", "numSteps": 3, "topk": 1, "numDraftTokens": 4},
        "gpu": {"product": "h200"},
    }
    base.update(overrides)
    return {k: v for k, v in base.items() if v is not None}


INVALID = {
    "eagle3-without-draft": (spec(draft=None), "spec.draft is required when speculative.algorithm is EAGLE or EAGLE3"),
    "eagle-without-draft": (spec(draft=None, speculative={"algorithm": "EAGLE"}), "spec.draft is required"),
    "none-with-draft": (spec(speculative={"algorithm": "NONE"}), "spec.draft must be absent"),
    "unknown-algorithm": (spec(speculative={"algorithm": "MEDUSA"}), "Unsupported value: \"MEDUSA\""),
    "chain-draft-tokens": (
        spec(speculative={"algorithm": "EAGLE3", "numSteps": 3, "topk": 1, "numDraftTokens": 8}),
        "numDraftTokens must equal numSteps + 1",
    ),
    "tree-without-draft-tokens": (
        spec(speculative={"algorithm": "EAGLE3", "numSteps": 3, "topk": 4}),
        "numDraftTokens is required when topk > 1",
    ),
    "tree-beyond-candidate-pool": (
        # pool = topk + (steps - 1) * topk^2 = 2 + 1 * 4 = 6, so at most 7 draft tokens
        spec(speculative={"algorithm": "EAGLE3", "numSteps": 2, "topk": 2, "numDraftTokens": 8}),
        "must not exceed the candidate pool",
    ),
    "adaptive-without-draft": (
        spec(draft=None, speculative={"algorithm": "NONE", "adaptive": True}),
        "adaptive speculation needs a draft",
    ),
    "draft-quantization-without-draft": (
        spec(draft=None, speculative={"algorithm": "NONE", "draftQuantization": "fp8"}),
        "draftQuantization applies to EAGLE and EAGLE3 heads",
    ),
    "unknown-draft-quantization": (
        spec(speculative={"algorithm": "EAGLE3", "draftQuantization": "int4"}), "Unsupported value: \"int4\"",
    ),
    "zero-steps": (spec(speculative={"algorithm": "EAGLE3", "numSteps": 0, "topk": 1}), "spec.speculative.numSteps"),
    "two-config-sources": (
        spec(target={**LLAMA, "config": {"hidden_size": 1}, "configMapRef": {"name": "c"}}),
        "set at most one of config and configMapRef",
    ),
    "local-path-from-hub": (spec(target={"model": "/models/llama"}), "a local model path cannot be read from the hub"),
    "dot-dot-model": (spec(target={"model": "org/../etc"}), "must not contain '.' or '..'"),
    # Rendered as `--target VALUE`: a leading '-' would be read as a flag.
    "dash-model": (spec(target={"model": "--plan=/tmp/x"}), "spec.target.model"),
    "dash-draft": (spec(draft={"model": "-x/eagle"}), "spec.draft.model"),
    "dot-dot-revision": (spec(target={**LLAMA, "revision": "refs/../../etc"}), "must not contain '.' or '..'"),
    "dot-revision": (spec(draft={**EAGLE3, "revision": "."}), "must not contain '.' or '..'"),
    "dash-revision": (spec(target={**LLAMA, "revision": "--help"}), "spec.target.revision"),
    "api-key-secret-without-name": (spec(engine={"apiKeySecretRef": {"key": "k"}}), "spec.engine.apiKeySecretRef.name"),
    "unknown-gpu": (spec(gpu={"product": "b200"}), "spec.gpu.product"),
    "graph-batch-over-running": (
        spec(engine={"maxRunningRequests": 8, "cudaGraphMaxBatchSize": 16}),
        "cudaGraphMaxBatchSize must not exceed maxRunningRequests",
    ),
    "negative-replicas": (spec(replicas=-1), "spec.replicas"),
    # CPU mode (spec.cpu) replaces spec.gpu: exactly one of the two.
    "gpu-and-cpu": (spec(cpu={"memoryGiB": 3}), "set exactly one of spec.gpu (GPU nodes) and spec.cpu"),
    "cpu-with-gpu-per-node": (
        spec(gpu={"product": "h100", "perNode": 1}, cpu={"memoryGiB": 3}),
        "set exactly one of spec.gpu (GPU nodes) and spec.cpu",
    ),
    "neither-gpu-nor-cpu": (spec(gpu=None), "set exactly one of spec.gpu (GPU nodes) and spec.cpu"),
    "cpu-without-memory": (spec(gpu=None, cpu={}), "spec.cpu.memoryGiB"),
    "cpu-zero-memory": (spec(gpu=None, cpu={"memoryGiB": 0}), "spec.cpu.memoryGiB"),
    "cpu-with-cuda-graphs": (
        spec(gpu=None, cpu={"memoryGiB": 3}, engine={"cudaGraphMaxBatchSize": 4}),
        "cudaGraphMaxBatchSize has no meaning in CPU mode",
    ),
    "cpu-asking-for-a-gpu": (
        spec(gpu=None, cpu={"memoryGiB": 3}, engine={"resources": {"limits": {"nvidia.com/gpu": 1}}}),
        "must not ask for nvidia.com/gpu in CPU mode",
    ),
    "hub-endpoint-not-http": (spec(hub={"endpoint": "ftp://hub"}), "spec.hub.endpoint"),
    "zero-max-nodes": (spec(gpu={"product": "h100", "maxNodes": 0}), "spec.gpu.maxNodes"),
    "too-many-nodes": (spec(gpu={"product": "h100", "maxNodes": 65}), "spec.gpu.maxNodes"),
    "cpu-zero-nodes": (spec(gpu=None, cpu={"memoryGiB": 3, "nodes": 0}), "spec.cpu.nodes"),
    "nodes-with-disaggregation": (
        spec(gpu={"product": "h100", "maxNodes": 2}, disaggregation={}),
        "spec.disaggregation runs each role on one node",
    ),
}


def apply(cluster: KubeCluster, namespace: str, name: str, spec_: dict) -> None:
    cluster.apply(
        {"apiVersion": "specdeploy.dev/v1alpha1", "kind": "SpecDecodeDeployment", "metadata": {"name": name}, "spec": spec_},
        namespace=namespace,
    )


@pytest.fixture(scope="module")
def validation_namespace(kube_cluster: KubeCluster, crd: str):
    name = "crd-validation"
    kube_cluster.kubectl("create", "namespace", name, check=False)
    yield name
    kube_cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


@pytest.mark.parametrize("case", list(INVALID))
def test_invalid_resource_is_rejected(kube_cluster, validation_namespace, case):
    bad_spec, expected = INVALID[case]
    with pytest.raises(KubectlError) as err:
        apply(kube_cluster, validation_namespace, f"bad-{case}", bad_spec)
    assert expected in str(err.value)


def test_bad_name_is_rejected(kube_cluster, validation_namespace):
    with pytest.raises(KubectlError) as err:
        apply(kube_cluster, validation_namespace, "9lives", spec())
    assert "must be a DNS-1035 label" in str(err.value)


VALID = {
    "eagle3-chain": spec(),
    "eagle-tree": spec(draft=dict(EAGLE3), speculative={"algorithm": "EAGLE", "numSteps": 3, "topk": 4, "numDraftTokens": 16}),
    "mtp-without-draft": spec(draft=None, speculative={"algorithm": "MTP", "numSteps": 1, "topk": 1}),
    "none": spec(draft=None, speculative={"algorithm": "NONE"}),
    "adaptive": spec(speculative={"algorithm": "EAGLE3", "numSteps": 3, "topk": 1, "adaptive": True}),
    "inline-config": spec(target={"model": "/models/llama", "config": {"hidden_size": 8}}),
    "config-map": spec(draft={"model": "/models/eagle", "configMapRef": {"name": "eagle-config"}}),
}


@pytest.mark.parametrize("case", list(VALID))
def test_valid_resource_is_accepted_with_defaults(kube_cluster, validation_namespace, case):
    apply(kube_cluster, validation_namespace, case, VALID[case])
    stored = kube_cluster.kubectl_json("get", "sdd", case, "-n", validation_namespace)["spec"]
    assert stored["replicas"] == 1
    assert stored["target"]["revision"] == "main"
    assert stored["engine"]["maxRunningRequests"] == 32 and stored["engine"]["contextLength"] == 8192
    assert stored["gpu"]["perNode"] == 8
    assert stored["speculative"]["adaptive"] is (case == "adaptive")
    if "configMapRef" in stored.get("draft", {}):
        assert stored["draft"]["configMapRef"]["key"] == "config.json"


def test_cpu_mode_is_accepted_without_gpu_defaults(kube_cluster, validation_namespace):
    apply(kube_cluster, validation_namespace, "cpu-mode", spec(
        gpu=None, cpu={"memoryGiB": 3}, engine={"resources": {"requests": {"cpu": "2", "memory": "3Gi"}}},
    ))
    stored = kube_cluster.kubectl_json("get", "sdd", "cpu-mode", "-n", validation_namespace)["spec"]
    assert stored["cpu"] == {"memoryGiB": 3} and "gpu" not in stored
    assert stored["engine"]["maxRunningRequests"] == 32
