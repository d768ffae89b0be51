"""A resource's addons rendered (pure): disruption budgets, network policies, autoscalers (HPA and
KEDA, aggregated and per role), the InferencePool, and the conditions when an API is missing."""

from __future__ import annotations

from specdeploy.operator import api
from specdeploy.operator.desired import addons, autoscaling, policy


def sdd(**spec):
    base = {"target": {"model": "m"}, "speculative": {"algorithm": "NONE"}, "gpu": {"product": "h200"}, "replicas": 1}
    return {"apiVersion": "specdeploy.dev/v1alpha1", "kind": "SpecDecodeDeployment",
            "metadata": {"name": "llm", "namespace": "serving", "uid": "u-1", "generation": 3}, "spec": {**base, **spec}}


def split(**fields):
    """A disaggregated resource: role names in `fields` are role blocks, the rest spec fields."""
    roles = {r: fields.pop(r, {"replicas": 1}) for r in api.SPLIT_ROLES}
    return sdd(disaggregation=roles, **fields)


def everything(kind):
    return True


def nothing_optional(kind):
    return kind in addons.BUILT_IN


def by_kind(result):
    return {(o["kind"], o["metadata"]["name"]): o for o in result.objects}


ENGINE = {"app.kubernetes.io/name": "specdeploy-engine", "app.kubernetes.io/instance": "llm"}


def test_a_budget_only_where_more_than_one_replica_may_run():
    assert addons.desired_addons(sdd(), everything).objects == []
    (budget,) = addons.desired_addons(sdd(replicas=3), everything).objects
    assert budget["kind"] == "PodDisruptionBudget" and budget["metadata"]["name"] == "llm"
    assert budget["spec"] == {"selector": {"matchLabels": ENGINE}, "maxUnavailable": 1}
    assert budget["metadata"]["ownerReferences"][0]["uid"] == "u-1" and budget["metadata"]["namespace"] == "serving"
    (budget,) = addons.desired_addons(sdd(replicas=3, podDisruptionBudget={"minAvailable": "50%"}), everything).objects
    assert budget["spec"]["minAvailable"] == "50%" and "maxUnavailable" not in budget["spec"]
    assert addons.desired_addons(sdd(replicas=3, podDisruptionBudget={"enabled": False}), everything).objects == []
    # An autoscaler may give it more replicas: the budget is there from the start.
    found = by_kind(addons.desired_addons(sdd(autoscaling={"metric": "Saturation", "maxReplicas": 4}), everything))
    assert ("PodDisruptionBudget", "llm") in found
    # Split roles: per Deployment of several replicas (decode 3, router 2), none for prefill 1.
    names = {n for k, n in by_kind(addons.desired_addons(split(decode={"replicas": 3}, router={"replicas": 2}), everything))}
    assert names == {"llm-decode", "llm-router"}


def test_network_policy_aggregated_and_split():
    peers = [{"namespaceSelector": {"matchLabels": {"team": "apps"}}}]
    (netpol,) = addons.desired_addons(sdd(networkPolicy={"from": peers}), everything).objects
    assert netpol["spec"]["podSelector"] == {"matchLabels": ENGINE}
    assert netpol["spec"]["policyTypes"] == ["Ingress"]
    assert netpol["spec"]["ingress"] == [{"from": [*peers, policy.OPERATOR_PEER], "ports": [{"protocol": "TCP", "port": 8000}]}]
    # No `from`: this namespace's pods.
    (netpol,) = addons.desired_addons(sdd(networkPolicy={}), everything).objects
    assert netpol["spec"]["ingress"][0]["from"][0] == {"podSelector": {}}
    assert addons.desired_addons(sdd(networkPolicy={"enabled": False}), everything).objects == []

    found = by_kind(addons.desired_addons(split(networkPolicy={"from": peers}), everything))
    router, engines = found[("NetworkPolicy", "llm")], found[("NetworkPolicy", "llm-engines")]
    assert router["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/name"] == "specdeploy-router"
    assert router["spec"]["ingress"][0]["from"] == [*peers, policy.OPERATOR_PEER]
    assert engines["spec"]["podSelector"] == {"matchLabels": ENGINE}
    (from_router, between_engines) = engines["spec"]["ingress"]
    assert from_router["from"][0]["podSelector"]["matchLabels"]["app.kubernetes.io/name"] == "specdeploy-router"
    assert from_router["ports"] == [{"protocol": "TCP", "port": 8000}]
    # Prefill and decode reach each other on every port (the transfer engine's are chosen at run time).
    assert between_engines == {"from": [{"podSelector": {"matchLabels": ENGINE}}]}
    assert all(peers[0] not in rule["from"] for rule in engines["spec"]["ingress"])


def test_hpa_on_the_resources_scale_subresource():
    result = addons.desired_addons(sdd(autoscaling={"metric": "QueuedRequests", "minReplicas": 2, "maxReplicas": 8,
                                                    "scaleDownStabilizationSeconds": 60}), everything)
    hpa = by_kind(result)[("HorizontalPodAutoscaler", "llm")]
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "specdeploy.dev/v1alpha1", "kind": "SpecDecodeDeployment", "name": "llm"}
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 8)
    assert hpa["spec"]["metrics"] == [{"type": "Pods", "pods": {
        "metric": {"name": "specdeploy_num_requests_waiting"}, "target": {"type": "AverageValue", "averageValue": "4"}}}]
    assert hpa["spec"]["behavior"] == {"scaleDown": {"stabilizationWindowSeconds": 60}}
    condition = result.conditions[api.AUTOSCALING]
    assert condition.status and condition.reason == "HorizontalPodAutoscaler"
    assert "QueuedRequests 4 per replica, 2..8 replicas" in condition.message
    saturation = addons.desired_addons(sdd(autoscaling={"metric": "Saturation", "maxReplicas": 4, "targetValue": "0.7"}),
                                       everything)
    metric = by_kind(saturation)[("HorizontalPodAutoscaler", "llm")]["spec"]["metrics"][0]["pods"]
    assert metric == {"metric": {"name": "specdeploy_saturation"}, "target": {"type": "AverageValue", "averageValue": "0.7"}}


def test_keda_scaled_object_queries_the_pods_of_the_deployment():
    keda = {"metric": "TTFTP90", "maxReplicas": 5, "provider": "KEDA", "keda": {"serverAddress": "http://prom:9090"}}
    result = addons.desired_addons(split(decode={"replicas": 1, "autoscaling": keda}), everything)
    scaled = by_kind(result)[("ScaledObject", "llm-decode")]
    assert scaled["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "llm-decode"}
    (trigger,) = scaled["spec"]["triggers"]
    assert trigger["type"] == "prometheus" and trigger["metricType"] == "Value"
    assert trigger["metadata"]["serverAddress"] == "http://prom:9090" and trigger["metadata"]["threshold"] == "2"
    assert trigger["metadata"]["query"] == (
        'histogram_quantile(0.9, sum by (le) (rate(specdeploy_time_to_first_token_seconds_bucket'
        '{namespace="serving",pod=~"llm-decode-[a-z0-9]+-[a-z0-9]+"}[2m])))')
    queued = autoscaling.scaled_object(autoscaling.scalers(sdd(autoscaling={**keda, "metric": "QueuedRequests"}))[0], "ns")
    assert queued["spec"]["triggers"][0]["metricType"] == "AverageValue"
    assert queued["spec"]["triggers"][0]["metadata"]["query"] == \
        'sum(specdeploy_num_requests_waiting{namespace="ns",pod=~"llm-[a-z0-9]+-[a-z0-9]+"})'


def test_missing_keda_or_inference_pool_api_is_a_condition_and_touches_nothing():
    keda = {"metric": "QueuedRequests", "maxReplicas": 5, "provider": "KEDA", "keda": {"serverAddress": "http://p:9090"}}
    pool = {"endpointPickerRef": {"name": "epp", "port": {"number": 9002}}}
    result = addons.desired_addons(sdd(autoscaling=keda, inferencePool=pool), nothing_optional)
    assert {o["kind"] for o in result.objects} == {"PodDisruptionBudget"}
    assert result.conditions[api.AUTOSCALING].reason == api.REASON_KEDA_NOT_INSTALLED
    assert result.conditions[api.INFERENCE_POOL].reason == api.REASON_INFERENCE_POOL_CRD_MISSING
    assert not result.conditions[api.AUTOSCALING].status and not result.conditions[api.INFERENCE_POOL].status
    # What exists of those kinds stays as it is (not deleted for want of a CRD).
    assert result.untouched == {autoscaling.KEDA_API, autoscaling.HPA_API, ("inference.networking.k8s.io/v1", "InferencePool")}


def test_inference_pool_selects_the_serving_engines():
    pool = {"endpointPickerRef": {"name": "epp", "port": {"number": 9002}, "failureMode": "FailOpen"}}
    (obj,) = [o for o in addons.desired_addons(sdd(inferencePool=pool), everything).objects if o["kind"] == "InferencePool"]
    assert obj["apiVersion"] == "inference.networking.k8s.io/v1" and obj["metadata"]["name"] == "llm"
    assert obj["spec"] == {"selector": {"matchLabels": ENGINE}, "targetPorts": [{"number": 8000}],
                           "endpointPickerRef": pool["endpointPickerRef"]}
    (obj,) = [o for o in addons.desired_addons(split(inferencePool={**pool, "name": "pool"}), everything).objects
              if o["kind"] == "InferencePool"]
    assert obj["metadata"]["name"] == "pool"
    assert obj["spec"]["selector"]["matchLabels"]["specdeploy.dev/role"] == "decode"


def test_conditions_in_status_and_the_metric_check():
    resource = sdd(autoscaling={"metric": "Saturation", "maxReplicas": 4})
    verdict = addons.desired_addons(resource, everything).conditions
    current = {"conditions": [{"type": "Ready", "status": "True"}, {"type": api.INFERENCE_POOL, "status": "True"}]}
    new = addons.status_conditions(current, verdict, generation=3, now="t1")
    assert [c["type"] for c in new["conditions"]] == ["Ready", api.AUTOSCALING]  # the pool is no longer asked for
    # Pods of an older engine that does not export saturation: said; then seen again: cleared.
    check = addons.exported_metric_check({**resource, "status": new}, [{"specdeploy_num_requests_waiting"}])
    assert check.reason == api.REASON_METRIC_NOT_EXPORTED and "specdeploy_saturation" in check.message
    stale = addons.set_addon_condition(new, check, generation=3, now="t2")
    # A reconcile meanwhile keeps the verdict of the pods.
    assert addons.status_conditions(stale, verdict, generation=3, now="t3")["conditions"][1]["reason"] == \
        api.REASON_METRIC_NOT_EXPORTED
    assert addons.exported_metric_check({**resource, "status": stale}, [{"specdeploy_num_requests_waiting"}]) is None
    fixed = addons.exported_metric_check({**resource, "status": stale}, [{"specdeploy_saturation"}])
    assert fixed.status and fixed.reason == api.REASON_METRIC_EXPORTED
    assert addons.exported_metric_check({**resource, "status": new}, []) is None  # no pod answered: no verdict
