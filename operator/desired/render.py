"""SpecDecodeDeployment + memory plan -> the engine's ConfigMap, Deployment and Service (pure).

Nothing here talks to the cluster: `render_children` returns plain dicts ready for server-side
apply, so every rendering rule is a unit test away.
"""

from __future__ import annotations

import copy
import hashlib
import json
from dataclasses import dataclass
from typing import Any

from specdeploy.engine.planner.options import DEFAULTS
from specdeploy.engine.planner.plan import GIB
from specdeploy.operator.desired import scheduling
from specdeploy.operator.api import (
    API_VERSION,
    CONFIG_HASH_ANNOTATION,
    ENGINE_APP_NAME,
    KIND,
    LABEL_COMPONENT,
    LABEL_INSTANCE,
    LABEL_MANAGED_BY,
    LABEL_NAME,
    LABEL_PART_OF,
    MANAGED_BY,
    PAUSED_ANNOTATION,
)

ENGINE_CONTAINER = "engine"
ENGINE_PORT = 8000
ENGINE_PORT_NAME = "http"
CONFIG_MOUNT_PATH = "/etc/specdeploy"
PLAN_PATH = f"{CONFIG_MOUNT_PATH}/plan.json"
MODEL_CACHE_PATH = "/var/cache/huggingface"
GPU_RESOURCE = "nvidia.com/gpu"
# spec.engine.apiKeySecretRef: the Secret mounted whole (a subPath mount would never see an
# update: rotation is the engine re-reading the file the kubelet swaps in place).
API_KEYS_VOLUME = "api-keys"
API_KEYS_MOUNT_PATH = "/var/run/secrets/specdeploy/api-keys"
API_KEYS_FILE = "keys"
DEFAULT_API_KEY_SECRET_KEY = "api-keys"
GPU_PRODUCT_LABEL = "nvidia.com/gpu.product"

# Loading weights from a hub and capturing CUDA graphs can take many minutes before /health
# answers; liveness must not kill the pod meanwhile. 10 s x 180 = 30 minutes of grace.
STARTUP_PROBE_PERIOD_S = 10
STARTUP_PROBE_FAILURES = 180
# The engine Deployment's progressDeadlineSeconds: a pod downloads and loads the plan's weights
# (target + draft, whole, in every pod) and captures its graphs before /ready; the deadline allows
# that at LOAD_RATE_BYTES_PER_S (a hub download on a fast link, or a cold volume read) plus a fixed
# allowance, and never less than Kubernetes' default, so a large model that is loading is
# Progressing, not ProgressDeadlineExceeded.
LOAD_RATE_BYTES_PER_S = 100 * 2**20
LOAD_ALLOWANCE_S = 300
MIN_PROGRESS_DEADLINE_S = 600
# Give the Service's endpoints time to drop a terminating pod before the engine stops accepting.
PRE_STOP_SLEEP_S = 5
DEFAULT_TERMINATION_GRACE_S = 120
# The kubelet kills the pod a grace period after the preStop hook starts: the engine's drain
# (--drain-timeout-s) ends this long before that, so it stops on its own with its logs written.
DRAIN_MARGIN_S = 5
CONFIG_HASH_CHARS = 16
# A model cache claim the operator creates holds both checkpoints as the plan sized them, plus a
# quarter for what a hub download keeps beside the weights (tokenizer, config, the partial file of
# an interrupted download) and a fixed margin for small models.
MODEL_CACHE_HEADROOM = 1.25
MODEL_CACHE_MARGIN_BYTES = 2 << 30
# /dev/shm of the engine pod, memory-backed: NCCL's intra-node buffers (its SHM transport and the
# proxy's host buffers) live there, a few hundred MiB per rank; the container runtime's 64 MiB
# default makes NCCL fail at the first collective. The engine starts one process per GPU itself
# (`specdeploy engine serve` reads tensor_parallel_size from the plan), so nothing else is needed.
SHM_GIB_PER_GPU = 1


def owner_reference(sdd: dict[str, Any]) -> dict[str, Any]:
    """The controller owner reference a child of `sdd` carries."""
    meta = sdd["metadata"]
    return {
        "apiVersion": sdd.get("apiVersion", API_VERSION),
        "kind": sdd.get("kind", KIND),
        "name": meta["name"],
        "uid": meta["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }


@dataclass(frozen=True)
class PlannedEngine:
    """Everything the planning step decided, which the manifests are rendered from."""

    plan: dict[str, Any]  # Plan.to_dict(): the same JSON as `specdeploy plan --json`
    tensor_parallel_size: int
    gpu_product_label: str  # value of the nodes' nvidia.com/gpu.product label
    target_config: dict[str, Any]
    draft_config: dict[str, Any] | None
    cpu: bool = False  # CPU mode (spec.cpu): no GPU request, affinity nor toleration
    # spec.disaggregation: each engine role's own plan ("prefill", "decode"); `plan` is decode's.
    role_plans: dict[str, dict[str, Any]] | None = None
    # Nodes one replica spans: more than one renders a LeaderWorkerSet group per replica
    # (desired/leaderworkerset.py), tensor_parallel_size / nodes ranks on each.
    nodes: int = 1


@dataclass(frozen=True)
class EngineDefaults:
    """Operator-wide settings a resource may leave unset."""

    image: str
    hub_endpoint: str


@dataclass(frozen=True)
class Children:
    config_map: dict[str, Any]
    deployment: dict[str, Any]
    service: dict[str, Any]
    config_hash: str
    model_cache_claim: dict[str, Any] | None = None  # a PersistentVolumeClaim the operator makes
    model_cache: dict[str, Any] | None = None  # status.modelCache: where the weights are kept

    def all(self) -> list[dict[str, Any]]:
        # ConfigMap and claim first: the Deployment's pods mount them.
        claim = [self.model_cache_claim] if self.model_cache_claim else []
        return [self.config_map, *claim, self.deployment, self.service]


def selector_labels(name: str) -> dict[str, str]:
    """The engine pods of one resource; immutable in a Deployment, so it never changes."""
    return {LABEL_NAME: ENGINE_APP_NAME, LABEL_INSTANCE: name}


def common_labels(name: str) -> dict[str, str]:
    return {
        **selector_labels(name),
        LABEL_COMPONENT: "engine",
        LABEL_PART_OF: "specdeploy",
        LABEL_MANAGED_BY: MANAGED_BY,
    }


def deployment_name(name: str) -> str:
    return name


def service_name(name: str) -> str:
    return name


def config_map_name(name: str) -> str:
    # Suffixed so that it cannot collide with a user's ConfigMap named after the resource
    # (e.g. the one a configMapRef points at).
    return f"{name}-engine"


def model_cache_claim_name(name: str) -> str:
    return f"{name}-model-cache"


# Kubernetes' quantity suffixes (binary, decimal, and milli: "1500m" bytes are 1.5 bytes).
_QUANTITY_SUFFIXES = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40, "Pi": 1 << 50, "Ei": 1 << 60,
                      "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18, "m": 1e-3}


def quantity_bytes(quantity: str) -> float:
    """A storage or memory quantity ("20Gi", "500M", "1e9") in bytes."""
    for suffix, factor in sorted(_QUANTITY_SUFFIXES.items(), key=lambda kv: -len(kv[0])):
        if quantity.endswith(suffix):
            return float(quantity[: -len(suffix)]) * factor
    return float(quantity)


def model_cache_size(plan: dict[str, Any]) -> str:
    """The size of a claim the operator creates: both models' weights (the plan's weight_bytes,
    whole models before tensor parallelism) with headroom, in whole GiB."""
    weights = sum(int((plan.get(role) or {}).get("weight_bytes") or 0) for role in ("target", "draft"))
    wanted = weights * MODEL_CACHE_HEADROOM + MODEL_CACHE_MARGIN_BYTES
    return f"{-(-int(wanted) // GIB)}Gi"


def weights_sources(spec: dict[str, Any], hub_endpoint: str) -> list[dict[str, Any]]:
    """status.modelCache.weights: where each model's weights come from. A model given as an
    absolute path is read from the pod's filesystem (the image or a volume); any other is a hub
    repository, downloaded into the model cache unless it is already there."""
    sources = []
    for role in ("target", "draft"):
        model = spec.get(role)
        if not model:
            continue
        entry: dict[str, Any] = {"role": role, "model": model["model"]}
        if model["model"].startswith("/"):
            entry["source"] = "Path"
        else:
            entry.update(source="Hub", endpoint=hub_endpoint, revision=model.get("revision", "main"))
        sources.append(entry)
    return sources


def render_model_cache(
    sdd: dict[str, Any], plan: dict[str, Any],
) -> tuple[dict[str, Any], dict[str, Any] | None, dict[str, Any]]:
    """(the pod's model-cache volume, the claim to create or None, status.modelCache).

    No spec.modelCache: an emptyDir, so every new pod downloads hub weights again. claimName: that
    existing claim, used as it is. Otherwise a claim of the resource's own (`<name>-model-cache`,
    owned by it: deleted with it), sized from the plan unless spec.modelCache.size says otherwise."""
    name = sdd["metadata"]["name"]
    cache = sdd["spec"].get("modelCache")
    if cache is None:
        return ({"name": "model-cache", "emptyDir": {}}, None,
                {"volume": "EmptyDir", "mountPath": MODEL_CACHE_PATH,
                 "message": "no spec.modelCache: weights from a hub are downloaded again by every new pod"})
    if cache.get("claimName"):
        claim = cache["claimName"]
        return ({"name": "model-cache", "persistentVolumeClaim": {"claimName": claim}}, None,
                {"volume": "PersistentVolumeClaim", "claimName": claim, "managed": False, "mountPath": MODEL_CACHE_PATH})
    claim_name = model_cache_claim_name(name)
    size = cache.get("size") or model_cache_size(plan)
    claim_spec: dict[str, Any] = {
        "accessModes": list(cache.get("accessModes") or ["ReadWriteOnce"]),
        "resources": {"requests": {"storage": size}},
    }
    if cache.get("storageClassName"):
        claim_spec["storageClassName"] = cache["storageClassName"]
    claim = {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": claim_name, "labels": common_labels(name)},
        "spec": claim_spec,
    }
    return ({"name": "model-cache", "persistentVolumeClaim": {"claimName": claim_name}}, claim,
            {"volume": "PersistentVolumeClaim", "claimName": claim_name, "managed": True, "size": size,
             "mountPath": MODEL_CACHE_PATH})


def is_paused(meta: dict[str, Any]) -> bool:
    return (meta.get("annotations") or {}).get(PAUSED_ANNOTATION, "").lower() == "true"


def drain_timeout_s(termination_grace_s: int) -> int:
    """The engine's drain budget within the pod's grace period (after preStop, before SIGKILL)."""
    return max(1, termination_grace_s - PRE_STOP_SLEEP_S - DRAIN_MARGIN_S)


def engine_settings(spec: dict[str, Any]) -> dict[str, Any]:
    """The spec's engine settings with the CRD defaults filled in (objects created before a
    default existed, or rendered in tests, may lack them)."""
    engine = spec.get("engine") or {}
    speculative = spec["speculative"]
    algorithm = speculative["algorithm"]
    num_steps = speculative.get("numSteps", DEFAULTS.num_steps)
    topk = speculative.get("topk", DEFAULTS.topk)
    settings: dict[str, Any] = {
        "target": spec["target"]["model"],
        "target_revision": spec["target"].get("revision", "main"),
        "algorithm": algorithm,
        "max_running_requests": engine.get("maxRunningRequests", DEFAULTS.max_running_requests),
        "cuda_graph_max_batch_size": engine.get(
            "cudaGraphMaxBatchSize", engine.get("maxRunningRequests", DEFAULTS.max_running_requests)
        ),
        "context_length": engine.get("contextLength", DEFAULTS.context_length),
        "prefix_cache": engine.get("prefixCache", DEFAULTS.prefix_cache),
        "extend_graphs": engine.get("extendGraphs", DEFAULTS.extend_graphs),
        "drain_timeout_s": drain_timeout_s(engine.get("terminationGracePeriodSeconds", DEFAULT_TERMINATION_GRACE_S)),
    }
    if algorithm != "NONE":
        settings.update(
            num_steps=num_steps,
            topk=topk,
            num_draft_tokens=speculative.get("numDraftTokens", num_steps + 1),
        )
        if speculative.get("adaptive"):  # absent when off: existing pods keep their config hash
            settings["adaptive"] = True
    quantization = speculative.get("draftQuantization", DEFAULTS.draft_quantization)
    if quantization != DEFAULTS.draft_quantization:  # absent when none: existing pods keep their config hash
        settings["draft_quantization"] = quantization
    if engine.get("dtype"):
        settings["dtype"] = engine["dtype"]
    if engine.get("kvCacheDtype", DEFAULTS.kv_cache_dtype) != "auto":
        settings["kv_cache_dtype"] = engine["kvCacheDtype"]
    if spec.get("draft"):
        settings["draft"] = spec["draft"]["model"]
        settings["draft_revision"] = spec["draft"].get("revision", "main")
    if spec.get("servedModelName"):  # absent when unset: existing pods keep their config hash
        settings["served_model_name"] = spec["servedModelName"]
    return settings


def engine_args(settings: dict[str, Any]) -> list[str]:
    """Arguments of `specdeploy engine serve` (the server's command-line contract). `settings`:
    engine_settings() with the planned "dtype" set."""
    args = ["--target", settings["target"]]
    if settings.get("target_revision", "main") != "main":
        args += ["--target-revision", settings["target_revision"]]
    if "draft" in settings:
        args += ["--draft", settings["draft"]]
        if settings.get("draft_revision", "main") != "main":
            args += ["--draft-revision", settings["draft_revision"]]
    args += ["--algorithm", settings["algorithm"]]
    if settings.get("served_model_name"):
        args += ["--served-model-name", settings["served_model_name"]]
    if settings["algorithm"] != "NONE":
        args += [
            "--num-steps", str(settings["num_steps"]),
            "--topk", str(settings["topk"]),
            "--num-draft-tokens", str(settings["num_draft_tokens"]),
        ]
        if settings.get("adaptive"):
            args.append("--adaptive-speculation")
        if settings.get("draft_quantization", DEFAULTS.draft_quantization) != DEFAULTS.draft_quantization:
            args += ["--draft-quantization", settings["draft_quantization"]]
    # Always the planned dtype: the engine's own default (auto) means bf16 on GPU, which is not
    # what a float16 or float32 plan sized.
    args += ["--plan", PLAN_PATH, "--dtype", settings["dtype"]]
    if settings.get("kv_cache_dtype", "auto") != "auto":
        args += ["--kv-cache-dtype", settings["kv_cache_dtype"]]
    args += [
        "--max-running-requests", str(settings["max_running_requests"]),
        "--context-length", str(settings["context_length"]),
        "--host", "0.0.0.0",
        "--port", str(ENGINE_PORT),
    ]
    if "drain_timeout_s" in settings:
        args += ["--drain-timeout-s", str(settings["drain_timeout_s"])]
    if not settings.get("prefix_cache", True):  # on is the engine's default
        args.append("--no-prefix-cache")
    if not settings.get("extend_graphs", True):  # on is the engine's default
        args.append("--no-extend-graphs")
    return args


def secret_file_volume(volume: str, secret: str, key: str, file_name: str,
                       mount_path: str) -> tuple[dict[str, Any], dict[str, Any], str]:
    """(pod volume, container mount, file path) of one key of a Secret, mounted read-only."""
    return ({"name": volume, "secret": {"secretName": secret, "items": [{"key": key, "path": file_name}],
                                        "defaultMode": 0o444}},
            {"name": volume, "mountPath": mount_path, "readOnly": True},
            f"{mount_path}/{file_name}")


def api_key_secret(spec: dict[str, Any]) -> tuple[str, str] | None:
    """(Secret name, key) of spec.engine.apiKeySecretRef, or None."""
    ref = (spec.get("engine") or {}).get("apiKeySecretRef")
    if not ref:
        return None
    return ref["name"], ref.get("key") or DEFAULT_API_KEY_SECRET_KEY


def with_api_keys(spec: dict[str, Any], container: dict[str, Any], pod_spec: dict[str, Any]) -> None:
    """Mount spec.engine.apiKeySecretRef into the container that faces clients (the engine, or a
    disaggregated resource's router) and pass --api-key-file (in place)."""
    ref = api_key_secret(spec)
    if ref is None:
        return
    volume, mount, path = secret_file_volume(API_KEYS_VOLUME, *ref, API_KEYS_FILE, API_KEYS_MOUNT_PATH)
    container["args"] = [*container["args"], "--api-key-file", path]
    container.setdefault("volumeMounts", []).append(mount)
    pod_spec.setdefault("volumes", []).append(volume)


def _canonical_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def config_hash(config_map_data: dict[str, Any], pod_inputs: dict[str, Any]) -> str:
    """Hash of everything the engine reads at start-up. Stamped on the pod template so that a
    changed plan or config rolls the pods even when the container spec itself is unchanged."""
    digest = hashlib.sha256(_canonical_json([config_map_data, pod_inputs]).encode())
    return digest.hexdigest()[:CONFIG_HASH_CHARS]


def _engine_env(spec: dict[str, Any], hub_endpoint: str, cpu: bool) -> list[dict[str, Any]]:
    env: dict[str, dict[str, Any]] = {
        "HF_ENDPOINT": {"name": "HF_ENDPOINT", "value": hub_endpoint},
        "HF_HOME": {"name": "HF_HOME", "value": MODEL_CACHE_PATH},
    }
    if cpu:
        # The engine computes on CPU when it sees no CUDA device. A pod that requests no GPU can
        # still be handed all of a node's GPUs by the NVIDIA runtime (the CUDA base image sets
        # NVIDIA_VISIBLE_DEVICES=all): hide them so the engine runs where the plan sized it.
        env["NVIDIA_VISIBLE_DEVICES"] = {"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"}
        env["CUDA_VISIBLE_DEVICES"] = {"name": "CUDA_VISIBLE_DEVICES", "value": ""}
    token_ref = (spec.get("hub") or {}).get("tokenSecretRef")
    if token_ref:
        env["HF_TOKEN"] = {
            "name": "HF_TOKEN",
            "valueFrom": {
                "secretKeyRef": {"name": token_ref["name"], "key": token_ref.get("key", "token")}
            },
        }
    # The user's variables win by name: server-side apply rejects duplicate names.
    for var in (spec.get("engine") or {}).get("env") or []:
        env[var["name"]] = copy.deepcopy(var)
    return list(env.values())


def _engine_resources(spec: dict[str, Any], gpus: int, user: dict[str, Any] | None = None) -> dict[str, Any]:
    """The user's CPU and memory (`user`, else spec.engine.resources) plus `gpus` nvidia.com/gpu
    (none at all when `gpus` is 0)."""
    if user is None:
        user = (spec.get("engine") or {}).get("resources") or {}
    requests = {k: v for k, v in (user.get("requests") or {}).items() if k != GPU_RESOURCE}
    limits = {k: v for k, v in (user.get("limits") or {}).items() if k != GPU_RESOURCE}
    if gpus:
        # Extended resources must have requests == limits; the plan, not the user, decides the count.
        requests[GPU_RESOURCE] = gpus
        limits[GPU_RESOURCE] = gpus
    return {"requests": requests, "limits": limits}


def _gpu_scheduling(product_label: str) -> dict[str, Any]:
    """Pod-spec fields that put a GPU engine on nodes with the planned GPU product."""
    return {
        "affinity": {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [
                        {
                            "matchExpressions": [
                                {"key": GPU_PRODUCT_LABEL, "operator": "In", "values": [product_label]}
                            ]
                        }
                    ]
                }
            }
        },
        "tolerations": [{"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}],
    }


def _http_probe(path: str, period_s: int, failures: int, timeout_s: int = 5) -> dict[str, Any]:
    return {
        "httpGet": {"path": path, "port": ENGINE_PORT_NAME},
        "periodSeconds": period_s,
        "failureThreshold": failures,
        "timeoutSeconds": timeout_s,
    }


def _shm_size(planned: PlannedEngine) -> str:
    """sizeLimit of the pod's /dev/shm: SHM_GIB_PER_GPU per tensor-parallel rank (CPU mode: one)."""
    return f"{SHM_GIB_PER_GPU * (1 if planned.cpu else planned.tensor_parallel_size)}Gi"


def render_children(
    sdd: dict[str, Any], planned: PlannedEngine, defaults: EngineDefaults
) -> Children:
    """The engine's ConfigMap, Deployment and Service for one SpecDecodeDeployment."""
    meta, spec = sdd["metadata"], sdd["spec"]
    name = meta["name"]
    engine = spec.get("engine") or {}
    hub_endpoint = (spec.get("hub") or {}).get("endpoint") or defaults.hub_endpoint
    image = engine.get("image") or defaults.image
    # The dtype the plan sized (spec.engine.dtype, else the target's torch_dtype).
    settings = {**engine_settings(spec), "dtype": planned.plan["target"]["dtype"]}
    labels = common_labels(name)

    config_map_data = {
        "plan.json": json.dumps(planned.plan, indent=2, sort_keys=True) + "\n",
        "engine.json": json.dumps(
            {**settings, "tensor_parallel_size": planned.tensor_parallel_size, "image": image},
            indent=2,
            sort_keys=True,
        )
        + "\n",
    }
    container = engine_container(
        spec, image, engine_args(settings), _engine_env(spec, hub_endpoint, planned.cpu),
        _engine_resources(spec, 0 if planned.cpu else planned.tensor_parallel_size),
    )
    cache_volume, cache_claim, cache_status = render_model_cache(sdd, planned.plan)
    pod_spec = engine_pod_spec(spec, container, config_map_name(name), planned, cache_volume)
    with_api_keys(spec, container, pod_spec)
    hash_value = config_hash(config_map_data, {"image": image, "args": container["args"]})

    config_map = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": config_map_name(name), "labels": dict(labels)},
        "data": config_map_data,
    }
    cache_status["weights"] = weights_sources(spec, hub_endpoint)
    deployment = deployment_object(deployment_name(name), labels, selector_labels(name),
                                   spec.get("replicas", 1), hash_value, pod_spec, progress_deadline_s(planned.plan))
    scheduling.customize_deployment(deployment, spec)
    service = service_object(service_name(name), labels, selector_labels(name))
    finish_children(sdd, [config_map, deployment, service] + ([cache_claim] if cache_claim else []), labels)
    return Children(config_map, deployment, service, hash_value, cache_claim, cache_status)


def engine_container(spec: dict[str, Any], image: str, args: list[str], env: list[dict[str, Any]],
                     resources: dict[str, Any]) -> dict[str, Any]:
    """The engine container: `specdeploy engine serve ARGS`, its probes, mounts and drain."""
    container: dict[str, Any] = {
        "name": ENGINE_CONTAINER,
        "image": image,
        "command": ["specdeploy", "engine", "serve"],
        "args": args,
        "ports": [{"name": ENGINE_PORT_NAME, "containerPort": ENGINE_PORT, "protocol": "TCP"}],
        "env": env,
        "resources": resources,
        "startupProbe": _http_probe("/health", STARTUP_PROBE_PERIOD_S, STARTUP_PROBE_FAILURES),
        "livenessProbe": _http_probe("/health", 10, 3),
        "readinessProbe": _http_probe("/ready", 5, 3),
        "lifecycle": {"preStop": {"sleep": {"seconds": PRE_STOP_SLEEP_S}}},
        "volumeMounts": [
            {"name": "engine-config", "mountPath": CONFIG_MOUNT_PATH, "readOnly": True},
            {"name": "dshm", "mountPath": "/dev/shm"},
            {"name": "model-cache", "mountPath": MODEL_CACHE_PATH},
        ],
    }
    pull_policy = (spec.get("engine") or {}).get("imagePullPolicy")
    if pull_policy:
        container["imagePullPolicy"] = pull_policy
    return container


def engine_pod_spec(spec: dict[str, Any], container: dict[str, Any], config_map: str,
                    planned: PlannedEngine, cache_volume: dict[str, Any] | None = None) -> dict[str, Any]:
    """`cache_volume`: the model-cache volume (render_model_cache); default an emptyDir."""
    engine = spec.get("engine") or {}
    return {
        "containers": [container],
        "terminationGracePeriodSeconds": engine.get("terminationGracePeriodSeconds", DEFAULT_TERMINATION_GRACE_S),
        "enableServiceLinks": False,
        # The engine never calls the Kubernetes API: a token in the pod is only something to steal.
        "automountServiceAccountToken": False,
        **({} if planned.cpu else _gpu_scheduling(planned.gpu_product_label)),
        "volumes": [
            {"name": "engine-config", "configMap": {"name": config_map}},
            {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": _shm_size(planned)}},
            cache_volume or {"name": "model-cache", "emptyDir": {}},
        ],
    }


def progress_deadline_s(plan: dict[str, Any]) -> int:
    """progressDeadlineSeconds for an engine of this plan (see LOAD_RATE_BYTES_PER_S)."""
    weights = sum(int((plan.get(m) or {}).get("weight_bytes") or 0) for m in ("target", "draft"))
    return max(MIN_PROGRESS_DEADLINE_S, -(-weights // LOAD_RATE_BYTES_PER_S) + LOAD_ALLOWANCE_S)


def deployment_object(name: str, labels: dict[str, str], selector: dict[str, str], replicas: int,
                      hash_value: str, pod_spec: dict[str, Any], progress_deadline: int | None = None) -> dict[str, Any]:
    deployment: dict[str, Any] = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {
            "name": name,
            "labels": dict(labels),
            "annotations": {CONFIG_HASH_ANNOTATION: hash_value},
        },
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": dict(selector)},
            # One replica holds whole GPUs; surge would need spare ones. Replace in place instead.
            "strategy": {
                "type": "RollingUpdate",
                "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1},
            },
            "template": {
                "metadata": {
                    "labels": dict(labels),
                    "annotations": {CONFIG_HASH_ANNOTATION: hash_value},
                },
                "spec": pod_spec,
            },
        },
    }
    if progress_deadline is not None:
        deployment["spec"]["progressDeadlineSeconds"] = progress_deadline
    return deployment


def service_object(name: str, labels: dict[str, str], selector: dict[str, str],
                   headless: bool = False) -> dict[str, Any]:
    """A Service on the engine port; headless: DNS answers with every ready pod's address (what
    the router of a disaggregated deployment resolves to pick pods by load)."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "labels": dict(labels)},
        "spec": {
            "type": "ClusterIP",
            **({"clusterIP": "None"} if headless else {}),
            "selector": dict(selector),
            "ports": [
                {
                    "name": ENGINE_PORT_NAME,
                    "port": ENGINE_PORT,
                    "targetPort": ENGINE_PORT_NAME,
                    "protocol": "TCP",
                }
            ],
        },
    }


def finish_children(sdd: dict[str, Any], children: list[dict[str, Any]], labels: dict[str, str]) -> None:
    """Owner reference, namespace and labels on every child (in place).

    Owner references (controller=true) make the garbage collector delete the children with the
    resource, and let a restarted operator recognise them as its own."""
    owner = owner_reference(sdd)
    inherited = dict((sdd.get("metadata") or {}).get("labels") or {})
    for child in children:
        meta = child["metadata"]
        meta["ownerReferences"] = [owner]
        # The resource's own labels are inherited; ours win where both set one.
        meta["labels"] = {**inherited, **meta["labels"], **labels}
        meta["namespace"] = sdd["metadata"]["namespace"]
