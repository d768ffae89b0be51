"""What a resource gets beyond its engine: disruption budgets, network policies, autoscalers and
an InferencePool (pure). `desired_addons` renders them and says, per feature, what the status
conditions report; operator/cluster/addons.py applies the objects and deletes the ones of this
resource that are no longer wanted.

A feature whose API the cluster lacks (KEDA's ScaledObject, the inference extension's
InferencePool) is not applied: its condition is False with the reason, and its objects of this
resource are left exactly as they are (`untouched`), never deleted for want of a CRD.

Conditions (type, reason):
  Autoscaling    HorizontalPodAutoscaler | ScaledObject (True); KEDANotInstalled, MetricNotExported,
                 ChildConflict (False). Absent without spec.autoscaling.
  InferencePool  InferencePoolApplied (True); InferencePoolCRDMissing, ChildConflict (False).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from specdeploy.operator import api
from specdeploy.operator.desired import autoscaling, gateway, policy
from specdeploy.operator.desired.render import finish_children
from specdeploy.operator.desired.status import get_condition, set_condition

# Every kind an addon may be, with its plural (for listing what this resource owns).
MANAGED = {
    policy.PDB_API: "poddisruptionbudgets",
    policy.NETWORK_POLICY_API: "networkpolicies",
    autoscaling.HPA_API: "horizontalpodautoscalers",
    autoscaling.KEDA_API: "scaledobjects",
    gateway.INFERENCE_POOL_API: "inferencepools",
}
# The kinds the built-in APIs serve on every cluster this operator supports.
BUILT_IN = (policy.PDB_API, policy.NETWORK_POLICY_API, autoscaling.HPA_API)


@dataclass(frozen=True)
class Condition:
    type: str
    status: bool
    reason: str
    message: str


@dataclass
class Addons:
    objects: list[dict[str, Any]] = field(default_factory=list)         # to apply, in order
    features: dict[tuple[str, str], str] = field(default_factory=dict)  # (apiVersion, kind) -> condition type
    untouched: set[tuple[str, str]] = field(default_factory=set)        # kinds left as they are
    conditions: dict[str, Condition] = field(default_factory=dict)      # condition type -> verdict

    def add(self, sdd: dict[str, Any], obj: dict[str, Any], condition_type: str | None = None) -> None:
        finish_children(sdd, [obj], obj["metadata"]["labels"])
        self.objects.append(obj)
        if condition_type:
            self.features[(obj["apiVersion"], obj["kind"])] = condition_type


def desired_addons(sdd: dict[str, Any], available: Callable[[tuple[str, str]], bool]) -> Addons:
    """`available((apiVersion, kind))`: whether the cluster serves that kind."""
    addons = Addons()
    for obj in policy.disruption_budgets(sdd) + policy.network_policies(sdd):
        addons.add(sdd, obj)

    found = autoscaling.scalers(sdd)
    if found:
        providers = {autoscaling.provider(s.settings) for s in found}
        if "KEDA" in providers and not available(autoscaling.KEDA_API):
            addons.untouched |= {autoscaling.KEDA_API, autoscaling.HPA_API}
            addons.conditions[api.AUTOSCALING] = Condition(
                api.AUTOSCALING, False, api.REASON_KEDA_NOT_INSTALLED,
                "spec.autoscaling asks for KEDA, but the cluster has no ScaledObject API (keda.sh/v1alpha1);"
                " install KEDA or use provider HPA; autoscalers left as they were")
        else:
            for scaler in found:
                addons.add(sdd, autoscaling.render(sdd, scaler), api.AUTOSCALING)
            kinds = sorted({o["kind"] for o in addons.objects if o["kind"] in ("HorizontalPodAutoscaler", "ScaledObject")})
            described = ", ".join(
                f"{s.name}: {s.settings['metric']} {autoscaling.target_value(s.settings)} per replica,"
                f" {s.settings.get('minReplicas', 1)}..{s.settings['maxReplicas']} replicas" for s in found)
            addons.conditions[api.AUTOSCALING] = Condition(api.AUTOSCALING, True, "/".join(kinds), described)

    pool = gateway.inference_pool(sdd)
    if pool is not None:
        if not available(gateway.INFERENCE_POOL_API):
            addons.untouched.add(gateway.INFERENCE_POOL_API)
            addons.conditions[api.INFERENCE_POOL] = Condition(
                api.INFERENCE_POOL, False, api.REASON_INFERENCE_POOL_CRD_MISSING,
                "spec.inferencePool: the cluster has no InferencePool API (inference.networking.k8s.io/v1);"
                " install the Gateway API Inference Extension's CRDs")
        else:
            addons.add(sdd, pool, api.INFERENCE_POOL)
            addons.conditions[api.INFERENCE_POOL] = Condition(
                api.INFERENCE_POOL, True, api.REASON_INFERENCE_POOL_APPLIED,
                f"InferencePool {pool['metadata']['name']} selects the serving pods on port"
                f" {pool['spec']['targetPorts'][0]['number']}")
    return addons


def status_conditions(current: dict[str, Any], conditions: dict[str, Condition], *, generation: int,
                      now: str) -> dict[str, Any]:
    """The status with the addons' conditions set and those of features no longer asked for gone.
    A MetricNotExported verdict of the metrics loop stands until the loop sees the metric."""
    new = dict(current)
    new["conditions"] = [c for c in current.get("conditions") or []
                         if c.get("type") not in (api.AUTOSCALING, api.INFERENCE_POOL) or c["type"] in conditions]
    for condition in conditions.values():
        old = get_condition(new, condition.type) or {}
        if condition.status and old.get("reason") == api.REASON_METRIC_NOT_EXPORTED:
            continue
        set_condition(new, condition.type, condition.status, condition.reason, condition.message,
                      generation=generation, now=now)
    return new


def set_addon_condition(current: dict[str, Any], condition: Condition, *, generation: int, now: str) -> dict[str, Any]:
    new = {**current, "conditions": list(current.get("conditions") or [])}
    set_condition(new, condition.type, condition.status, condition.reason, condition.message,
                  generation=generation, now=now)
    return new


def exported_metric_check(sdd: dict[str, Any], names_per_pod: list[set[str]]) -> Condition | None:
    """After a scrape of the resource's ready engine pods (the metric names each serves): an
    Autoscaling condition if the verdict changes, else None. An engine image that predates a
    target's metric makes the autoscaler read nothing; that is said, and nothing is changed."""
    found = autoscaling.scalers(sdd)
    if not found or not names_per_pod:
        return None
    current = {c.get("type"): c for c in (sdd.get("status") or {}).get("conditions") or []}.get(api.AUTOSCALING) or {}
    missing = []
    for scaler in found:
        wanted = autoscaling.TARGETS[scaler.settings["metric"]].exported
        if not any(wanted in names for names in names_per_pod):
            missing.append(f"{scaler.name}: {scaler.settings['metric']} reads {wanted}")
    if missing:
        message = ("the engine pods do not export what the autoscaler reads (" + "; ".join(missing)
                   + "); the autoscaler is left as it is: use an engine image that exports it, or another metric")
        if current.get("reason") == api.REASON_METRIC_NOT_EXPORTED and current.get("message") == message:
            return None
        return Condition(api.AUTOSCALING, False, api.REASON_METRIC_NOT_EXPORTED, message)
    if current.get("reason") == api.REASON_METRIC_NOT_EXPORTED:
        return Condition(api.AUTOSCALING, True, api.REASON_METRIC_EXPORTED,
                         "the engine pods export every metric the autoscalers read")
    return None
