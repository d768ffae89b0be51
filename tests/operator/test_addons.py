"""A resource's addons on the real control plane: the apiserver accepts the PodDisruptionBudget,
NetworkPolicy, HorizontalPodAutoscaler and InferencePool the operator renders; kube-controller-
manager's HPA controller reads the resource's scale subresource; a missing InferencePool or KEDA
API is a condition that leaves everything as it was; what is no longer asked for goes; under
disaggregation a role's autoscaler owns its Deployment's replicas.

The test cluster has no CNI (NetworkPolicies are accepted, not enforced) and no custom metrics
API (the HPA finds the scale target and reports that it cannot read the metric yet)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from testcluster import KubectlError, wait_for

POOL_CRD = Path(__file__).parent / "data" / "inference.networking.k8s.io_inferencepools.yaml"
KEDA_CRD = Path(__file__).parent / "data" / "keda.sh_scaledobjects.yaml"
PEERS = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "apps"}}}]
EPP = {"name": "epp", "port": {"number": 9002}}


def crd_installer(kube_cluster, path: Path):
    """install() puts the CRD at `path` on the cluster; cleanup() removes what was installed."""
    installed = []

    def install() -> None:
        kube_cluster.kubectl("apply", "--server-side", "-f", str(path))
        name = next(d for d in yaml.safe_load_all(path.read_text()) if d)["metadata"]["name"]
        kube_cluster.kubectl("wait", "--for=condition=Established", f"crd/{name}", "--timeout=60s")
        installed.append(name)

    def cleanup() -> None:
        for name in installed:
            kube_cluster.kubectl("delete", "crd", name, "--ignore-not-found", "--wait=false", check=False)

    return install, cleanup


@pytest.fixture
def pool_crd(kube_cluster):
    install, cleanup = crd_installer(kube_cluster, POOL_CRD)
    yield install
    cleanup()


@pytest.fixture
def keda_crd(kube_cluster):
    install, cleanup = crd_installer(kube_cluster, KEDA_CRD)
    yield install
    cleanup()


def touch(kube_cluster, namespace: str, name: str, value: str) -> None:
    """A metadata change, which kopf hands to the update handler: a reconcile without a spec change."""
    kube_cluster.kubectl("annotate", "sdd", name, "-n", namespace, f"example.com/touch={value}", "--overwrite")


def condition(sdd, type_: str) -> dict:
    return sdd.condition(type_)


def test_addons_apply_report_and_go(kube_cluster, kube_namespace, operator, hub_secret, manifest, sdd_of, pool_crd):
    autoscale = {"metric": "Saturation", "minReplicas": 2, "maxReplicas": 4, "targetValue": "0.8"}
    kube_cluster.apply(manifest("scaled", replicas=2, autoscaling=autoscale, networkPolicy={"from": PEERS},
                                inferencePool={"endpointPickerRef": EPP}), namespace=kube_namespace)
    sdd = sdd_of("scaled")
    sdd.wait_ready(timeout_s=90)

    # No InferencePool API yet: a condition, and nothing else held back.
    missing = wait_for(lambda: condition(sdd, "InferencePool").get("reason") == "InferencePoolCRDMissing"
                       and condition(sdd, "InferencePool"), timeout_s=30, what="InferencePoolCRDMissing")
    assert missing["status"] == "False" and "inference.networking.k8s.io/v1" in missing["message"]
    scaling = condition(sdd, "Autoscaling")
    assert scaling["status"] == "True" and scaling["reason"] == "HorizontalPodAutoscaler"

    (budget,) = sdd.owned("poddisruptionbudgets")
    assert budget["spec"]["maxUnavailable"] == 1
    (netpol,) = sdd.owned("networkpolicies")
    assert netpol["spec"]["ingress"][0]["from"][0] == PEERS[0]
    (hpa,) = sdd.owned("horizontalpodautoscalers")
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "specdeploy.dev/v1alpha1", "kind": "SpecDecodeDeployment",
                                             "name": "scaled"}
    assert hpa["metadata"]["ownerReferences"][0]["name"] == "scaled"
    # The PDB controller counts the engine pods by its selector.
    wait_for(lambda: (kube_cluster.kubectl_json("get", "pdb", "scaled", "-n", kube_namespace).get("status") or {})
             .get("expectedPods") == 2, timeout_s=30, what="the budget counting 2 pods")

    # The HPA controller reads the resource's scale subresource (replicas and the pods' selector);
    # with no custom metrics API here it says it cannot get the metric.
    def hpa_conditions() -> dict:
        got = kube_cluster.kubectl_json("get", "hpa", "scaled", "-n", kube_namespace)
        return {c["type"]: c for c in (got.get("status") or {}).get("conditions") or []}

    conditions = wait_for(lambda: (c := hpa_conditions()).get("AbleToScale") and c.get("ScalingActive") and c,
                          timeout_s=60, what="the HPA controller's conditions")
    assert conditions["AbleToScale"]["status"] == "True", conditions
    assert conditions["ScalingActive"]["status"] == "False"
    assert "specdeploy_saturation" in conditions["ScalingActive"]["message"]
    status = kube_cluster.kubectl_json("get", "hpa", "scaled", "-n", kube_namespace)["status"]
    assert status["currentReplicas"] == 2

    # The extension's CRD installed: the next reconcile applies the pool, which the apiserver
    # validates against the extension's own schema.
    pool_crd()
    touch(kube_cluster, kube_namespace, "scaled", "1")
    applied = wait_for(lambda: condition(sdd, "InferencePool").get("status") == "True" and condition(sdd, "InferencePool"),
                       timeout_s=30, what="InferencePool applied")
    assert applied["reason"] == "InferencePoolApplied"
    pool = kube_cluster.kubectl_json("get", "inferencepools.inference.networking.k8s.io", "scaled", "-n", kube_namespace)
    assert pool["spec"]["selector"]["matchLabels"] == {"app.kubernetes.io/name": "specdeploy-engine",
                                                       "app.kubernetes.io/instance": "scaled"}
    assert pool["spec"]["targetPorts"] == [{"number": 8000}]
    # The extension's defaults, applied by its schema.
    assert pool["spec"]["endpointPickerRef"]["kind"] == "Service" and pool["spec"]["endpointPickerRef"]["failureMode"] == "FailClose"

    # KEDA asked for where there is none: a condition; the HPA stays as it was.
    keda = {**autoscale, "provider": "KEDA", "keda": {"serverAddress": "http://prometheus.monitoring:9090"}}
    kube_cluster.kubectl("patch", "sdd", "scaled", "-n", kube_namespace, "--type=merge", "-p",
                         json.dumps({"spec": {"autoscaling": keda}}))
    refused = wait_for(lambda: condition(sdd, "Autoscaling").get("reason") == "KEDANotInstalled" and condition(sdd, "Autoscaling"),
                       timeout_s=30, what="KEDANotInstalled")
    assert refused["status"] == "False"
    assert [h["metadata"]["uid"] for h in sdd.owned("horizontalpodautoscalers")] == [hpa["metadata"]["uid"]]

    # No longer asked for: the autoscaler, policy and pool go, with their conditions; the budget
    # of two replicas stays.
    kube_cluster.kubectl("patch", "sdd", "scaled", "-n", kube_namespace, "--type=json", "-p", json.dumps([
        {"op": "remove", "path": f"/spec/{f}"} for f in ("autoscaling", "networkPolicy", "inferencePool")]))
    wait_for(lambda: not sdd.owned("horizontalpodautoscalers") and not sdd.owned("networkpolicies")
             and not sdd.owned("inferencepools.inference.networking.k8s.io"), timeout_s=30, what="the addons removed")
    assert not condition(sdd, "Autoscaling") and not condition(sdd, "InferencePool")
    assert len(sdd.owned("poddisruptionbudgets")) == 1


def test_a_role_autoscaler_owns_its_deployments_replicas(kube_cluster, kube_namespace, operator, hub_secret, manifest, sdd_of):
    split = {"prefill": {"replicas": 1},
             "decode": {"replicas": 1, "autoscaling": {"metric": "QueuedRequests", "maxReplicas": 6}},
             "router": {"replicas": 1}}
    kube_cluster.apply(manifest("split", target={"model": "meta-llama/Llama-3.1-8B-Instruct"},
                                draft={"model": "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B"}, replicas=1,
                                disaggregation=split), namespace=kube_namespace)
    sdd = sdd_of("split")
    sdd.wait_ready(timeout_s=90)
    (hpa,) = sdd.items("horizontalpodautoscalers", "-l", "app.kubernetes.io/instance=split")
    assert hpa["metadata"]["name"] == "split-decode"
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "split-decode"}
    # The decode Deployment's replicas changed through its scale subresource, as the HPA does,
    # survive the operator's next apply; the prefill Deployment's are the operator's.
    kube_cluster.kubectl("scale", "deployment", "split-decode", "-n", kube_namespace, "--replicas=3")
    kube_cluster.kubectl("scale", "deployment", "split-prefill", "-n", kube_namespace, "--replicas=2")
    touch(kube_cluster, kube_namespace, "split", "1")
    wait_for(lambda: (sdd.status().get("disaggregation") or {}).get("decode", {}).get("readyReplicas") == 3
             and sdd.items("deployments", "--field-selector", "metadata.name=split-prefill")[0]["spec"]["replicas"] == 1,
             timeout_s=60, what="decode at 3 (its autoscaler's), prefill back at 1 (the spec's)")
    decode = sdd.items("deployments", "--field-selector", "metadata.name=split-decode")[0]
    assert decode["spec"]["replicas"] == 3
    assert {"split-decode"} <= {b["metadata"]["name"] for b in sdd.owned("poddisruptionbudgets")}


def test_keda_scaled_object_is_accepted_where_keda_is_installed(kube_cluster, kube_namespace, operator, hub_secret,
                                                                  manifest, sdd_of, keda_crd):
    keda_crd()
    autoscale = {"metric": "TTFTP90", "maxReplicas": 3, "provider": "KEDA",
                 "keda": {"serverAddress": "http://prometheus.monitoring:9090"}}
    kube_cluster.apply(manifest("keda", replicas=1, autoscaling=autoscale), namespace=kube_namespace)
    sdd = sdd_of("keda")
    applied = wait_for(lambda: condition(sdd, "Autoscaling").get("status") == "True" and condition(sdd, "Autoscaling"),
                       timeout_s=60, what="Autoscaling True")
    assert applied["reason"] == "ScaledObject" and "TTFTP90 2 per replica, 1..3 replicas" in applied["message"]
    (scaled,) = sdd.items("scaledobjects.keda.sh", "-l", "app.kubernetes.io/instance=keda")
    assert scaled["spec"]["scaleTargetRef"]["kind"] == "SpecDecodeDeployment"
    (trigger,) = scaled["spec"]["triggers"]
    assert trigger["metricType"] == "Value" and "histogram_quantile(0.9" in trigger["metadata"]["query"]
    assert not sdd.owned("horizontalpodautoscalers")  # KEDA makes its own from the ScaledObject


@pytest.mark.parametrize("autoscaling, message", [
    ({"metric": "QueuedRequests"}, "maxReplicas: Required value"),
    ({"metric": "Latency", "maxReplicas": 2}, "Unsupported value: \"Latency\""),
    ({"metric": "QueuedRequests", "minReplicas": 5, "maxReplicas": 2}, "minReplicas must not exceed maxReplicas"),
    ({"metric": "KVCacheUsage", "maxReplicas": 2, "targetValue": "1.5"}, "at most 1"),
    ({"metric": "QueuedRequests", "maxReplicas": 2, "targetValue": "lots"}, "targetValue must be a positive quantity"),
    ({"metric": "QueuedRequests", "maxReplicas": 2, "provider": "KEDA"}, "provider KEDA needs keda.serverAddress"),
    ({"metric": "QueuedRequests", "maxReplicas": 2, "keda": {"serverAddress": "http://p:9090"}}, "keda is for provider KEDA"),
])
def test_crd_refuses_bad_autoscaling(kube_cluster, kube_namespace, crd, manifest, autoscaling, message):
    with pytest.raises(KubectlError) as err:
        kube_cluster.apply(manifest("refused", autoscaling=autoscaling), namespace=kube_namespace)
    assert message in str(err.value)


@pytest.mark.parametrize("spec, message", [
    ({"autoscaling": {"metric": "QueuedRequests", "maxReplicas": 2},
      "disaggregation": {"decode": {"replicas": 1}}}, "under spec.disaggregation set spec.disaggregation.prefill/decode.autoscaling"),
    ({"podDisruptionBudget": {"maxUnavailable": 1, "minAvailable": 1}}, "at most one of minAvailable and maxUnavailable"),
    ({"inferencePool": {}}, "endpointPickerRef: Required value"),
    ({"inferencePool": {"endpointPickerRef": {"name": "epp"}}}, "port is required when kind is 'Service'"),
    ({"networkPolicy": {"from": [{"ipBlock": {}}]}}, "cidr: Required value"),
])
def test_crd_refuses_bad_addons(kube_cluster, kube_namespace, crd, manifest, spec, message):
    with pytest.raises(KubectlError) as err:
        kube_cluster.apply(manifest("refused", **spec), namespace=kube_namespace)
    assert message in str(err.value)
