"""A plan of two nodes on the real control plane: without the LeaderWorkerSet CRD the resource
says LeaderWorkerSetMissing and how to install it, and nothing is deployed; with LWS v0.9.0's CRD
(read from the Go module cache, lws_module.py) the operator applies a LeaderWorkerSet that the
API server accepts, replicas and `kubectl scale` count groups, the group's status reaches the
resource's, and a plan that fits one node again replaces the group with a Deployment.

The LWS controller is not running here (tests/cluster/README.md, LeaderWorkerSet): the group's
status is written through its status subresource as that controller writes it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import lws_module
from testcluster import wait_for

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def manifest_405b(name: str, product: str = "h100") -> dict:
    return {
        "apiVersion": "specdeploy.dev/v1alpha1",
        "kind": "SpecDecodeDeployment",
        "metadata": {"name": name},
        "spec": {
            "target": {"model": "meta-llama/Llama-3.1-405B-Instruct",
                       "config": json.loads((CONFIGS / "llama-3.1-405b-instruct.json").read_text())},
            "draft": {"model": "/models/eagle3-llama3.1-instruct-405b",
                      "config": json.loads((CONFIGS / "eagle3-llama3.1-instruct-405b.json").read_text())},
            "speculative": {"algorithm": "EAGLE3", "numSteps": 3, "topk": 1, "numDraftTokens": 4},
            "engine": {"maxRunningRequests": 32, "contextLength": 8192},
            "gpu": {"product": product, "perNode": 8, "maxNodes": 2},
            "replicas": 1,
        },
    }


@pytest.fixture
def no_lws(kube_cluster):
    lws_module.uninstall_crd(kube_cluster)
    yield
    lws_module.uninstall_crd(kube_cluster)  # the cluster is shared by the session: leave it as found


def lws_of(kube_cluster, namespace: str, name: str) -> dict | None:
    out = kube_cluster.kubectl("get", "lws", name, "-n", namespace, "-o", "json", check=False)
    return json.loads(out.stdout) if out.returncode == 0 else None


def test_two_node_plan_without_lws_then_with_it(kube_cluster, kube_namespace, no_lws, operator, sdd_of):
    kube_cluster.apply(manifest_405b("llama405b"), namespace=kube_namespace)
    sdd = sdd_of("llama405b")

    # 1. No LWS on the cluster: a condition that says so and how to install it; nothing runs.
    missing = wait_for(lambda: (c := sdd.condition("Ready")).get("reason") == "LeaderWorkerSetMissing" and c,
                       timeout_s=60, what="LeaderWorkerSetMissing")
    assert "kubectl apply --server-side -f https://github.com/kubernetes-sigs/lws/releases/download/v0.9.0/manifests.yaml" \
        in missing["message"]
    assert sdd.condition("PlanReady")["status"] == "True"
    assert sdd.condition("Degraded")["reason"] == "LeaderWorkerSetMissing"
    assert sdd.status()["plan"]["nodes"] == 2 and sdd.status()["plan"]["tensorParallelSize"] == 16
    assert sdd.deployment() is None
    assert "LeaderWorkerSetMissing" in {e["reason"] for e in sdd.events()}

    # 2. LWS installed: the operator's retry applies the group, which the API server validates
    # against LWS's own schema.
    lws_module.install_crd(kube_cluster)
    group = wait_for(lambda: lws_of(kube_cluster, kube_namespace, "llama405b"), timeout_s=60, what="LeaderWorkerSet")
    spec = group["spec"]
    assert spec["replicas"] == 1
    assert spec["leaderWorkerTemplate"]["size"] == 2
    assert spec["leaderWorkerTemplate"]["restartPolicy"] == "RecreateGroupOnPodRestart"
    assert spec["startupPolicy"] == "LeaderCreated"
    leader = spec["leaderWorkerTemplate"]["leaderTemplate"]["spec"]["containers"][0]
    worker = spec["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]
    assert leader["resources"]["limits"]["nvidia.com/gpu"] == 8 and worker["resources"]["limits"]["nvidia.com/gpu"] == 8
    assert "readinessProbe" in leader and "readinessProbe" not in worker
    assert group["metadata"]["ownerReferences"][0]["kind"] == "SpecDecodeDeployment"
    service = kube_cluster.kubectl_json("get", "service", "llama405b", "-n", kube_namespace)
    assert service["spec"]["selector"]["leaderworkerset.sigs.k8s.io/worker-index"] == "0"
    assert sdd.deployment() is None
    wait_for(lambda: sdd.status().get("phase") == "Deploying", timeout_s=30, what="phase Deploying")

    # 3. The group's status, written as the LWS controller writes it, reaches the resource.
    def set_group_status(ready: int, replicas: int) -> None:
        current = lws_of(kube_cluster, kube_namespace, "llama405b")
        body = {"status": {"replicas": replicas, "readyReplicas": ready, "updatedReplicas": replicas,
                           "observedGeneration": current["metadata"]["generation"]}}
        kube_cluster.kubectl("patch", "lws", "llama405b", "-n", kube_namespace, "--subresource=status",
                             "--type=merge", "-p", json.dumps(body))

    set_group_status(ready=1, replicas=1)
    st = sdd.wait_ready(timeout_s=30)
    assert st["serving"]["readyReplicas"] == 1
    assert st["serving"]["selector"].endswith("leaderworkerset.sigs.k8s.io/worker-index=0")

    # 4. Scaling counts groups.
    kube_cluster.kubectl("scale", "sdd", "llama405b", "-n", kube_namespace, "--replicas=2")
    wait_for(lambda: lws_of(kube_cluster, kube_namespace, "llama405b")["spec"]["replicas"] == 2,
             timeout_s=30, what="2 groups")
    set_group_status(ready=2, replicas=2)
    wait_for(lambda: sdd.status()["serving"].get("readyReplicas") == 2 and sdd.status()["phase"] == "Ready",
             timeout_s=30, what="2 groups ready")

    # 5. On H200 the plan fits one node: a Deployment replaces the group.
    kube_cluster.kubectl("patch", "sdd", "llama405b", "-n", kube_namespace, "--type=merge",
                         "-p", json.dumps({"spec": {"gpu": {"product": "h200"}}}))
    deployment = wait_for(sdd.deployment, timeout_s=60, what="engine Deployment")
    assert int(deployment["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"]) == 8
    wait_for(lambda: lws_of(kube_cluster, kube_namespace, "llama405b") is None, timeout_s=60, what="LWS removed")
    service = kube_cluster.kubectl_json("get", "service", "llama405b", "-n", kube_namespace)
    assert "leaderworkerset.sigs.k8s.io/worker-index" not in service["spec"]["selector"]
    assert sdd.status()["plan"]["nodes"] == 1
