"""Spec + resolved config.json files (+ checkpoint weight bytes read from the hub) -> shapes ->
the memory plan (pure; the same `plan()` that `specdeploy plan` and the engine call)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from specdeploy.engine.planner import plan as planner
from specdeploy.engine.planner.errors import PLANNER_FAILED, ConfigError, UncomputedDtypeError
from specdeploy.engine.planner.weights import CheckpointWeights
from specdeploy.operator import api
from specdeploy.operator.api import REASON_CONFIG_INVALID
from specdeploy.operator.desired.render import PlannedEngine, engine_settings


class PlanningError(Exception):
    """The spec cannot be planned; `reason` is the PlanReady condition reason. Always permanent:
    the same spec and configs give the same answer."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


def gpu_for_spec(gpu_spec: dict[str, Any]) -> planner.GPU:
    product = gpu_spec["product"]
    if product not in planner.GPUS:
        raise PlanningError(
            api.REASON_UNKNOWN_GPU,
            f"spec.gpu.product: {product!r} is not in the catalog ({', '.join(sorted(planner.GPUS))})",
        )
    gpu = planner.GPUS[product]
    if gpu_spec.get("memoryGiB"):
        # Same product label (scheduling), less or more memory (planning).
        return planner.GPU(gpu.name, int(gpu_spec["memoryGiB"] * planner.GIB), gpu.product_label)
    return gpu


def cpu_device(cpu_spec: dict[str, Any]) -> planner.GPU:
    """CPU mode: the memory budget of spec.cpu as the one device the plan sizes (no product label,
    nothing to schedule on)."""
    return dataclasses.replace(planner.custom_gpu(cpu_spec["memoryGiB"]), name="cpu")


@dataclass(frozen=True)
class ModelWeights:
    """Each model's checkpoint bytes as read from its safetensors headers (None: not read, the
    plan estimates them)."""

    target: CheckpointWeights | None = None
    draft: CheckpointWeights | None = None


def plan_engine(
    spec: dict[str, Any],
    target_config: dict[str, Any],
    draft_config: dict[str, Any] | None,
    weights: ModelWeights | None = None,
) -> PlannedEngine:
    """The plan for one spec, or PlanningError. Anything else the planner raises is a config.json
    it did not foresee: refused as ConfigInvalid, never a retry that can only fail again (the
    resource would sit in phase Planning forever)."""
    try:
        w = weights or ModelWeights()
        if not spec.get("disaggregation"):
            return _plan_engine(spec, target_config, draft_config, w)
        try:
            # A pair that cannot speculate together is the deployment's refusal, not a role's.
            planner.check_pair(engine_settings(spec)["algorithm"], target_config, draft_config)
        except planner.PlanError as err:
            raise PlanningError(err.reason, str(err)) from err
        # Each engine role planned on its own (planner.plan's role); status.plan is decode's,
        # the role that serves tokens.
        plans = {role: _plan_engine(spec, target_config, draft_config, w, role) for role in api.ENGINE_ROLES}
        return dataclasses.replace(plans["decode"], role_plans={r: p.plan for r, p in plans.items()})
    except PlanningError:
        raise
    except Exception as err:
        raise PlanningError(
            REASON_CONFIG_INVALID,
            f"{PLANNER_FAILED}: {type(err).__name__}: {err}",
        ) from err


def _plan_engine(
    spec: dict[str, Any],
    target_config: dict[str, Any],
    draft_config: dict[str, Any] | None,
    weights: ModelWeights,
    role: str = "both",
) -> PlannedEngine:
    settings = engine_settings(spec)
    cpu_spec = spec.get("cpu")
    if cpu_spec:
        # One device per pod: tensor parallel over spec.cpu.nodes pods, exactly (one each).
        nodes = cpu_spec.get("nodes", 1)
        gpu, per_node, max_nodes, requested_tp = cpu_device(cpu_spec), 1, nodes, nodes
    else:
        gpu_spec = spec["gpu"]
        gpu, per_node = gpu_for_spec(gpu_spec), gpu_spec.get("perNode", 8)
        max_nodes, requested_tp = gpu_spec.get("maxNodes", 1), None
    try:
        speculative = planner.SpecSettings(
            algorithm=settings["algorithm"],
            num_steps=settings.get("num_steps", 0),
            topk=settings.get("topk", 0),
            num_draft_tokens=settings.get("num_draft_tokens", 0),
            draft_quantization=settings.get("draft_quantization", "none"),
        )
        limits = planner.Limits(
            max_running_requests=settings["max_running_requests"],
            context_length=settings["context_length"],
            cuda_graph_max_bs=settings["cuda_graph_max_batch_size"],
        )
        plan = planner.plan_from_configs(
            target_config, draft_config, speculative, gpu, limits, gpus_per_node=per_node,
            target_weight_bytes=weights.target.total_bytes if weights.target else None,
            target_weight_source=weights.target.source if weights.target else None,
            draft_weight_bytes=weights.draft.total_bytes if weights.draft else None,
            draft_weight_source=weights.draft.source if weights.draft else None,
            role=role, max_nodes=max_nodes, tensor_parallel_size=requested_tp,
            dtype=settings.get("dtype"), kv_cache_dtype=settings.get("kv_cache_dtype", "auto"),
            # The engine is started with the planned dtype (render.engine_args); one it cannot
            # compute in would be sized here and then crash at start-up.
            require_compute_dtype=True,
        )
    except planner.PlanError as err:
        where = "" if role == "both" else f"{role} role: "
        raise PlanningError(err.reason, where + str(err)) from err
    except ConfigError as err:
        hint = "; set spec.engine.dtype" if isinstance(err, UncomputedDtypeError) else ""
        raise PlanningError(REASON_CONFIG_INVALID, _config_field(err, draft_config) + str(err) + hint) from err
    return PlannedEngine(
        plan=plan.to_dict(),
        tensor_parallel_size=plan.tensor_parallel_size,
        nodes=plan.nodes,
        gpu_product_label=gpu.product_label,
        cpu=bool(cpu_spec),
        target_config=target_config,
        draft_config=draft_config,
    )


def _config_field(err: ConfigError, draft_config: dict[str, Any] | None) -> str:
    """The spec field whose config.json a ConfigError is about, as a message prefix."""
    if err.model == "target":
        return "spec.target config.json: "
    if err.model == "draft":
        return ("spec.draft" if draft_config is not None else "spec.target (MTP layers)") + " config.json: "
    return ""


def plan_summary(planned: PlannedEngine) -> str:
    """One line for events and logs."""
    p = planned.plan
    if planned.role_plans:
        return "; ".join(
            f"{role}: TP {rp['tensor_parallel_size']} x {rp['gpu']}, max_total_tokens {rp['max_total_tokens']}"
            for role, rp in planned.role_plans.items()
        ) + f"; spec_hidden_size {p['spec_hidden_size']}, metadata row {p['buffers']['metadata_hidden_states_shape']}"
    nodes = p.get("nodes", 1)
    return (
        f"TP {p['tensor_parallel_size']} x {p['gpu']}" + (f" on {nodes} nodes" if nodes > 1 else "")
        + f", max_total_tokens {p['max_total_tokens']}"
        f" (needs {p['required_tokens']}), spec_hidden_size {p['spec_hidden_size']},"
        f" draft_input_hidden_size {p['draft_input_hidden_size']}"
    )
