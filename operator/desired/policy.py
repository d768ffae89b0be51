"""Kubernetes' own policies for a resource's pods: a NetworkPolicy when spec.networkPolicy asks
for one, and a PodDisruptionBudget for every Deployment that runs more than one replica (pure).

NetworkPolicy (networking.k8s.io/v1, ingress only; egress stays open: the engine reads the hub):
- aggregated: `<name>` selects the engine pods; port 8000 is open to the peers spec.networkPolicy
  names in `from` (absent: the pods of the resource's own namespace) and to the operator's pods
  (any namespace: it reads the engines' /metrics into status).
- spec.disaggregation: `<name>` selects the router pods, open as above on port 8000; and
  `<name>-engines` selects the prefill and decode pods, open to the router on 8000, to each other
  on every port (the transfer engine's ports are chosen at run time), and to the operator on 8000.

PodDisruptionBudget (policy/v1), `<deployment name>`: maxUnavailable 1 (or what
spec.podDisruptionBudget says) over the Deployment's pods, when it runs more than one replica or an
autoscaler may give it more; a drain then takes one engine at a time, each finishing its requests
(the engine's SIGTERM drain) while the others serve. `enabled: false` renders none.
"""

from __future__ import annotations

import copy
from typing import Any

from specdeploy.operator.api import LABEL_COMPONENT, LABEL_PART_OF, SPLIT_ROLES
from specdeploy.operator.desired.render import ENGINE_PORT, common_labels, deployment_name, selector_labels
from specdeploy.operator.desired.roles import is_disaggregated, role_deployment_name, role_labels, role_selector, role_spec

NETWORK_POLICY_API = ("networking.k8s.io/v1", "NetworkPolicy")
PDB_API = ("policy/v1", "PodDisruptionBudget")
# The operator's pods, as the chart labels them (charts/specdeploy/templates/_helpers.tpl).
OPERATOR_PEER = {"namespaceSelector": {},
                 "podSelector": {"matchLabels": {LABEL_COMPONENT: "operator", LABEL_PART_OF: "specdeploy"}}}
DEFAULT_MAX_UNAVAILABLE = 1


def _policy(name: str, labels: dict[str, str], selector: dict[str, str], ingress: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "apiVersion": NETWORK_POLICY_API[0], "kind": NETWORK_POLICY_API[1],
        "metadata": {"name": name, "labels": dict(labels)},
        "spec": {"podSelector": {"matchLabels": dict(selector)}, "policyTypes": ["Ingress"], "ingress": ingress},
    }


def _port(port: int = ENGINE_PORT) -> list[dict[str, Any]]:
    return [{"protocol": "TCP", "port": port}]


def network_policies(sdd: dict[str, Any]) -> list[dict[str, Any]]:
    """The NetworkPolicies spec.networkPolicy asks for (none without it)."""
    spec, name = sdd["spec"], sdd["metadata"]["name"]
    wanted = spec.get("networkPolicy")
    if wanted is None or wanted.get("enabled") is False:
        return []
    peers = copy.deepcopy(wanted["from"]) if "from" in wanted else [{"podSelector": {}}]
    clients = {"from": [*peers, OPERATOR_PEER], "ports": _port()}
    if not is_disaggregated(spec):
        return [_policy(name, common_labels(name), selector_labels(name), [clients])]
    router = {"podSelector": {"matchLabels": role_selector(name, "router")}}
    engines = {"podSelector": {"matchLabels": selector_labels(name)}}
    return [
        _policy(name, role_labels(name, "router"), role_selector(name, "router"), [clients]),
        _policy(f"{name}-engines", common_labels(name), selector_labels(name), [
            {"from": [router, OPERATOR_PEER], "ports": _port()},
            {"from": [engines]},
        ]),
    ]


def _budget(name: str, labels: dict[str, str], selector: dict[str, str], settings: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = {"selector": {"matchLabels": dict(selector)}}
    if "minAvailable" in settings:
        spec["minAvailable"] = settings["minAvailable"]
    else:
        spec["maxUnavailable"] = settings.get("maxUnavailable", DEFAULT_MAX_UNAVAILABLE)
    return {"apiVersion": PDB_API[0], "kind": PDB_API[1], "metadata": {"name": name, "labels": dict(labels)}, "spec": spec}


def _may_run_several(replicas: int, autoscaling: dict[str, Any] | None) -> bool:
    return replicas > 1 or bool(autoscaling and autoscaling.get("maxReplicas", 1) > 1)


def disruption_budgets(sdd: dict[str, Any]) -> list[dict[str, Any]]:
    """A PodDisruptionBudget per Deployment of more than one replica (module docstring)."""
    spec, name = sdd["spec"], sdd["metadata"]["name"]
    settings = spec.get("podDisruptionBudget") or {}
    if settings.get("enabled") is False:
        return []
    if not is_disaggregated(spec):
        if not _may_run_several(spec.get("replicas", 1), spec.get("autoscaling")):
            return []
        return [_budget(deployment_name(name), common_labels(name), selector_labels(name), settings)]
    budgets = []
    for role in SPLIT_ROLES:
        own = role_spec(spec, role)
        if _may_run_several(own.get("replicas", 1), own.get("autoscaling")):
            budgets.append(_budget(role_deployment_name(name, role), role_labels(name, role),
                                   role_selector(name, role), settings))
    return budgets
