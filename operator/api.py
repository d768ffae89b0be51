"""The SpecDecodeDeployment API's vocabulary: group, version, kind, annotations, labels, condition
types, phases and reasons. One home for each; every other module imports them from here
(kubebuilder keeps the same in api/<group>/<version>/*_types.go).

The CRD itself is written once, in manifests/crd/; tests hold it to these names.
"""

from __future__ import annotations

from specdeploy.engine.planner.compat import DRAFT_INCOMPATIBLE

GROUP = "specdeploy.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
PLURAL = "specdecodedeployments"
KIND = "SpecDecodeDeployment"

# Annotations on the resource and its children.
PAUSED_ANNOTATION = f"{GROUP}/paused"
CONFIG_HASH_ANNOTATION = f"{GROUP}/config-hash"

# Recommended labels (kubernetes.io/docs/concepts/overview/working-with-objects/common-labels).
MANAGED_BY = "specdeploy-operator"
ENGINE_APP_NAME = "specdeploy-engine"
ROUTER_APP_NAME = "specdeploy-router"
# Which half of a disaggregated deployment (spec.disaggregation) an engine pod is: prefill | decode.
ROLE_LABEL = f"{GROUP}/role"
ENGINE_ROLES = ("prefill", "decode")
# The Deployments of a disaggregated deployment: both engine roles and the router in front of them.
SPLIT_ROLES = (*ENGINE_ROLES, "router")
LABEL_NAME = "app.kubernetes.io/name"
LABEL_INSTANCE = "app.kubernetes.io/instance"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_PART_OF = "app.kubernetes.io/part-of"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"

# Condition types.
PLAN_READY = "PlanReady"
READY = "Ready"
PROGRESSING = "Progressing"
DEGRADED = "Degraded"
CONDITION_TYPES = (PLAN_READY, READY, PROGRESSING, DEGRADED)
# What a resource gets beyond its engine (operator/desired/addons.py): present only when asked for.
AUTOSCALING = "Autoscaling"
INFERENCE_POOL = "InferencePool"

# Phases: one word for humans.
PHASE_PENDING = "Pending"
PHASE_PLANNING = "Planning"
PHASE_DEPLOYING = "Deploying"
PHASE_READY = "Ready"
PHASE_FAILED = "Failed"
PHASE_PAUSED = "Paused"

# PlanReady=False reasons: the configs could not be read or planned.
REASON_CONFIG_NOT_FOUND = "ConfigNotFound"
REASON_CONFIG_INVALID = "ConfigInvalid"
REASON_HUB_UNREACHABLE = "HubUnreachable"
REASON_HUB_UNAUTHORIZED = "HubUnauthorized"
REASON_TOKEN_NOT_FOUND = "HubTokenNotFound"
REASON_API_KEY_SECRET_NOT_FOUND = "ApiKeySecretNotFound"
REASON_HUB_NOT_TRUSTED = "HubEndpointNotTrusted"
REASON_HUB_ANSWER_TOO_LARGE = "HubAnswerTooLarge"
REASON_UNKNOWN_GPU = "UnknownGPU"
REASON_PLANNED = "Planned"
REASON_CHILD_CONFLICT = "ChildConflict"
REASON_MODEL_CACHE_IMMUTABLE = "ModelCacheImmutable"
REASON_MODEL_CACHE_NOT_FOUND = "ModelCacheNotFound"
REASON_ENGINE_SPEC_INVALID = "EngineSpecInvalid"
REASON_DRAFT_INCOMPATIBLE = DRAFT_INCOMPATIBLE  # the planner's (engine/planner/compat.py)

# Ready / Progressing / Degraded reasons, from the engine Deployment's state.
REASON_DEPLOYMENT_MISSING = "DeploymentMissing"
REASON_ROLLOUT_PENDING = "RolloutPending"
REASON_ALL_REPLICAS_READY = "AllReplicasReady"
REASON_ROLLOUT_COMPLETE = "RolloutComplete"
REASON_REPLICAS_NOT_READY = "ReplicasNotReady"
REASON_PROGRESS_DEADLINE_EXCEEDED = "ProgressDeadlineExceeded"
REASON_ROLLING_OUT = "RollingOut"
REASON_REPLICA_FAILURE = "ReplicaFailure"
REASON_REPLICAS_UNAVAILABLE = "ReplicasUnavailable"
REASON_AS_EXPECTED = "AsExpected"
# ... and what the engine pods say while not ready (desired/pods.py; the Kubernetes reasons as
# kubectl shows them, and the engine still loading its weights).
REASON_UNSCHEDULABLE = "Unschedulable"
REASON_IMAGE_PULL_BACK_OFF = "ImagePullBackOff"
REASON_ERR_IMAGE_PULL = "ErrImagePull"
REASON_CRASH_LOOP_BACK_OFF = "CrashLoopBackOff"
REASON_OOM_KILLED = "OOMKilled"
REASON_ENGINE_LOADING = "EngineLoading"

# Autoscaling / InferencePool reasons (the True ones: the kinds applied, or these).
REASON_KEDA_NOT_INSTALLED = "KEDANotInstalled"
REASON_METRIC_NOT_EXPORTED = "MetricNotExported"
REASON_METRIC_EXPORTED = "MetricExported"
REASON_INFERENCE_POOL_CRD_MISSING = "InferencePoolCRDMissing"
REASON_INFERENCE_POOL_APPLIED = "InferencePoolApplied"

# Event reasons (kubectl describe / kubectl get events).
EVENT_PAUSED = "Paused"
EVENT_PLANNED = "Planned"
EVENT_APPLIED = "Applied"
EVENT_READY = "Ready"
EVENT_CHILD_CONFLICT = "ChildConflict"
EVENT_DEPLOYMENT_DELETED = "DeploymentDeleted"

# LeaderWorkerSet (sigs.k8s.io/lws, v0.9.0): a replica that spans nodes is one group of pods.
LWS_GROUP = "leaderworkerset.x-k8s.io"
LWS_VERSION = "v1"
LWS_API_VERSION = f"{LWS_GROUP}/{LWS_VERSION}"
LWS_PLURAL = "leaderworkersets"
LWS_KIND = "LeaderWorkerSet"
LWS_CRD_NAME = f"{LWS_PLURAL}.{LWS_GROUP}"
LWS_RELEASE = "v0.9.0"
# The label LWS puts on each pod of a group: "0" on the leader.
LWS_WORKER_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"
LWS_INSTALL = (f"kubectl apply --server-side -f https://github.com/kubernetes-sigs/lws/releases/download/"
               f"{LWS_RELEASE}/manifests.yaml")
REASON_LWS_MISSING = "LeaderWorkerSetMissing"
