"""spec.autoscaling -> an autoscaling/v2 HorizontalPodAutoscaler, or a KEDA ScaledObject (pure).

Nothing home-made: Kubernetes' HPA controller (or KEDA's operator) does the scaling; the operator
renders what it reads. The scale target is the resource's own scale subresource (.spec.replicas,
with .status.serving.selector for the pods), so the HPA changes spec.replicas and the operator
rolls nothing (replicas are not in the config hash). Under spec.disaggregation a CRD has only one
scale subresource, so each autoscaled role's HPA targets that role's Deployment, whose replicas
the operator then leaves to it (roles.py applies them without replicas).

Targets (averaged over the pods; the engine exports each, docs/engine.md):

    QueuedRequests   specdeploy_num_requests_waiting             requests queued per replica
    KVCacheUsage     specdeploy_kv_slot_usage_ratio              KV slots in use, 0..1
    TTFTP90          specdeploy_time_to_first_token_seconds_p90  seconds; a Prometheus recording of
                                                                 the histogram's p90 (the adapter rule
                                                                 in manifests/autoscaling/)
    Saturation       specdeploy_saturation                       load / the batch speculation serves
                                                                 well; 1.0 = the crossover

HPA: a Pods metric of that name (custom.metrics.k8s.io, e.g. prometheus-adapter with
manifests/autoscaling/prometheus-adapter-rules.yaml), target averageValue. KEDA: a prometheus
trigger querying spec.autoscaling.keda.serverAddress for the pods of the Deployment, AverageValue
(KEDA divides the sum by the replicas) except TTFTP90, whose query is already the p90 (Value).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from specdeploy.operator.api import API_VERSION, ENGINE_ROLES, KIND
from specdeploy.operator.desired.render import common_labels, deployment_name
from specdeploy.operator.desired.roles import is_disaggregated, role_deployment_name, role_labels, role_spec

HPA_API = ("autoscaling/v2", "HorizontalPodAutoscaler")
KEDA_API = ("keda.sh/v1alpha1", "ScaledObject")
DEFAULT_SCALE_DOWN_STABILIZATION_S = 300
TTFT_WINDOW = "2m"


@dataclass(frozen=True)
class Target:
    metric: str             # the engine's (or the recording's) metric name
    default_value: str      # averageValue when spec.autoscaling.targetValue is absent
    promql: str             # KEDA's query; {selector} is the pods' label matcher
    per_replica_sum: bool   # True: the query sums over pods (KEDA AverageValue); False: a Value
    exported: str = ""      # the name in the engine's /metrics it comes from (default: metric)

    def __post_init__(self) -> None:
        if not self.exported:
            object.__setattr__(self, "exported", self.metric)


TARGETS = {
    "QueuedRequests": Target("specdeploy_num_requests_waiting", "4",
                             "sum(specdeploy_num_requests_waiting{{{selector}}})", True),
    "KVCacheUsage": Target("specdeploy_kv_slot_usage_ratio", "0.8",
                           "sum(specdeploy_kv_slot_usage_ratio{{{selector}}})", True),
    "TTFTP90": Target("specdeploy_time_to_first_token_seconds_p90", "2",
                      "histogram_quantile(0.9, sum by (le) (rate(specdeploy_time_to_first_token_seconds_bucket"
                      "{{{selector}}}[" + TTFT_WINDOW + "])))", False,
                      exported="specdeploy_time_to_first_token_seconds_bucket"),
    "Saturation": Target("specdeploy_saturation", "0.8", "sum(specdeploy_saturation{{{selector}}})", True),
}


@dataclass(frozen=True)
class Scaler:
    """One autoscaled Deployment (or the resource): what renders its HPA or ScaledObject."""

    name: str                    # the HPA's / ScaledObject's name
    role: str | None             # None: the aggregated engine
    settings: dict[str, Any]     # spec.autoscaling (or the role's)
    target_ref: dict[str, str]   # scaleTargetRef
    deployment: str              # the Deployment whose pods it reads
    labels: dict[str, str]


def scalers(sdd: dict[str, Any]) -> list[Scaler]:
    spec, name = sdd["spec"], sdd["metadata"]["name"]
    if not is_disaggregated(spec):
        settings = spec.get("autoscaling")
        if not settings:
            return []
        ref = {"apiVersion": API_VERSION, "kind": KIND, "name": name}
        return [Scaler(name, None, settings, ref, deployment_name(name), common_labels(name))]
    found = []
    for role in ENGINE_ROLES:
        settings = role_spec(spec, role).get("autoscaling")
        if settings:
            deployment = role_deployment_name(name, role)
            ref = {"apiVersion": "apps/v1", "kind": "Deployment", "name": deployment}
            found.append(Scaler(deployment, role, settings, ref, deployment, role_labels(name, role)))
    return found


def provider(settings: dict[str, Any]) -> str:
    return settings.get("provider", "HPA")


def _behavior(settings: dict[str, Any]) -> dict[str, Any]:
    window = settings.get("scaleDownStabilizationSeconds", DEFAULT_SCALE_DOWN_STABILIZATION_S)
    return {"scaleDown": {"stabilizationWindowSeconds": window}}


def target_value(settings: dict[str, Any]) -> str:
    return str(settings.get("targetValue") or TARGETS[settings["metric"]].default_value)


def _scaler_object(api_kind: tuple[str, str], scaler: Scaler, replica_keys: tuple[str, str],
                   spec: dict[str, Any]) -> dict[str, Any]:
    """What both providers' objects hold: name, labels, the Deployment they scale and its replica
    bounds under the provider's `replica_keys` (min, max); `spec` is the provider's own."""
    settings = scaler.settings
    min_key, max_key = replica_keys
    return {
        "apiVersion": api_kind[0], "kind": api_kind[1],
        "metadata": {"name": scaler.name, "labels": dict(scaler.labels)},
        "spec": {
            "scaleTargetRef": dict(scaler.target_ref),
            min_key: settings.get("minReplicas", 1),
            max_key: settings["maxReplicas"],
            **spec,
        },
    }


def horizontal_pod_autoscaler(scaler: Scaler) -> dict[str, Any]:
    settings = scaler.settings
    target = TARGETS[settings["metric"]]
    return _scaler_object(HPA_API, scaler, ("minReplicas", "maxReplicas"), {
        "metrics": [{"type": "Pods", "pods": {
            "metric": {"name": target.metric},
            "target": {"type": "AverageValue", "averageValue": target_value(settings)},
        }}],
        "behavior": _behavior(settings),
    })


def pods_selector(namespace: str, deployment: str) -> str:
    """PromQL label matchers for a Deployment's pods as Prometheus' Kubernetes discovery labels
    them (namespace, pod: DEPLOYMENT-<replicaset hash>-<suffix>)."""
    return f'namespace="{namespace}",pod=~"{deployment}-[a-z0-9]+-[a-z0-9]+"'


def scaled_object(scaler: Scaler, namespace: str) -> dict[str, Any]:
    settings = scaler.settings
    target = TARGETS[settings["metric"]]
    keda = settings.get("keda") or {}
    return _scaler_object(KEDA_API, scaler, ("minReplicaCount", "maxReplicaCount"), {
        "advanced": {"horizontalPodAutoscalerConfig": {"behavior": _behavior(settings)}},
        "triggers": [{
            "type": "prometheus",
            "metricType": "AverageValue" if target.per_replica_sum else "Value",
            "metadata": {
                "serverAddress": keda["serverAddress"],
                "query": target.promql.format(selector=pods_selector(namespace, scaler.deployment)),
                "threshold": target_value(settings),
            },
        }],
    })


def render(sdd: dict[str, Any], scaler: Scaler) -> dict[str, Any]:
    if provider(scaler.settings) == "KEDA":
        return scaled_object(scaler, sdd["metadata"]["namespace"])
    return horizontal_pod_autoscaler(scaler)

