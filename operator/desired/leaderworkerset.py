"""A plan of more than one node -> one LeaderWorkerSet instead of the engine Deployment (pure).

Each replica is one LWS group of `nodes` pods (leaderworkerset.x-k8s.io/v1, sigs.k8s.io/lws
v0.9.0): the leader runs ranks 0..R-1 of the tensor-parallel group and the HTTP server, worker
i runs ranks i*R..(i+1)*R-1 (R = tensor_parallel_size / nodes GPUs per pod). Both run the same
`specdeploy engine serve` command with the same arguments; the engine reads its place in the
group from the variables LWS sets in every container (LWS_LEADER_ADDRESS, LWS_GROUP_SIZE,
LWS_WORKER_INDEX; engine/serving/group.py).

What stays as a single-node pod has it (render.render_children renders the pod, this module
reshapes it): the ConfigMap with plan.json, the image, arguments, environment, GPU affinity and
tolerations, the model cache, and on the leader the startup / liveness / readiness probes. What
changes:
- GPUs and /dev/shm per pod are one node's share (R), not the whole group's.
- Workers serve no HTTP, so they carry no probes: the leader watches every worker's connection
  and exits when one is lost, and the group is recreated (restartPolicy
  RecreateGroupOnPodRestart: any pod that restarts takes the whole group down and up again, as
  a tensor-parallel group cannot lose a rank and go on).
- startupPolicy LeaderCreated: the workers start with the leader, which only turns ready once
  every rank has joined (LeaderReady would wait forever for a leader waiting for its workers).
- The Service selects leaders only (worker-index 0).
- A model cache the operator creates is a volume claim template: every pod of every group gets
  its own claim (model-cache-<pod>), kept while the resource lives, so a recreated group finds its
  weights downloaded; a claimName given is mounted by all pods as it is (it must allow that:
  ReadWriteMany or ReadOnlyMany).
- spec.replicas counts groups; the scale subresource's selector is the leaders'.
"""

from __future__ import annotations

import copy
from typing import Any

from specdeploy.operator.api import (
    CONFIG_HASH_ANNOTATION,
    LWS_API_VERSION,
    LWS_KIND,
    LWS_WORKER_INDEX_LABEL,
)
from specdeploy.operator.desired.render import (
    ENGINE_CONTAINER,
    GPU_RESOURCE,
    SHM_GIB_PER_GPU,
    Children,
    EngineDefaults,
    PlannedEngine,
    render_children,
    selector_labels,
)

LEADER_INDEX = "0"
# The pod's node name in every engine container, so that each rank's log lines say where it runs.
NODE_NAME_ENV = {"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}
PROBES = ("startupProbe", "livenessProbe", "readinessProbe")


def leader_selector(name: str) -> dict[str, str]:
    """The leader pods of one resource's groups: what the Service and the scale selector match."""
    return {**selector_labels(name), LWS_WORKER_INDEX_LABEL: LEADER_INDEX}


def leaderworkerset_name(name: str) -> str:
    return name


def render_group(sdd: dict[str, Any], planned: PlannedEngine, defaults: EngineDefaults) -> Children:
    """The ConfigMap, LeaderWorkerSet (in Children.deployment's place) and Service of a resource
    whose plan spans planned.nodes > 1 nodes."""
    if planned.nodes < 2:
        raise ValueError(f"render_group is for plans of more than one node, got {planned.nodes}")
    name = sdd["metadata"]["name"]
    single = render_children(sdd, planned, defaults)
    deployment = single.deployment
    per_pod = planned.tensor_parallel_size // planned.nodes
    leader = _pod_template(deployment["spec"]["template"], sdd["spec"], planned, per_pod)
    worker = copy.deepcopy(leader)
    for key in PROBES:
        worker["spec"]["containers"][0].pop(key, None)

    claim_templates = []
    cache_status = dict(single.model_cache or {})
    if single.model_cache_claim is not None:
        # One claim per pod instead of one claim for all: the claim template takes the volume's name.
        claim = single.model_cache_claim
        claim_templates.append({"metadata": {"name": "model-cache"}, "spec": copy.deepcopy(claim["spec"])})
        for pod_template in (leader, worker):
            pod_template["spec"]["volumes"] = [v for v in pod_template["spec"]["volumes"] if v["name"] != "model-cache"]
        cache_status["claimName"] = "model-cache"  # model-cache-<pod name>, one per pod
        cache_status["perPod"] = True

    template: dict[str, Any] = {
        "size": planned.nodes,
        "restartPolicy": "RecreateGroupOnPodRestart",
        "leaderTemplate": leader,
        "workerTemplate": worker,
    }
    if claim_templates:
        template["volumeClaimTemplates"] = claim_templates
        template["persistentVolumeClaimRetentionPolicy"] = {"whenDeleted": "Delete", "whenScaled": "Retain"}
    group = {
        "apiVersion": LWS_API_VERSION,
        "kind": LWS_KIND,
        "metadata": {
            "name": leaderworkerset_name(name),
            "namespace": deployment["metadata"]["namespace"],
            "labels": dict(deployment["metadata"]["labels"]),
            "annotations": {CONFIG_HASH_ANNOTATION: single.config_hash},
            "ownerReferences": copy.deepcopy(deployment["metadata"]["ownerReferences"]),
        },
        "spec": {
            "replicas": sdd["spec"].get("replicas", 1),
            "startupPolicy": "LeaderCreated",
            # A group holds whole nodes' GPUs; surge would need a spare set of nodes.
            "rolloutStrategy": {"type": "RollingUpdate",
                                "rollingUpdateConfiguration": {"maxUnavailable": 1, "maxSurge": 0}},
            "leaderWorkerTemplate": template,
        },
    }
    service = copy.deepcopy(single.service)
    service["spec"]["selector"] = leader_selector(name)
    return Children(single.config_map, group, service, single.config_hash, None, cache_status)


def _pod_template(template: dict[str, Any], spec: dict[str, Any], planned: PlannedEngine,
                  per_pod: int) -> dict[str, Any]:
    """The single-node pod template with one node's GPUs and /dev/shm, and NODE_NAME."""
    template = copy.deepcopy(template)
    pod = template["spec"]
    container = next(c for c in pod["containers"] if c["name"] == ENGINE_CONTAINER)
    if not planned.cpu:
        for part in ("requests", "limits"):
            container["resources"][part][GPU_RESOURCE] = per_pod
    names = {var["name"] for var in container["env"]}
    if NODE_NAME_ENV["name"] not in names:  # the user's NODE_NAME wins
        container["env"].append(copy.deepcopy(NODE_NAME_ENV))
    for volume in pod["volumes"]:
        if volume["name"] == "dshm":
            volume["emptyDir"]["sizeLimit"] = f"{SHM_GIB_PER_GPU * (1 if planned.cpu else per_pod)}Gi"
    return template


def deployment_view(group: dict[str, Any] | None) -> dict[str, Any] | None:
    """A LeaderWorkerSet as the Deployment status.serving reads (desired/status.py: rollout):
    replicas, ready, updated and available groups (LWS counts a group ready when all its pods
    are), its generation and config hash, and the leaders' selector."""
    if group is None:
        return None
    meta, spec, st = group["metadata"], group.get("spec") or {}, group.get("status") or {}
    ready = st.get("readyReplicas", 0)
    name = meta.get("labels", {}).get("app.kubernetes.io/instance", meta["name"])
    return {
        "metadata": {"name": meta["name"], "generation": meta.get("generation", 0),
                     "annotations": dict(meta.get("annotations") or {})},
        "spec": {"replicas": spec.get("replicas", 1), "selector": {"matchLabels": leader_selector(name)}},
        "status": {
            "observedGeneration": st.get("observedGeneration", 0),
            "replicas": st.get("replicas", 0),
            "readyReplicas": ready,
            "updatedReplicas": st.get("updatedReplicas", 0),
            "availableReplicas": ready,
            "conditions": [],
        },
    }
