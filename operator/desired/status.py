"""Status of a SpecDecodeDeployment as pure functions of (current status, what just happened).

Conditions (each with reason, message, lastTransitionTime, observedGeneration):
  PlanReady    the configs were read and the plan fits (False: the reason says why not)
  Progressing  the engine Deployment is rolling out the current spec
  Ready        every replica of the current spec is ready to serve
  Degraded     something that served or should serve is not well (failed rollout, lost replicas,
               or a transient failure while the previous spec keeps serving)

Phase, one word for humans: Pending (waiting to retry a transient failure), Planning, Deploying,
Ready, Failed (the spec cannot be served as written), Paused.

lastTransitionTime moves only when a condition's status flips, as Kubernetes API conventions ask.
"""

from __future__ import annotations

import copy
from datetime import datetime, timezone
from typing import Any

from specdeploy.operator import api
from specdeploy.operator.api import (
    CONDITION_TYPES,
    CONFIG_HASH_ANNOTATION,
    DEGRADED,
    PHASE_DEPLOYING,
    PHASE_FAILED,
    PHASE_PAUSED,
    PHASE_PENDING,
    PHASE_PLANNING,
    PHASE_READY,
    PLAN_READY,
    PROGRESSING,
    READY,
)


def now_rfc3339() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def camel_case(key: str) -> str:
    head, *rest = key.split("_")
    return head + "".join(part[:1].upper() + part[1:] for part in rest)


def camelize(value: Any) -> Any:
    """snake_case keys of the plan JSON -> camelCase, as Kubernetes status fields are spelled."""
    if isinstance(value, dict):
        return {camel_case(str(k)): camelize(v) for k, v in value.items()}
    if isinstance(value, list):
        return [camelize(v) for v in value]
    return value




# memory_per_gpu terms shown in status.plan.memoryPerGpuGiB (the rest of the plan's byte-level
# terms stay in the engine ConfigMap's plan.json).
_MEMORY_TERMS = {"total": "gpu_memory_bytes", "weights": "weight_bytes", "kvCache": "kv_cache_bytes",
                 "cudaGraphs": "cuda_graph_pool_bytes", "workspace": "activation_workspace_bytes",
                 "staticBuffers": "static_buffer_bytes", "perRequestState": "per_request_state_bytes",
                 "reserve": "reserve_bytes"}
_GIB = 2**30


def _gib(n: Any) -> float:
    return round(int(n or 0) / _GIB, 2)


def status_plan(plan: dict[str, Any]) -> dict[str, Any]:
    """`status.plan`: the plan summarized for people (`kubectl describe`): its scalar figures in
    camelCase, each model in one line, memory per GPU in GiB, the KV pool in tokens. The whole
    byte-level plan is the engine ConfigMap's plan.json (what the engine allocates).

    weightBytes and kvBytesPerToken sum target and draft over the whole model (before tensor
    parallelism). weightsSource says how the target's weights were counted: "headers" (its
    safetensors headers, read from the hub), "index" (model.safetensors.index.json's total), an
    estimate from "quantization_config", or "shapes" (parameters x dtype).
    gpusPerReplica is the tensor-parallel size (every node of the group together), or 0 in CPU
    mode (spec.cpu: the plan sizes one device, the CPU's memory). nodes: the nodes one replica
    spans (1 for plans written before it existed).
    """
    result = {camel_case(k): v for k, v in plan.items() if not isinstance(v, (dict, list))}
    result["nodes"] = int(plan.get("nodes") or 1)
    result["gpusPerReplica"] = 0 if plan.get("gpu") == "cpu" else int(plan.get("tensor_parallel_size") or 0)
    models = {role: plan[role] for role in ("target", "draft") if isinstance(plan.get(role), dict) and plan[role]}
    result["weightBytes"] = sum(int(m.get("weight_bytes") or 0) for m in models.values())
    # where the target's bytes came from: headers | index | quantization_config | shapes
    result["weightsSource"] = (models.get("target") or {}).get("weight_source", "")
    result["kvBytesPerToken"] = sum(int(m.get("kv_cache_bytes_per_token") or 0) for m in models.values())
    for role, m in models.items():
        result[role] = (f"{m.get('architecture') or m.get('model_type') or '?'} as {m.get('role', role)}, "
                        f"{m.get('dtype', '?')}, {m.get('num_layers', '?')} layer{'' if m.get('num_layers') == 1 else 's'}, "
                        f"{_gib(m.get('weight_bytes'))} GiB of weights ({m.get('weight_source', '?')}), "
                        f"{m.get('kv_cache_bytes_per_token', '?')} KV bytes per token")
    memory = plan.get("memory_per_gpu")
    if isinstance(memory, dict):
        result["memoryPerGpuGiB"] = {name: _gib(memory.get(key)) for name, key in _MEMORY_TERMS.items()}
    if plan.get("max_total_tokens") is not None and plan.get("required_tokens") is not None:
        result["kvCacheTokens"] = (f"{plan['max_total_tokens']} token slots for {plan['required_tokens']} needed "
                                   f"({plan.get('context_length')} context x {plan.get('max_running_requests')} requests)")
    if plan.get("notes"):
        result["notes"] = list(plan["notes"])
    return result


def get_condition(status: dict[str, Any], type_: str) -> dict[str, Any] | None:
    for condition in status.get("conditions") or []:
        if condition.get("type") == type_:
            return condition
    return None


def set_condition(
    status: dict[str, Any],
    type_: str,
    value: bool,
    reason: str,
    message: str,
    *,
    generation: int,
    now: str,
) -> None:
    """Insert or update one condition in `status` (in place), keeping the others' order."""
    conditions = status.setdefault("conditions", [])
    new_status = "True" if value else "False"
    old = get_condition(status, type_)
    entry = {
        "type": type_,
        "status": new_status,
        "reason": reason,
        "message": message,
        "observedGeneration": generation,
        "lastTransitionTime": (
            old["lastTransitionTime"]
            if old and old.get("status") == new_status and old.get("lastTransitionTime")
            else now
        ),
    }
    if old is None:
        conditions.append(entry)
    else:
        conditions[conditions.index(old)] = entry
    conditions.sort(key=lambda c: CONDITION_TYPES.index(c["type"]) if c["type"] in CONDITION_TYPES else 99)


def _base(current: dict[str, Any] | None) -> dict[str, Any]:
    status = copy.deepcopy(current or {})
    status.pop("kopf", None)  # kopf's own bookkeeping is not ours to rewrite
    return status


def planning(current: dict[str, Any] | None, *, generation: int, now: str) -> dict[str, Any]:
    """Reconciling a new generation has begun."""
    status = _base(current)
    if status.get("phase") != PHASE_READY or status.get("observedGeneration") != generation:
        status["phase"] = PHASE_PLANNING
    return status


def plan_ready(
    current: dict[str, Any] | None,
    *,
    generation: int,
    plan: dict[str, Any],
    config_hash: str,
    message: str,
    now: str,
    model_cache: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The plan fits. `model_cache`: where the engine keeps its weights (render_model_cache)."""
    status = _base(current)
    status["observedGeneration"] = generation
    status["plan"] = status_plan(plan)
    status["configHash"] = config_hash
    if model_cache is not None:
        status["modelCache"] = model_cache
    status.pop("message", None)
    set_condition(status, PLAN_READY, True, api.REASON_PLANNED, message, generation=generation, now=now)
    return status


def plan_failed(
    current: dict[str, Any] | None,
    *,
    generation: int,
    reason: str,
    message: str,
    transient: bool,
    engine_kept: bool,
    now: str,
) -> dict[str, Any]:
    """The configs could not be read or the plan does not fit.

    Permanent failures (the spec must change) leave no engine: the status drops the old plan and
    serving figures. Transient ones keep whatever serves the previous spec and retry.
    """
    status = _base(current)
    status["observedGeneration"] = generation
    status["message"] = message
    set_condition(status, PLAN_READY, False, reason, message, generation=generation, now=now)
    if transient and engine_kept:
        status["phase"] = PHASE_PENDING
        set_condition(
            status, DEGRADED, True, reason,
            f"serving the previous spec until this is resolved: {message}",
            generation=generation, now=now,
        )
        return status
    status["phase"] = PHASE_PENDING if transient else PHASE_FAILED
    if not transient:
        status.pop("blockedBy", None)
        status.pop("plan", None)
        status.pop("configHash", None)
        status.pop("disaggregation", None)
        status["serving"] = {"replicas": 0, "readyReplicas": 0, "updatedReplicas": 0}
    no_engine = "no engine is deployed: " + message
    set_condition(status, READY, False, reason, no_engine, generation=generation, now=now)
    set_condition(status, PROGRESSING, False, reason, no_engine, generation=generation, now=now)
    set_condition(status, DEGRADED, False, reason, no_engine, generation=generation, now=now)
    return status


def apply_blocked(
    current: dict[str, Any] | None, *, generation: int, reason: str, message: str, now: str
) -> dict[str, Any]:
    """The plan is fine but the children could not be applied (e.g. a foreign object holds a
    child's name); retried."""
    status = _base(current)
    status["phase"] = PHASE_PENDING
    status["message"] = message
    set_condition(status, READY, False, reason, message, generation=generation, now=now)
    set_condition(status, PROGRESSING, False, reason, message, generation=generation, now=now)
    set_condition(status, DEGRADED, True, reason, message, generation=generation, now=now)
    return status


def paused(current: dict[str, Any] | None, *, generation: int, now: str) -> dict[str, Any]:
    status = _base(current)
    status["phase"] = PHASE_PAUSED
    status["message"] = "reconciliation paused by the specdeploy.dev/paused annotation"
    return status


def rollout(deployment: dict[str, Any]) -> dict[str, Any]:
    """Where a Deployment's rollout stands, read as `kubectl rollout status` does."""
    spec, st = deployment.get("spec") or {}, deployment.get("status") or {}
    wanted = spec.get("replicas", 1)
    observed = st.get("observedGeneration", 0) >= deployment["metadata"].get("generation", 0)
    updated = st.get("updatedReplicas", 0)
    total = st.get("replicas", 0)
    available = st.get("availableReplicas", 0)
    ready = st.get("readyReplicas", 0)
    deadline_exceeded = any(
        c.get("type") == "Progressing" and c.get("reason") == "ProgressDeadlineExceeded"
        for c in st.get("conditions") or []
    )
    replica_failure = next(
        (c for c in st.get("conditions") or []
         if c.get("type") == "ReplicaFailure" and c.get("status") == "True"),
        None,
    )
    complete = observed and updated >= wanted and total == updated and available >= updated
    return {
        "wanted": wanted,
        "replicas": total,
        "readyReplicas": ready,
        "updatedReplicas": updated,
        "availableReplicas": available,
        "complete": complete,
        "deadlineExceeded": deadline_exceeded,
        "replicaFailure": (replica_failure or {}).get("message"),
        "configHash": (deployment["metadata"].get("annotations") or {}).get(CONFIG_HASH_ANNOTATION),
        # The scale subresource's labelSelectorPath wants the selector as a string.
        "selector": ",".join(
            f"{k}={v}" for k, v in sorted(((spec.get("selector") or {}).get("matchLabels") or {}).items())
        ),
    }


def serving(
    current: dict[str, Any] | None,
    deployment: dict[str, Any] | None,
    *,
    generation: int,
    now: str,
) -> dict[str, Any]:
    """Fold the engine Deployment's state into the status.

    Counts are always refreshed. Ready/Progressing/Degraded and the phase follow the Deployment
    only while the current spec has a plan (PlanReady=True) and the resource is not paused: a
    failed plan's conditions stay as plan_failed wrote them.
    """
    status = _base(current)
    status.pop("disaggregation", None)  # serving_roles' (the resource was disaggregated before)
    serving_status = {
        k: v for k, v in (status.get("serving") or {}).items()
        if k in ("meanAcceptLength", "tokensPerSecond", "prefixCacheHitRate")
    }
    plan_condition = get_condition(status, PLAN_READY)
    planned = (
        plan_condition is not None
        and plan_condition["status"] == "True"
        and status.get("observedGeneration") == generation
    )
    def condition(type_: str, value: bool, reason: str, message: str) -> None:
        set_condition(status, type_, value, reason, message, generation=generation, now=now)

    if deployment is None:
        status["serving"] = {**serving_status, "replicas": 0, "readyReplicas": 0, "updatedReplicas": 0}
        if planned and status.get("phase") != PHASE_PAUSED:
            condition(READY, False, api.REASON_DEPLOYMENT_MISSING, "the engine Deployment does not exist yet")
            condition(PROGRESSING, True, api.REASON_DEPLOYMENT_MISSING, "waiting for the engine Deployment")
            status["phase"] = PHASE_DEPLOYING
        return status

    r = rollout(deployment)
    status["serving"] = {
        **serving_status,
        "deployment": deployment["metadata"]["name"],
        "selector": r["selector"],
        "replicas": r["replicas"],
        "readyReplicas": r["readyReplicas"],
        "updatedReplicas": r["updatedReplicas"],
    }
    if not planned or status.get("phase") == PHASE_PAUSED:
        return status

    if r["configHash"] is None or r["configHash"] != status.get("configHash"):
        condition(READY, False, api.REASON_ROLLOUT_PENDING, "the Deployment does not carry the current spec yet")
        condition(PROGRESSING, True, api.REASON_ROLLOUT_PENDING, "applying the current spec")
        status["phase"] = PHASE_DEPLOYING
        return status

    counts = f"{r['readyReplicas']}/{r['wanted']} replicas ready, {r['updatedReplicas']} updated"
    was_ready = (get_condition(status, READY) or {}).get("status") == "True"
    ready = r["complete"] and r["readyReplicas"] >= r["wanted"]
    # Every replica runs the current spec, yet fewer are ready than before: pods were lost, as
    # opposed to a rollout still starting them.
    lost_replicas = was_ready and not ready and r["updatedReplicas"] >= r["wanted"] and r["replicas"] == r["updatedReplicas"]
    if ready:
        status.pop("blockedBy", None)
    # What the engine pods say blocks them (engine_pods), in the words of the pods.
    blocked = status.get("blockedBy") if not ready else None
    not_ready_reason = blocked["reason"] if blocked else api.REASON_REPLICAS_NOT_READY
    not_ready = f"{blocked['message']} ({counts})" if blocked else counts
    if ready:
        condition(READY, True, api.REASON_ALL_REPLICAS_READY, counts)
        condition(PROGRESSING, False, api.REASON_ROLLOUT_COMPLETE, counts)
    elif r["deadlineExceeded"]:
        condition(READY, False, not_ready_reason, not_ready)
        condition(PROGRESSING, False, api.REASON_PROGRESS_DEADLINE_EXCEEDED, not_ready)
    else:
        condition(READY, False, not_ready_reason, not_ready)
        condition(PROGRESSING, True, api.REASON_ROLLING_OUT, not_ready)

    if r["deadlineExceeded"]:
        condition(DEGRADED, True, api.REASON_PROGRESS_DEADLINE_EXCEEDED, f"rollout stalled: {not_ready}")
    elif blocked and blocked["reason"] != api.REASON_ENGINE_LOADING:
        condition(DEGRADED, True, blocked["reason"], not_ready)
    elif r["replicaFailure"]:
        condition(DEGRADED, True, api.REASON_REPLICA_FAILURE, r["replicaFailure"])
    elif lost_replicas:
        condition(DEGRADED, True, api.REASON_REPLICAS_UNAVAILABLE, counts)
    else:
        condition(DEGRADED, False, api.REASON_AS_EXPECTED, counts)
    status["phase"] = PHASE_READY if ready else PHASE_DEPLOYING
    return status


def engine_pods(
    current: dict[str, Any] | None,
    deployment: dict[str, Any] | None,
    blocked: dict[str, str] | None,
    *,
    generation: int,
    now: str,
) -> dict[str, Any]:
    """Record what blocks the engine pods (desired/pods.blocked: reason and message, or None when
    nothing does) as status.blockedBy, and fold it into the conditions through serving()."""
    status = _base(current)
    if blocked:
        status["blockedBy"] = dict(blocked)
    else:
        status.pop("blockedBy", None)
    return serving(status, deployment, generation=generation, now=now)


def engine_metrics(current: dict[str, Any] | None, figures: dict[str, float]) -> dict[str, Any]:
    """Record the engines' own figures (meanAcceptLength, tokensPerSecond, with the prefix
    cache on prefixCacheHitRate; with adaptive speculation speculativeShape and acceptanceRates)
    under serving."""
    status = _base(current)
    serving_status = dict(status.get("serving") or {})
    for key in ("meanAcceptLength", "tokensPerSecond", "speculativeShape", "acceptanceRates", "prefixCacheHitRate",
                "crossoverBatchSize", "saturation"):
        if key in figures:
            serving_status[key] = figures[key]
    status["serving"] = serving_status
    return status


def serving_roles(
    current: dict[str, Any] | None,
    deployments: dict[str, dict[str, Any] | None],
    *,
    generation: int,
    now: str,
    role_plans: dict[str, dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """serving() for a disaggregated resource: `deployments` is role -> its Deployment (None if
    absent) for prefill, decode and router. status.disaggregation has each role's counts (and,
    given `role_plans`, its plan's headline figures); status.serving sums them. Ready only when
    every role is ready; Degraded when any role is."""
    status = _base(current)
    roles = dict(status.get("disaggregation") or {})
    rollouts = {}
    for role, deployment in deployments.items():
        entry = dict(roles.get(role) or {})
        if deployment is None:
            entry.update(replicas=0, readyReplicas=0, updatedReplicas=0)
            entry.pop("deployment", None)
        else:
            r = rollout(deployment)
            rollouts[role] = r
            entry.update(deployment=deployment["metadata"]["name"], replicas=r["replicas"],
                         readyReplicas=r["readyReplicas"], updatedReplicas=r["updatedReplicas"],
                         wantedReplicas=r["wanted"])
        plan = (role_plans or {}).get(role)
        if plan is not None:
            entry.update(maxTotalTokens=plan["max_total_tokens"],
                         gpusPerReplica=0 if plan.get("gpu") == "cpu" else plan["tensor_parallel_size"])
        roles[role] = entry
    status["disaggregation"] = roles
    kept = {k: v for k, v in (status.get("serving") or {}).items()
            if k in ("meanAcceptLength", "tokensPerSecond", "speculativeShape", "acceptanceRates")}
    decode = rollouts.get("decode")
    status["serving"] = {
        **kept,
        # decode's entry names its Deployment whenever it has a rollout.
        **({"deployment": roles["decode"]["deployment"], "selector": decode["selector"]} if decode else {}),
        "replicas": sum(r["replicas"] for r in rollouts.values()),
        "readyReplicas": sum(r["readyReplicas"] for r in rollouts.values()),
        "updatedReplicas": sum(r["updatedReplicas"] for r in rollouts.values()),
    }
    plan_condition = get_condition(status, PLAN_READY)
    planned = (plan_condition is not None and plan_condition["status"] == "True"
               and status.get("observedGeneration") == generation)
    if not planned or status.get("phase") == PHASE_PAUSED:
        return status

    def condition(type_: str, value: bool, reason: str, message: str) -> None:
        set_condition(status, type_, value, reason, message, generation=generation, now=now)

    missing = [role for role, d in deployments.items() if d is None]
    if missing:
        message = f"waiting for the {', '.join(missing)} Deployment(s)"
        condition(READY, False, api.REASON_DEPLOYMENT_MISSING, message)
        condition(PROGRESSING, True, api.REASON_DEPLOYMENT_MISSING, message)
        status["phase"] = PHASE_DEPLOYING
        return status
    stale = [role for role, r in rollouts.items() if r["configHash"] != status.get("configHash")]
    if stale:
        message = f"the {', '.join(stale)} Deployment(s) do not carry the current spec yet"
        condition(READY, False, api.REASON_ROLLOUT_PENDING, message)
        condition(PROGRESSING, True, api.REASON_ROLLOUT_PENDING, message)
        status["phase"] = PHASE_DEPLOYING
        return status
    counts = ", ".join(f"{role} {r['readyReplicas']}/{r['wanted']} ready" for role, r in rollouts.items())
    ready = all(r["complete"] and r["readyReplicas"] >= r["wanted"] for r in rollouts.values())
    stalled = [role for role, r in rollouts.items() if r["deadlineExceeded"]]
    failure = next((f"{role}: {r['replicaFailure']}" for role, r in rollouts.items() if r["replicaFailure"]), None)
    was_ready = (get_condition(status, READY) or {}).get("status") == "True"
    if ready:
        condition(READY, True, api.REASON_ALL_REPLICAS_READY, counts)
        condition(PROGRESSING, False, api.REASON_ROLLOUT_COMPLETE, counts)
    elif stalled:
        condition(READY, False, api.REASON_REPLICAS_NOT_READY, counts)
        condition(PROGRESSING, False, api.REASON_PROGRESS_DEADLINE_EXCEEDED, counts)
    else:
        condition(READY, False, api.REASON_REPLICAS_NOT_READY, counts)
        condition(PROGRESSING, True, api.REASON_ROLLING_OUT, counts)
    if stalled:
        condition(DEGRADED, True, api.REASON_PROGRESS_DEADLINE_EXCEEDED, f"rollout stalled ({', '.join(stalled)}): {counts}")
    elif failure:
        condition(DEGRADED, True, api.REASON_REPLICA_FAILURE, failure)
    elif was_ready and not ready:
        condition(DEGRADED, True, api.REASON_REPLICAS_UNAVAILABLE, counts)
    else:
        condition(DEGRADED, False, api.REASON_AS_EXPECTED, counts)
    status["phase"] = PHASE_READY if ready else PHASE_DEPLOYING
    return status
