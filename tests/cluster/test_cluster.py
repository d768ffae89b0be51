"""The test cluster is a real control plane: scheduling, API validation, logs, GC, RBAC, teardown."""

from __future__ import annotations

import dataclasses
import time
import uuid
from pathlib import Path

import pytest
from kubernetes import client as k8s

from testcluster import KubeCluster, KubectlError, Tools, ToolsMissing, wait_for
from specdeploy.localcluster.controlplane import DEFAULT_LOG_LINE

GROUP = "tests.specdeploy.dev"


def _pods(cluster: KubeCluster, namespace: str, selector: str) -> list[dict]:
    return cluster.kubectl_json("get", "pods", "-n", namespace, "-l", selector)["items"]


def _is_ready(pod: dict) -> bool:
    conditions = pod.get("status", {}).get("conditions", [])
    return pod["status"].get("phase") == "Running" and any(
        c["type"] == "Ready" and c["status"] == "True" for c in conditions
    )


def _gpu_pod(name: str, gpus: int, node_selector: dict[str, str] | None = None) -> dict:
    spec: dict = {
        "containers": [
            {
                "name": "engine",
                "image": "registry.invalid/specdeploy/engine:test",
                "resources": {"limits": {"nvidia.com/gpu": str(gpus)}},
            }
        ]
    }
    if node_selector:
        spec["nodeSelector"] = node_selector
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": {"app": name}}, "spec": spec}


def test_fake_gpu_nodes_advertise_gpus_and_labels(kube_cluster: KubeCluster, kube_client):
    nodes = {n.metadata.name: n for n in k8s.CoreV1Api(kube_client).list_node().items}
    assert len(kube_cluster.gpu_nodes) >= 2
    for fake in kube_cluster.nodes:
        node = nodes[fake.name]
        assert node.status.capacity["nvidia.com/gpu"] == "8"
        assert node.status.allocatable["nvidia.com/gpu"] == "8"
        assert node.metadata.labels["nvidia.com/gpu.product"] == fake.gpu_product
        assert node.metadata.labels["nvidia.com/gpu.memory"] == str(fake.gpu_memory_mib)
        assert node.metadata.labels["nvidia.com/gpu.count"] == "8"
        ready = [c for c in node.status.conditions if c.type == "Ready"]
        assert ready and ready[0].status == "True"
    h200 = [n for n in nodes.values() if n.metadata.labels.get("nvidia.com/gpu.product") == "NVIDIA-H200"]
    assert len(h200) >= 2
    assert all(n.metadata.labels["nvidia.com/gpu.memory"] == "143771" for n in h200)


def test_deployment_pods_are_scheduled_onto_gpu_nodes_and_run(kube_cluster: KubeCluster, kube_namespace: str):
    pod_template = _gpu_pod("engine", gpus=4, node_selector={"nvidia.com/gpu.product": "NVIDIA-H200"})
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "engine"},
        "spec": {
            "replicas": 2,
            "selector": {"matchLabels": {"app": "engine"}},
            "template": {"metadata": {"labels": {"app": "engine"}}, "spec": pod_template["spec"]},
        },
    }
    kube_cluster.apply(deployment, namespace=kube_namespace)

    pods = wait_for(
        lambda: (lambda ps: ps if len(ps) == 2 and all(_is_ready(p) for p in ps) else None)(
            _pods(kube_cluster, kube_namespace, "app=engine")
        ),
        timeout_s=60,
        what="2 engine pods Running and Ready",
    )
    h200_nodes = {n.name for n in kube_cluster.nodes if n.gpu_product == "NVIDIA-H200"}
    for pod in pods:
        assert pod["spec"]["nodeName"] in h200_nodes
    # The Deployment and ReplicaSet controllers (kube-controller-manager) saw the pods become available.
    wait_for(
        lambda: kube_cluster.kubectl_json("get", "deployment", "engine", "-n", kube_namespace)["status"].get(
            "availableReplicas"
        )
        == 2,
        timeout_s=30,
        what="deployment engine availableReplicas == 2",
    )


def test_kwok_leaves_nodes_without_its_annotation_alone(kube_cluster: KubeCluster, kube_namespace: str):
    """A node without kwok's annotation (the local kubelet's kind) is not kwok's: kwok neither
    takes its Lease nor plays its pods, even before anyone else holds that Lease. A pod bound to a
    fake node in the same run shows kwok was awake."""
    name = f"unmanaged-{uuid.uuid4().hex[:6]}"
    core = k8s.CoreV1Api(kube_cluster.api_client())
    core.create_node({"apiVersion": "v1", "kind": "Node", "metadata": {"name": name}, "spec": {}})
    try:
        fake_node = kube_cluster.nodes[0].name
        for pod_name, node in (("on-unmanaged", name), ("on-fake", fake_node)):
            pod = _gpu_pod(pod_name, gpus=0)
            pod["spec"]["nodeName"] = node
            kube_cluster.apply(pod, namespace=kube_namespace)
        wait_for(lambda: _is_ready(kube_cluster.kubectl_json("get", "pod", "on-fake", "-n", kube_namespace)),
                 timeout_s=30, what="the pod on the fake node Running")
        time.sleep(3)
        pod = kube_cluster.kubectl_json("get", "pod", "on-unmanaged", "-n", kube_namespace)
        assert not pod["status"].get("podIP") and pod["status"].get("phase") == "Pending", pod["status"]
        leases = k8s.CoordinationV1Api(kube_cluster.api_client()).list_namespaced_lease("kube-node-lease")
        assert name not in {lease.metadata.name for lease in leases.items}
    finally:
        core.delete_node(name)


def test_node_selector_on_gpu_product_picks_the_h100_node(kube_cluster: KubeCluster, kube_namespace: str):
    kube_cluster.apply(
        _gpu_pod("h100-job", gpus=8, node_selector={"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}),
        namespace=kube_namespace,
    )
    pod = wait_for(
        lambda: next((p for p in _pods(kube_cluster, kube_namespace, "app=h100-job") if _is_ready(p)), None),
        timeout_s=60,
        what="the H100 pod to run",
    )
    assert pod["spec"]["nodeName"] == "gpu-h100-0"


def test_pod_asking_for_more_gpus_than_any_node_stays_pending(kube_cluster: KubeCluster, kube_namespace: str):
    kube_cluster.apply(_gpu_pod("too-big", gpus=16), namespace=kube_namespace)

    def failed_scheduling():
        events = kube_cluster.kubectl_json(
            "get", "events", "-n", kube_namespace, "--field-selector", "involvedObject.name=too-big"
        )["items"]
        return [e for e in events if e["reason"] == "FailedScheduling"]

    events = wait_for(failed_scheduling, timeout_s=60, what="a FailedScheduling event for pod too-big")
    assert "Insufficient nvidia.com/gpu" in events[0]["message"], events[0]["message"]
    pod = kube_cluster.kubectl_json("get", "pod", "too-big", "-n", kube_namespace)
    assert pod["status"]["phase"] == "Pending"
    assert not pod["spec"].get("nodeName")
    conditions = {c["type"]: c for c in pod["status"].get("conditions", [])}
    assert conditions["PodScheduled"]["status"] == "False"
    assert conditions["PodScheduled"]["reason"] == "Unschedulable"


def _crd(plural: str, kind: str, schema: dict) -> dict:
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.{GROUP}"},
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {"plural": plural, "singular": plural[:-1], "kind": kind, "listKind": f"{kind}List"},
            "versions": [
                {
                    "name": "v1",
                    "served": True,
                    "storage": True,
                    "schema": {"openAPIV3Schema": schema},
                    "subresources": {"status": {}},
                }
            ],
        },
    }


def test_crd_with_non_structural_schema_is_rejected(kube_cluster: KubeCluster):
    plural = f"brokens{uuid.uuid4().hex[:6]}"
    schema = {
        "type": "object",
        # `spec` has properties but no `type`: not a structural schema, which apiextensions/v1 refuses.
        "properties": {"spec": {"properties": {"replicas": {"type": "integer"}}}},
    }
    with pytest.raises(KubectlError) as err:
        kube_cluster.apply(_crd(plural, "Broken", schema))
    message = str(err.value)
    assert "properties[spec].type" in message and "Required value" in message, message
    assert kube_cluster.kubectl("get", "crd", f"{plural}.{GROUP}", check=False).returncode != 0


def test_cel_validation_rule_on_a_crd_rejects_a_bad_object(kube_cluster: KubeCluster, kube_namespace: str):
    plural = f"widgets{uuid.uuid4().hex[:6]}"
    kind = "Widget" + plural[-6:].capitalize()
    schema = {
        "type": "object",
        "properties": {
            "spec": {
                "type": "object",
                "required": ["replicas", "maxReplicas"],
                "properties": {"replicas": {"type": "integer"}, "maxReplicas": {"type": "integer"}},
                "x-kubernetes-validations": [
                    {"rule": "self.replicas <= self.maxReplicas", "message": "replicas must not exceed maxReplicas"}
                ],
            }
        },
    }
    kube_cluster.apply(_crd(plural, kind, schema))
    try:
        kube_cluster.kubectl("wait", "--for=condition=Established", f"crd/{plural}.{GROUP}", "--timeout=30s")
        # Discovery may lag a moment behind Established.
        wait_for(
            lambda: kube_cluster.kubectl("get", f"{plural}.{GROUP}", "-n", kube_namespace, check=False).returncode == 0,
            timeout_s=30,
            what=f"{plural} to be served",
        )

        def widget(name: str, replicas: int, max_replicas: int) -> dict:
            return {
                "apiVersion": f"{GROUP}/v1",
                "kind": kind,
                "metadata": {"name": name},
                "spec": {"replicas": replicas, "maxReplicas": max_replicas},
            }

        kube_cluster.apply(widget("good", 2, 4), namespace=kube_namespace)
        with pytest.raises(KubectlError) as err:
            kube_cluster.apply(widget("bad", 5, 4), namespace=kube_namespace)
        assert "replicas must not exceed maxReplicas" in str(err.value)
        assert kube_cluster.kubectl("get", f"{plural}.{GROUP}", "bad", "-n", kube_namespace, check=False).returncode != 0
    finally:
        kube_cluster.kubectl("delete", "crd", f"{plural}.{GROUP}", "--ignore-not-found", "--wait=false")


def test_kubectl_logs_returns_the_pods_log(kube_cluster: KubeCluster, kube_namespace: str):
    kube_cluster.apply(_gpu_pod("logger", gpus=1), namespace=kube_namespace)
    wait_for(
        lambda: any(_is_ready(p) for p in _pods(kube_cluster, kube_namespace, "app=logger")),
        timeout_s=60,
        what="pod logger to run",
    )
    # Every pod has the cluster-wide default log ...
    default = kube_cluster.kubectl("logs", "logger", "-n", kube_namespace).stdout
    assert default.strip() == DEFAULT_LOG_LINE
    # ... until a test gives it its own.
    lines = ["loading target model", "EAGLE draft ready", "Uvicorn running on http://0.0.0.0:8000"]
    kube_cluster.set_pod_log(kube_namespace, "logger", lines)
    own = wait_for(
        lambda: (lambda out: out if "EAGLE draft ready" in out else None)(
            kube_cluster.kubectl("logs", "logger", "-n", kube_namespace, "-c", "engine").stdout
        ),
        timeout_s=30,
        what="the pod's own log",
    )
    assert own.splitlines() == lines


def test_garbage_collector_deletes_dependents_of_a_deleted_owner(kube_cluster: KubeCluster, kube_namespace: str):
    kube_cluster.apply({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "owner"}}, namespace=kube_namespace)
    owner_uid = kube_cluster.kubectl_json("get", "configmap", "owner", "-n", kube_namespace)["metadata"]["uid"]
    kube_cluster.apply(
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {
                "name": "dependent",
                "ownerReferences": [{"apiVersion": "v1", "kind": "ConfigMap", "name": "owner", "uid": owner_uid}],
            },
        },
        namespace=kube_namespace,
    )
    kube_cluster.kubectl("delete", "configmap", "owner", "-n", kube_namespace)
    wait_for(
        lambda: kube_cluster.kubectl("get", "configmap", "dependent", "-n", kube_namespace, check=False).returncode
        != 0,
        timeout_s=60,
        what="the garbage collector to delete configmap dependent",
    )


def test_rbac_is_enforced(kube_cluster: KubeCluster, kube_namespace: str):
    sa = f"system:serviceaccount:{kube_namespace}:reader"
    kube_cluster.kubectl("create", "serviceaccount", "reader", "-n", kube_namespace)
    denied = kube_cluster.kubectl("get", "pods", "-n", kube_namespace, "--as", sa, check=False)
    assert denied.returncode != 0 and "forbidden" in denied.stderr.lower(), denied.stderr
    kube_cluster.kubectl("create", "role", "pod-reader", "--verb=get,list", "--resource=pods", "-n", kube_namespace)
    kube_cluster.kubectl(
        "create", "rolebinding", "reader", "--role=pod-reader", f"--serviceaccount={kube_namespace}:reader", "-n", kube_namespace
    )
    wait_for(
        lambda: kube_cluster.kubectl("get", "pods", "-n", kube_namespace, "--as", sa, check=False).returncode == 0,
        timeout_s=30,
        what="the RoleBinding to take effect",
    )


def test_helm_binary_is_built_at_the_pinned_version(kube_cluster: KubeCluster):
    out = kube_cluster.helm("version", "--short").stdout
    assert out.startswith(kube_cluster.tools.versions["HELM_VERSION"]), out
    assert kube_cluster.helm("list", "-A").returncode == 0


def test_server_version_is_the_built_kubernetes(kube_cluster: KubeCluster, kube_client):
    info = k8s.VersionApi(kube_client).get_code()
    assert info.git_version == kube_cluster.tools.kube_version


def test_missing_binaries_fail_with_a_make_tools_hint(tmp_path):
    with pytest.raises(ToolsMissing) as err:
        Tools.find(tmp_path)
    assert "make tools" in str(err.value)
    assert str(tmp_path / "kubernetes-") in str(err.value)


def test_a_broken_binary_fails_the_start_clearly_and_leaves_nothing(kube_tools: Tools, tmp_path: Path):
    broken = dataclasses.replace(kube_tools, kube_apiserver=Path("/bin/false"))
    with pytest.raises(RuntimeError) as err:
        KubeCluster.start(broken, base_dir=tmp_path, timeout_s=20)
    assert "kwokctl create cluster" in str(err.value)
    assert "kube-apiserver" in str(err.value)
    assert list(tmp_path.glob("specdeploy-kube-*")) == []


def test_a_second_cluster_starts_fast_and_leaves_nothing_behind(kube_tools: Tools):
    t0 = time.monotonic()
    cluster = KubeCluster.start(kube_tools)
    try:
        elapsed = time.monotonic() - t0
        assert elapsed < 60, f"cluster start took {elapsed:.1f}s"
        assert cluster.processes(), "no control-plane processes found for the running cluster"
        assert cluster.bound_ports(), "no component port is listening"
        ports = list(cluster.ports)
        workdir = cluster.workdir
    finally:
        cluster.stop()
    assert cluster.processes() == []
    assert cluster.bound_ports() == [], f"ports still bound after stop: {cluster.bound_ports()} of {ports}"
    assert not workdir.exists()
