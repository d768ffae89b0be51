"""spec.pod on the real control plane: the CRD validates the fields, the operator renders them,
the apiserver admits the pods (under the namespace's Pod Security "restricted" enforcement) and
kube-scheduler places them by the merged node selector, tolerations, GPU affinity and spread.

Four kwok nodes of the test's own join the session's nodes: two H200 nodes in zones a and b of a
tainted `pool=inference`, an H100 node of the same pool (the GPU product affinity must keep the
engine off it) and an H200 node of the pool without the label zone (a spread constraint with
DoNotSchedule never picks it). The session's untainted H200 nodes lack the pool label."""

from __future__ import annotations

import uuid

import pytest
from testcluster import KubectlError, wait_for
from testcluster import FakeNode

TAINT = ("dedicated", "inference", "NoSchedule")


@pytest.fixture
def pool_nodes(kube_cluster):
    suffix = uuid.uuid4().hex[:5]
    pool = (("pool", "inference"),)
    nodes = [
        FakeNode(f"pool-h200-a-{suffix}", "NVIDIA-H200", 143771, extra_labels=pool + (("zone", "a"),), taints=(TAINT,)),
        FakeNode(f"pool-h200-b-{suffix}", "NVIDIA-H200", 143771, extra_labels=pool + (("zone", "b"),), taints=(TAINT,)),
        FakeNode(f"pool-h100-a-{suffix}", "NVIDIA-H100-80GB-HBM3", 81559, extra_labels=pool + (("zone", "a"),), taints=(TAINT,)),
        FakeNode(f"pool-h200-nozone-{suffix}", "NVIDIA-H200", 143771, extra_labels=pool, taints=(TAINT,)),
    ]
    kube_cluster.add_fake_nodes(nodes)
    yield {n.name.rsplit("-", 1)[0]: n.name for n in nodes}
    kube_cluster.delete_nodes(n.name for n in nodes)


POD = {
    "labels": {"team": "search"},
    "annotations": {"example.com/owner": "search-infra"},
    "nodeSelector": {"pool": "inference"},
    "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "inference", "effect": "NoSchedule"}],
    "topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "zone", "whenUnsatisfiable": "DoNotSchedule"}],
    "priorityClassName": "PRIORITY",
    "runtimeClassName": "RUNTIME",
    "serviceAccountName": "engine",
    "imagePullSecrets": [{"name": "registry-creds"}],
}


def test_pod_fields_reach_the_scheduler(kube_cluster, kube_namespace, operator, hub_secret, manifest, sdd_of, pool_nodes):
    priority, runtime = f"inference-{kube_namespace}", f"nvidia-{kube_namespace}"
    kube_cluster.kubectl("label", "namespace", kube_namespace, "pod-security.kubernetes.io/enforce=restricted")
    kube_cluster.apply([
        {"apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass", "metadata": {"name": priority}, "value": 100000},
        {"apiVersion": "node.k8s.io/v1", "kind": "RuntimeClass", "metadata": {"name": runtime}, "handler": "nvidia"},
    ])
    try:
        kube_cluster.apply({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "engine"}},
                           namespace=kube_namespace)
        pod = {**POD, "priorityClassName": priority, "runtimeClassName": runtime}
        kube_cluster.apply(manifest("placed", pod=pod, replicas=2), namespace=kube_namespace)
        sdd = sdd_of("placed")
        pods = wait_for(lambda: len(r := [p for p in sdd.pods() if p["status"].get("phase") == "Running"]) == 2 and r,
                        timeout_s=60, what="2 engine pods Running")
        # One per zone of the pool's H200 nodes: not the H100 (GPU product), not the zoneless node
        # (spread), not the session's nodes (node selector), despite the taint (toleration).
        assert sorted(p["spec"]["nodeName"] for p in pods) == sorted([pool_nodes["pool-h200-a"], pool_nodes["pool-h200-b"]])
        for p in pods:
            assert p["metadata"]["labels"]["team"] == "search"
            assert p["metadata"]["annotations"]["example.com/owner"] == "search-infra"
            assert p["spec"]["serviceAccountName"] == "engine"
            assert p["spec"]["imagePullSecrets"] == [{"name": "registry-creds"}]
            # The apiserver resolved the class: its value is the pod's priority.
            assert p["spec"]["priorityClassName"] == priority and p["spec"]["priority"] == 100000
            assert p["spec"]["runtimeClassName"] == runtime
            # Admitted by Pod Security "restricted": the rendered contexts satisfy it.
            assert p["spec"]["securityContext"]["runAsNonRoot"] is True
        sdd.wait_ready()

        # A third replica: skew 1 allows zone a or b again, the zoneless node never (DoNotSchedule
        # needs the topology key), the H100 never.
        kube_cluster.kubectl("patch", "sdd", "placed", "-n", kube_namespace, "--type=merge", "-p", '{"spec":{"replicas":3}}')
        pods = wait_for(lambda: len(r := [p for p in sdd.pods() if p["status"].get("phase") == "Running"]) == 3 and r,
                        timeout_s=60, what="3 engine pods Running")
        nodes = sorted(p["spec"]["nodeName"] for p in pods)
        assert set(nodes) == {pool_nodes["pool-h200-a"], pool_nodes["pool-h200-b"]}
        assert sorted(nodes.count(n) for n in set(nodes)) == [1, 2]
    finally:
        kube_cluster.kubectl("delete", "priorityclass", priority, "--ignore-not-found", check=False)
        kube_cluster.kubectl("delete", "runtimeclass", runtime, "--ignore-not-found", check=False)


@pytest.mark.parametrize("pod, message", [
    ({"labels": {"app.kubernetes.io/instance": "other"}}, "pod labels must not use the keys the operator sets"),
    ({"annotations": {"specdeploy.dev/config-hash": "x"}}, "pod annotations must not use specdeploy.dev/ keys"),
    ({"tolerations": [{"key": "a", "operator": "Sometimes"}]}, "Unsupported value: \"Sometimes\""),
    ({"tolerations": [{"key": "a", "operator": "Exists", "value": "b"}]}, "operator Exists matches any value"),
    ({"topologySpreadConstraints": [{"maxSkew": 0, "topologyKey": "zone", "whenUnsatisfiable": "DoNotSchedule"}]},
     "should be greater than or equal to 1"),
    ({"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"operator": "In"}]}]}}}}, "key: Required value"),
    ({"imagePullSecrets": [{}]}, "name: Required value"),
    ({"serviceAccountName": "Not_A_Name"}, "serviceAccountName"),
])
def test_crd_refuses_bad_pod_fields(kube_cluster, kube_namespace, crd, manifest, pod, message):
    with pytest.raises(KubectlError) as err:
        kube_cluster.apply(manifest("refused", pod=pod), namespace=kube_namespace)
    assert message in str(err.value)


def test_crd_refuses_bad_role_pod_fields(kube_cluster, kube_namespace, crd, manifest):
    bad = {"decode": {"pod": {"labels": {"specdeploy.dev/role": "prefill"}}}}
    with pytest.raises(KubectlError) as err:
        kube_cluster.apply(manifest("refused", disaggregation=bad), namespace=kube_namespace)
    assert "spec.disaggregation.decode.pod.labels" in str(err.value)
