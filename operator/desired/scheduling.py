"""spec.pod -> where and how the engine pods run: node selection, tolerations, affinity, spread,
priority, runtime class, service account, pull secrets, extra pod labels and annotations (pure).

Typed fields, as KServe's predictor spec embeds them (its ComponentExtensionSpec + PodSpec),
rather than an arbitrary pod-template overlay as LeaderWorkerSet's templates are: the operator
owns the pod spec (GPU count, probes, volumes, securityContext), and a typed field can be
validated by the CRD and merged with what the operator adds, where an overlay could only replace
it. The merges:

- tolerations: the user's, after the GPU toleration the operator adds (an identical one once);
- affinity: every required node-selector term of the user's gets the GPU product expression
  ANDed in (terms are ORed, a term's expressions ANDed), so no term can escape the planned GPU;
  none given: the GPU term alone; preferred terms, pod (anti-)affinity are the user's as given;
- topologySpreadConstraints without a labelSelector count this resource's own pods (of the role);
- labels and annotations: the user's, ours winning (the CRD refuses the keys ours use).

Under spec.disaggregation each role may carry its own `pod` block: its maps (labels,
annotations, nodeSelector) are merged over spec.pod's key by key, its other fields replace
spec.pod's. The router holds no GPU: it takes from spec.pod only what does not place pods on
nodes (labels, annotations, priorityClassName, serviceAccountName, imagePullSecrets and the
security contexts); disaggregation.router.pod places it.
"""

from __future__ import annotations

import copy
from typing import Any

from specdeploy.operator.desired import security

MERGED_MAPS = ("labels", "annotations", "nodeSelector")
# spec.pod fields that place pods on nodes: the router does not inherit them.
PLACEMENT_FIELDS = ("nodeSelector", "tolerations", "affinity", "topologySpreadConstraints", "runtimeClassName")
# Pod-spec fields copied as the user gives them.
PASSED_FIELDS = ("nodeSelector", "priorityClassName", "runtimeClassName", "serviceAccountName", "imagePullSecrets")


def pod_settings(spec: dict[str, Any], role: str | None = None) -> dict[str, Any]:
    """spec.pod, with the role's own pod block (spec.disaggregation.ROLE.pod) over it."""
    base = copy.deepcopy(spec.get("pod") or {})
    if role is None:
        return base
    if role == "router":
        base = {k: v for k, v in base.items() if k not in PLACEMENT_FIELDS}
    own = copy.deepcopy(((spec.get("disaggregation") or {}).get(role) or {}).get("pod") or {})
    for key, value in own.items():
        base[key] = {**(base.get(key) or {}), **value} if key in MERGED_MAPS else value
    return base


def merge_tolerations(ours: list[dict[str, Any]], theirs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    merged = [copy.deepcopy(t) for t in ours]
    for toleration in theirs:
        if toleration not in merged:
            merged.append(copy.deepcopy(toleration))
    return merged


def merge_affinity(required_expression: dict[str, Any] | None, user: dict[str, Any] | None) -> dict[str, Any]:
    """The user's affinity with `required_expression` (the GPU product's) ANDed into every required
    node-selector term; None: the user's as given."""
    affinity = copy.deepcopy(user or {})
    if required_expression is None:
        return affinity
    node = affinity.setdefault("nodeAffinity", {})
    required = node.setdefault("requiredDuringSchedulingIgnoredDuringExecution", {})
    terms = required.get("nodeSelectorTerms") or [{}]
    for term in terms:
        expressions = term.setdefault("matchExpressions", [])
        if required_expression not in expressions:
            expressions.append(copy.deepcopy(required_expression))
    required["nodeSelectorTerms"] = terms
    return affinity


def apply_pod_settings(template: dict[str, Any], settings: dict[str, Any], selector: dict[str, str]) -> None:
    """Merge `settings` (pod_settings()) into a Deployment's pod template, in place. The template
    carries the operator's GPU affinity and toleration already (or none: CPU mode, the router)."""
    meta, pod = template.setdefault("metadata", {}), template["spec"]
    meta["labels"] = {**(settings.get("labels") or {}), **(meta.get("labels") or {})}
    annotations = {**(settings.get("annotations") or {}), **(meta.get("annotations") or {})}
    if annotations:
        meta["annotations"] = annotations
    for key in PASSED_FIELDS:
        if settings.get(key):
            pod[key] = copy.deepcopy(settings[key])
    if settings.get("tolerations") or pod.get("tolerations"):
        pod["tolerations"] = merge_tolerations(pod.get("tolerations") or [], settings.get("tolerations") or [])
    gpu_terms = (((pod.get("affinity") or {}).get("nodeAffinity") or {})
                 .get("requiredDuringSchedulingIgnoredDuringExecution") or {}).get("nodeSelectorTerms") or []
    gpu_expression = gpu_terms[0]["matchExpressions"][0] if gpu_terms else None
    if settings.get("affinity") or gpu_expression:
        pod["affinity"] = merge_affinity(gpu_expression, settings.get("affinity"))
    spread = []
    for constraint in settings.get("topologySpreadConstraints") or []:
        constraint = copy.deepcopy(constraint)
        constraint.setdefault("labelSelector", {"matchLabels": dict(selector)})
        spread.append(constraint)
    if spread:
        pod["topologySpreadConstraints"] = spread


def customize_deployment(deployment: dict[str, Any], spec: dict[str, Any], role: str | None = None) -> None:
    """spec.pod (and the role's) and the security contexts applied to a rendered Deployment's pod
    template, in place."""
    settings = pod_settings(spec, role)
    template = deployment["spec"]["template"]
    apply_pod_settings(template, settings, deployment["spec"]["selector"]["matchLabels"])
    rdma = role in ("prefill", "decode") and (spec.get("disaggregation") or {}).get("transferProtocol") == "rdma"
    security.harden(template["spec"], settings, security.RDMA_CAPABILITIES if rdma else ())
