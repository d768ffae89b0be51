"""The memory plan: how a target + draft deployment fits on a node's GPUs.

One pure function, `plan()`, called by the operator (to size the Deployment and fill
`status.plan`), by the engine (to size its KV pools and static buffers, and to log what it expects)
and by `specdeploy plan`. Every term of the arithmetic is kept in the returned `Plan`, so each
number can be explained. Per GPU, at tensor-parallel size TP:

    weights            = what one rank holds of target + draft: the split layers / TP (KV heads
                         replicated when fewer than TP, vocabularies padded to a multiple of TP),
                         the rest (norms, row-parallel biases, mixers, d2t) whole on every rank
                         (shapes.tensor_parallel_params; MoE / MLA / quantized: weights / TP);
                         the weights each from the checkpoint's safetensors headers or index when
                         read, else as quantization_config implies, else parameters x dtype
                         (ModelTerms.weight_source says which)
    kv_per_token       = target KV bytes/token/GPU + draft KV bytes/token/GPU
                         (the draft pool has as many token slots as the target's; GQA heads are
                         split by TP, replicated when fewer than TP; MLA latents and DeepSeek-V4's
                         shared head are replicated)
    per_request_state  = max_running_requests * (fixed per-request KV: DeepSeek-V4's committed
                         recent-token rows) + in-flight rows * their bytes (V4: every slot a step
                         holds has a row in every pool; in-flight rows = max(prefill chunk,
                         max_running_requests * slots per request per step))
    static_buffers     = CUDA-graph hidden-state buffers + disaggregation metadata buffer
    budget             = gpu_memory - weights - cuda_graph_pool - activation_workspace
                         - static_buffers - per_request_state - reserve
    max_total_tokens   = floor(budget / kv_per_token)

TP is the smallest of 1, 2, 4, 8 (at most gpus_per_node, dividing the heads it must split) for
which max_total_tokens >= context_length * max_running_requests; none fitting is a PlanError.
A requested tensor_parallel_size is the only one tried.

Nodes (max_nodes > 1): when no size within one node fits, the group spans nodes with tensor
parallelism across all of their GPUs, TP = nodes x gpus_per_node, trying 2, 3, ... max_nodes
nodes (a size that does not divide the heads, or the experts, is refused and the next tried).
The per-GPU terms are the same formula at that TP: every rank holds 1/TP of the split layers
whichever node it is on. Why tensor rather than pipeline parallelism across nodes, and the
interconnect that assumes: docs/engine.md, Multi-node.

Static buffers (H_s = target spec_hidden_size, H_in = draft input width, bs = cuda_graph_max_bs):
    draft CUDA-graph hidden_states   [bs * topk, H_s]
    draft-extend hidden_states       [bs * (steps + 1), H_in]
    verify captured hidden_states    [bs * num_draft_tokens, H_in]
    disaggregation metadata          [max_running_requests, H_s] + fixed fields per request
Using hidden_size for any of them would be wrong by hc_mult for DeepSeek-V4 (H_s = 4 * H).

Roles (prefill/decode disaggregation, docs/disaggregation.md): "both" is the formula above. A
"prefill" server never decodes: no CUDA graphs, so no graph pool and no graph hidden-state
buffers (the metadata buffer stays), and that memory goes to its KV pool. A "decode" server
never prefills a prompt (its prompts' KV arrives from a prefill server): its activation
workspace is one MIN_PREFILL_CHUNK_TOKENS chunk (start-up warm-up) instead of
PREFILL_CHUNK_TOKENS, and that memory goes to its KV pool.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from specdeploy.engine.planner.deepseek_v4 import (
    V4ForwardDims,
    is_deepseek_v4,
    v4_forward_peak_bytes,
    v4_in_flight_rows,
    v4_staged_bytes,
)
from specdeploy.engine.planner.compat import DRAFT_INCOMPATIBLE, pair_incompatibility
from specdeploy.engine.planner.options import DEFAULTS
from specdeploy.engine.planner.errors import UncomputedDtypeError
from specdeploy.engine.planner.shapes import (
    ALGORITHMS,
    COMPUTE_DTYPES,
    DRAFT_QUANTIZATIONS,
    ConfigError,
    ModelShapes,
    derive_draft_shapes,
    derive_shapes,
    draft_input_hidden_size,
    draft_linears,
    draft_quantization_refusal,
    fp8_block_bytes,
    kv_cache_bytes_per_token_per_gpu,
    kv_heads_per_gpu,
    tensor_parallel_params,
)

__all__ = [
    "GPU",
    "GPUS",
    "BufferPlan",
    "ConfigError",
    "Limits",
    "MemoryTerms",
    "ModelTerms",
    "Plan",
    "PlanError",
    "SpecSettings",
    "SpecShape",
    "cuda_graph_batch_sizes",
    "gemv_width_bytes",
    "group_sizes",
    "gemv_workspace_bytes",
    "plan",
    "plan_from_configs",
]

MIB = 1024**2
GIB = 1024**3

TENSOR_PARALLEL_SIZES = (1, 2, 4, 8)

# The most nodes one tensor-parallel group may span (a LeaderWorkerSet group's size).
MAX_NODES = 64

# Bytes that are on the GPU but not in any tensor the plan sizes: the CUDA context and its module
# images, cuBLAS/cuDNN workspaces, NCCL communicator buffers, the index buffers of the graphs
# (input ids, positions, cache locations: int64 per token), allocator fragmentation, and memory
# nvidia-smi counts in the total that the driver never lets a process allocate (615 MiB of an
# H200's 143771 MiB, measured: docs/benchmarks.md, planner truth).
RESERVE_BYTES = 2 * GIB

# Tokens one prefill chunk carries through the model at once (chunked prefill): the activation
# workspace is sized for it.
PREFILL_CHUNK_TOKENS = 8192

# Hidden-width tensors alive at once inside a layer during a forward pass, measured at the MLP's
# peak of a prefill chunk (docs/benchmarks.md, planner truth): the residual stream and the delta
# it has not absorbed yet (LIVE_RESIDUAL_WIDTHS of them), the normed input, the attention output
# and its projection, the fused q/k/v projection (about 1.5 widths).
LIVE_HIDDEN_WIDTHS = 7
LIVE_RESIDUAL_WIDTHS = 2

# MLP-intermediate-width tensors alive at the MLP's peak: the fused gate/up output (two) and the
# activated product.
LIVE_MLP_WIDTHS = 3

# With hyper-connections (hc_mult > 1) the residual widths are the hc_mult streams (the sublayer
# input and the expanded output, hc * H each); the sublayer itself is H wide. The mixes matmul
# reads a float32 copy of the flattened streams (engine/models/hc.py; on CUDA the gates, Sinkhorn, the
# collapse and the expand are Triton kernels that keep nothing else stream-wide).
LIVE_HC_FLOAT32_STREAMS = 1

# Blocks the caching allocator holds reserved but cannot hand out at a prefill's peak (a
# freed block serves only requests no larger than itself): 28% (FP8 Llama-3.1-8B) and 34%
# (DeepSeek-V4-Flash, reduced depth) of the transient allocated when their prefills ran out of
# memory on the H200 (docs/benchmarks.md, planner truth). The workspace is the forward's peak
# times 1 + this.
PREFILL_ALLOCATOR_SLACK = 0.35

# Fixed private memory of the CUDA-graph pool beyond the activations of the largest captured
# batch: per-graph bookkeeping and the allocator's segment rounding across the batch-size buckets
# and graph kinds (0.20-0.29 GiB measured on Llama-3.1-8B plans with 5 to 11 buckets).
CUDA_GRAPH_POOL_BASE_BYTES = 320 * MIB

# Prefill chunks of one request captured as CUDA graphs (engine/runtime/extend_graphs.py): the
# token-count buckets. A prefix-cache hit's remainder (the question after a cached system prompt)
# fits one; longer chunks run eagerly. Their graphs have a private pool of their own, sized by the
# largest bucket's forward at the full context, plus this for the allocator's segment rounding
# across the buckets' target and draft graphs.
EXTEND_GRAPH_TOKENS = (16, 32, 64, 128, 256)
EXTEND_GRAPH_POOL_BASE_BYTES = 32 * MIB

# FP8 checkpoints the engine computes from with per-token-group (1 x 128) quantized activations.
FP8_QUANT_METHODS = ("fp8", "compressed-tensors", "fbgemm_fp8")
FP8_ACTIVATION_GROUP = 128
# An FP8 target's CUDA-graph pool holds more than the activations the formula counts once
# DeepGEMM serves its block linears inside the captured graphs: the FP8 EAGLE-3 plan of
# bench/fp8_bench.py measured 763363328 B against 689177600 planned (+74.2 MB) in every run from
# 40e26f9 on (DeepGEMM from 5 rows; H100 and H200), +36 MB at 71b629b (from 17 rows) and +5 MB at
# 3971378 (before DeepGEMM took the route): it grows with the captured shapes DeepGEMM serves.
# Reserved for every FP8 target: the planner does not know whether the serving image has
# DeepGEMM, and per-channel FP8 (another route) over-reserves it, the safe side.
FP8_LIBRARY_GRAPH_POOL_BYTES = 72 * MIB

# The small-M linear kernel (engine/kernels/gemv.py): decode and verify calls of at most
# GEMV_MAX_M rows, split-K over at most GEMV_MAX_SPLIT_K ranges finished in-kernel through a
# float32 workspace [GEMV_MAX_SPLIT_K, GEMV_MAX_M, N] and int32 counters [N / GEMV_MIN_BLOCK_N]
# kept per distinct output width N (outputs wider than GEMV_SPLIT_MAX_N never split).
GEMV_MAX_M = 16
GEMV_MAX_SPLIT_K = 8
GEMV_SPLIT_MAX_N = 65536
GEMV_MIN_BLOCK_N = 4

# Logits are computed in float32 for sampling and verification.
LOGITS_DTYPE_BYTES = 4

# Logits-sized float32 buffers alive at once inside a speculative-step graph that accepts by
# rejection sampling: the logits, the sorted values and their int64 order (two), the sorted
# probabilities and their running mass, plus the sort's own scratch (verify.warp_probs).
SAMPLING_LOGITS_COPIES = 8

# Fixed fields the prefill server sends the decode server per request next to the hidden state
# (disaggregation metadata, engine/runtime/transfer.py): (name, bytes per element, elements;
# "topk" would mean SpecSettings.topk). No top-k of the draft's first step: the decode server
# drafts from the carried hidden state itself.
METADATA_FIXED_FIELDS = (
    ("output_token_id", 8, 1),
    ("cached_tokens", 8, 1),
    ("output_token_logprob", 4, 1),
)

# Host staging of a split-role server's KV transfers (engine/runtime/transfer.py: StagingArena):
# a request's target and draft KV rows of every layer are packed into one contiguous region and
# moved with one batched write. Each server holds this many full-context requests' regions at once
# (more wait for a region); a region has one unused row per layer and pool (the pad slot, so that
# each half is addressed like a pool) and starts on an alignment boundary.
TRANSFER_STAGING_REQUESTS = 2
TRANSFER_STAGING_ALIGN_BYTES = 4096


def staging_aligned(nbytes: int) -> int:
    """A staging region's bytes rounded up to where the next region may start."""
    return -(-nbytes // TRANSFER_STAGING_ALIGN_BYTES) * TRANSFER_STAGING_ALIGN_BYTES


def transfer_staging_request_bytes(tokens: int, kv_bytes_per_token: int) -> int:
    """Bytes one staged request of `tokens` prompt tokens takes in the arena, aligned (pools
    with one row per token slot; DeepSeek-V4's kept rows: deepseek_v4.v4_staged_bytes)."""
    return staging_aligned((tokens + 1) * kv_bytes_per_token)


def transfer_staging_bytes(target: ModelShapes, draft: ModelShapes | None, tokens: int,
                           kv_bytes_per_token: int, tensor_parallel_size: int = 1) -> int:
    """A split-role server's staging arena: TRANSFER_STAGING_REQUESTS requests of `tokens`, each
    every rank's share, rank after rank (kv_bytes_per_token: one GPU's, KV heads it holds as a
    copy included; a DeepSeek-V4 rank holds all of its pools, so a region holds them once per
    rank)."""
    if target.v4 is not None:
        raw = v4_staged_bytes(target.v4, "target", target.dtype_bytes, tokens)
        if draft is not None and draft.v4 is not None:
            raw += v4_staged_bytes(draft.v4, "MTP", draft.dtype_bytes, tokens)
        one = staging_aligned(raw * tensor_parallel_size)
    else:
        one = transfer_staging_request_bytes(tokens, kv_bytes_per_token * tensor_parallel_size)
    return TRANSFER_STAGING_REQUESTS * one

# cuda_graph_batch_sizes: every power of two up to this, then multiples of the step.
CUDA_GRAPH_SMALL_BATCH_LIMIT = 8
CUDA_GRAPH_BATCH_STEP = 8


class PlanError(ValueError):
    """A deployment the plan refuses; `reason` is a CamelCase condition reason for status."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


def check_pair(algorithm: str, target_config: dict[str, Any], draft_config: dict[str, Any] | None) -> None:
    """Refuses a draft that cannot speculate for this target (PlanError DraftIncompatible; a
    DeepSeek-V4 target with another algorithm than its MTP is check_servable's refusal)."""
    if isinstance(target_config, dict):
        text = target_config.get("text_config")
        check_servable(is_deepseek_v4(text if isinstance(text, dict) else target_config), algorithm)
    problem = pair_incompatibility(algorithm, target_config, draft_config)
    if problem:
        raise PlanError(DRAFT_INCOMPATIBLE, problem)


def check_servable(deepseek_v4: bool, algorithm: str) -> None:
    """Refuses (PlanError) what the engine cannot serve, before any memory is planned: the
    operator must never plan a deployment whose pods would only exit. The engine checks a plan it
    is handed with the same function."""
    if deepseek_v4 and algorithm not in ("NONE", "MTP"):
        raise PlanError("InvalidSpeculativeSettings",
                        f"a DeepSeek-V4 target drafts with its own MTP layer, not {algorithm}")


@dataclass(frozen=True)
class GPU:
    name: str
    memory_bytes: int  # what nvidia-smi reports as total memory
    product_label: str  # value of the node label nvidia.com/gpu.product


GPUS = {
    "h100": GPU("h100", 81559 * MIB, "NVIDIA-H100-80GB-HBM3"),
    "h200": GPU("h200", 143771 * MIB, "NVIDIA-H200"),
    "a100-80g": GPU("a100-80g", 81920 * MIB, "NVIDIA-A100-SXM4-80GB"),
    "l40s": GPU("l40s", 46068 * MIB, "NVIDIA-L40S"),
}


def custom_gpu(memory_gib: float) -> GPU:
    """A GPU known only by its memory (GiB), for hardware outside the catalog."""
    if not memory_gib > 0:
        raise PlanError("InvalidGPU", f"gpu memory must be positive, got {memory_gib} GiB")
    return GPU("custom", int(memory_gib * GIB), "")


# The smallest prefill chunk worth serving with: below it, prompts crawl in through many steps.
MIN_PREFILL_CHUNK_TOKENS = 256

# What one engine server does: everything, or one side of prefill/decode disaggregation.
SERVER_ROLES = ("both", "prefill", "decode")


def role_prefill_chunk_tokens(role: str) -> int:
    """Tokens one prefill forward carries on a server of this role (the workspace the plan
    sizes): a decode server only prefills its start-up warm-up."""
    return MIN_PREFILL_CHUNK_TOKENS if role == "decode" else PREFILL_CHUNK_TOKENS

# Kept free beyond the workspace when fitting the prefill chunk to measured memory (fragmentation).
PREFILL_FIT_MARGIN_BYTES = 256 * MIB


def prefill_chunk_that_fits(available_bytes: int, workspace_bytes: int,
                            chunk_tokens: int = PREFILL_CHUNK_TOKENS) -> int:
    """The prefill chunk (tokens) whose activations fit in `available_bytes`, measured once the
    engine holds its weights, KV pools and CUDA graphs. `workspace_bytes` is the plan's workspace
    for `chunk_tokens`; activations scale with the chunk, so when another term took more than
    planned the chunk shrinks in proportion instead of a later prefill running out of memory.
    chunk_tokens when the plan's workspace fits; 0 when not even MIN_PREFILL_CHUNK_TOKENS does."""
    room = available_bytes - PREFILL_FIT_MARGIN_BYTES
    if workspace_bytes <= 0 or room >= workspace_bytes:
        return chunk_tokens
    fit = max(room, 0) * chunk_tokens // workspace_bytes
    return fit if fit >= MIN_PREFILL_CHUNK_TOKENS else 0


def max_draft_tokens(num_steps: int, topk: int) -> int:
    """The most tokens one verify step can check: the root plus every draft candidate. The first
    draft step proposes topk children of the root; each later step expands its topk best nodes
    by topk children each, so the pool is topk + (num_steps - 1) * topk^2 (topk 1: a chain of
    num_steps). The CRD's CEL rule on numDraftTokens states the same bound."""
    return topk + (num_steps - 1) * topk * topk + 1


@dataclass(frozen=True, order=True)
class SpecShape:
    """A speculative shape: draft `num_steps` deep, `topk` branches per step, verifying
    `num_draft_tokens` tokens per request (topk 1: a chain, so num_steps + 1); num_steps 0 is
    NONE, a plain decode step. The plan's settings, the runner's configured shape and every
    shape adaptive speculation may choose are this type, checked by its one `validate()`."""
    num_steps: int
    topk: int = 1
    num_draft_tokens: int = 1

    def validate(self) -> None:
        """PlanError unless this is a shape a draft can run: num_steps and topk >= 1, a chain's
        num_draft_tokens num_steps + 1, a tree's within [2, max_draft_tokens]. The CRD's CEL
        rules on spec.speculative state the same bounds (tests/engine/planner/test_spec_shape.py).
        NONE is not one: a caller that allows it tests `is_none` first."""
        if self.num_steps < 1 or self.topk < 1:
            raise PlanError("InvalidSpeculativeSettings", f"num_steps and topk must be >= 1, got {self.num_steps} and {self.topk}")
        if self.topk == 1 and self.num_draft_tokens != self.num_steps + 1:
            raise PlanError(
                "InvalidSpeculativeSettings",
                f"num_draft_tokens must be num_steps + 1 = {self.num_steps + 1} when topk is 1, got {self.num_draft_tokens}",
            )
        most = max_draft_tokens(self.num_steps, self.topk)
        if not 2 <= self.num_draft_tokens <= most:
            raise PlanError(
                "InvalidSpeculativeSettings",
                f"num_draft_tokens must be in [2, topk + (num_steps - 1) * topk^2 + 1 = {most}], "
                f"got {self.num_draft_tokens}",
            )

    @property
    def is_none(self) -> bool:
        return self.num_steps == 0

    @property
    def is_chain(self) -> bool:
        return self.topk == 1 and not self.is_none

    @property
    def label(self) -> str:
        """'none' or 'S,K,N' (a Prometheus label value, and what logs and status show)."""
        return "none" if self.is_none else f"{self.num_steps},{self.topk},{self.num_draft_tokens}"

    @classmethod
    def parse(cls, text: str) -> SpecShape:
        """'none' | 'S,K,N' | 'S' (a chain of S steps) -> SpecShape."""
        text = text.strip().lower()
        if text in ("none", "0"):
            return NONE
        parts = [int(p) for p in text.split(",")]
        if len(parts) == 1:
            return cls(parts[0], 1, parts[0] + 1)
        if len(parts) != 3:
            raise ValueError(f"speculative shape {text!r}: use 'none', 'S' or 'S,K,N'")
        return cls(*parts)


NONE = SpecShape(0, 1, 1)


@dataclass(frozen=True)
class SpecSettings:
    """Speculative decoding settings: the algorithm and the shape it runs (SpecShape's fields)."""

    algorithm: str = "EAGLE3"
    num_steps: int = DEFAULTS.num_steps
    topk: int = DEFAULTS.topk
    num_draft_tokens: int = DEFAULTS.num_steps + 1
    # how the engine quantizes the draft head's weights as it loads them (DRAFT_QUANTIZATIONS)
    draft_quantization: str = DEFAULTS.draft_quantization

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """PlanError for an unknown algorithm, or (unless NONE) a shape SpecShape.validate refuses,
        or a draft quantization the algorithm has no head for."""
        if self.algorithm not in ALGORITHMS:
            raise PlanError("InvalidSpeculativeSettings", f"algorithm: unknown {self.algorithm!r}; expected one of {', '.join(ALGORITHMS)}")
        if self.algorithm != "NONE":
            SpecShape(self.num_steps, self.topk, self.num_draft_tokens).validate()
        if self.draft_quantization not in DRAFT_QUANTIZATIONS:
            raise PlanError("InvalidSpeculativeSettings", f"draft_quantization: unknown {self.draft_quantization!r}; "
                            f"expected one of {', '.join(DRAFT_QUANTIZATIONS)}")
        if self.draft_quantization != "none" and self.algorithm not in ("EAGLE", "EAGLE3"):
            why = ("it has no draft" if self.algorithm == "NONE" else
                   "its layers are part of the target checkpoint and load as it stores them")
            raise PlanError("InvalidSpeculativeSettings", f"draft_quantization {self.draft_quantization}: applies to "
                            f"EAGLE and EAGLE3 heads, not algorithm {self.algorithm} ({why})")

    @property
    def shape(self) -> SpecShape:
        """The shape a draft runs; NONE for algorithm NONE."""
        if self.algorithm == "NONE":
            return NONE
        return SpecShape(self.num_steps, self.topk, self.num_draft_tokens)

    @property
    def tokens_per_request_step(self) -> int:
        """Token rows per request in the widest graph: verify (draft tokens), or one for NONE."""
        return 1 if self.algorithm == "NONE" else self.num_draft_tokens


@dataclass(frozen=True)
class Limits:
    max_running_requests: int = DEFAULTS.max_running_requests
    context_length: int = DEFAULTS.context_length
    cuda_graph_max_bs: int = DEFAULTS.max_running_requests

    def __post_init__(self) -> None:
        for name in ("max_running_requests", "context_length", "cuda_graph_max_bs"):
            if getattr(self, name) < 1:
                raise PlanError("InvalidLimits", f"{name} must be >= 1, got {getattr(self, name)}")


@dataclass(frozen=True)
class ModelTerms:
    """One model's share of the plan."""

    model_type: str
    architecture: str
    role: str
    dtype: str
    hidden_size: int
    hc_mult: int
    spec_hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    attention: str
    num_params: int
    weight_bytes: int
    # where weight_bytes came from: "headers" (every safetensors header of the checkpoint), "index"
    # (model.safetensors.index.json's total_size), "quantization_config" (estimated from the
    # config's quantization), "shapes" (parameters x dtype), "target checkpoint" (MTP layers
    # counted in the target's bytes)
    weight_source: str
    weight_bytes_per_gpu: int
    kv_cache_bytes_per_token: int  # whole model
    kv_cache_bytes_per_token_per_gpu: int
    kv_cache_bytes_per_request_per_gpu: int
    kv_cache_bytes_per_in_flight_token_per_gpu: int
    kv_cache_dtype: str = "auto"  # "auto": K/V in `dtype`; "fp8_e4m3": e4m3 codes + per-layer scales
    # "fp8": the engine quantizes this draft's linears as it loads them (SpecSettings.draft_quantization);
    # weight_bytes and weight_bytes_per_gpu count them in FP8
    quantized_at_load: str = "none"


@dataclass(frozen=True)
class BufferPlan:
    """Static buffer shapes (rows, columns) the engine allocates once, and their bytes."""

    max_bs: int
    dtype_bytes: int
    draft_hidden_states_shape: tuple[int, int]
    draft_extend_hidden_states_shape: tuple[int, int]
    verify_hidden_states_shape: tuple[int, int]
    cuda_graph_hidden_states_bytes: int
    metadata_hidden_states_shape: tuple[int, int]
    metadata_hidden_states_bytes_per_request: int
    metadata_fixed_fields_bytes_per_request: int
    metadata_bytes: int
    # Split roles: the host staging arena of KV transfers (TRANSFER_STAGING_REQUESTS full-context
    # requests); host memory (pinned on a GPU), so not part of the GPU budget. 0 for "both".
    transfer_staging_bytes: int = 0

    @property
    def static_bytes(self) -> int:
        return self.cuda_graph_hidden_states_bytes + self.metadata_bytes


@dataclass(frozen=True)
class MemoryTerms:
    """Per-GPU memory, each term in bytes; budget is what is left for the KV pools."""

    gpu_memory_bytes: int
    weight_bytes: int
    cuda_graph_pool_bytes: int
    activation_workspace_bytes: int
    static_buffer_bytes: int
    per_request_state_bytes: int
    reserve_bytes: int
    kv_cache_budget_bytes: int
    kv_cache_bytes_per_token: int  # target + draft
    kv_cache_bytes: int  # max_total_tokens * kv_cache_bytes_per_token


@dataclass(frozen=True)
class Plan:
    algorithm: str
    num_steps: int
    topk: int
    num_draft_tokens: int
    gpu: str
    gpu_product_label: str
    gpus_per_node: int
    spec_hidden_size: int
    draft_input_hidden_size: int
    tensor_parallel_size: int
    max_total_tokens: int
    max_running_requests: int
    context_length: int
    required_tokens: int  # context_length * max_running_requests
    target: ModelTerms
    draft: ModelTerms | None
    buffers: BufferPlan
    memory_per_gpu: MemoryTerms
    cuda_graph_batch_sizes: tuple[int, ...]
    notes: tuple[str, ...]
    role: str = "both"  # "prefill" | "decode": one half of a disaggregated deployment
    # Nodes the tensor-parallel group spans: tensor_parallel_size / nodes ranks (GPUs) on each.
    nodes: int = 1

    @property
    def gpus_per_node_used(self) -> int:
        """Ranks (GPUs) of the group on each of its nodes."""
        return self.tensor_parallel_size // self.nodes

    def to_dict(self) -> dict[str, Any]:
        """The JSON of `specdeploy plan --json`, of the ConfigMap's plan.json and of status.plan."""
        return _jsonable(dataclasses.asdict(self))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Plan:
        """Inverse of to_dict; a missing or unknown key is a PlanError naming it."""
        try:
            fields = dict(data)
            fields["target"] = _build(ModelTerms, data["target"])
            fields["draft"] = None if data.get("draft") is None else _build(ModelTerms, data["draft"])
            buffers = dict(data["buffers"])
            for key in buffers:
                if key.endswith("_shape"):
                    buffers[key] = tuple(buffers[key])
            fields["buffers"] = _build(BufferPlan, buffers)
            fields["memory_per_gpu"] = _build(MemoryTerms, data["memory_per_gpu"])
            fields["cuda_graph_batch_sizes"] = tuple(data["cuda_graph_batch_sizes"])
            fields["notes"] = tuple(data["notes"])
            fields.setdefault("role", "both")  # plans written before roles existed
            return _build(cls, fields)
        except KeyError as missing:
            raise PlanError("InvalidPlan", f"plan: missing key {missing.args[0]!r}") from None
        except (TypeError, ValueError) as err:
            raise PlanError("InvalidPlan", f"plan: {err}") from None


def _build(cls: type, data: dict[str, Any]) -> Any:
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(data) - names
    if unknown:
        raise PlanError("InvalidPlan", f"plan: unknown key {sorted(unknown)[0]!r} in {cls.__name__}")
    defaults = {f.name for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING}
    # A field with a default may be absent: plans written before it existed still read.
    return cls(**{name: data[name] for name in names if name in data or name not in defaults})


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def cuda_graph_batch_sizes(max_bs: int) -> tuple[int, ...]:
    """Batch sizes to capture: 1, 2, 4, 8, then every multiple of 8, and max_bs itself."""
    sizes = [bs for bs in (1, 2, 4, 8) if bs <= min(max_bs, CUDA_GRAPH_SMALL_BATCH_LIMIT)]
    sizes += range(CUDA_GRAPH_SMALL_BATCH_LIMIT + CUDA_GRAPH_BATCH_STEP, max_bs + 1, CUDA_GRAPH_BATCH_STEP)
    if sizes[-1] != max_bs:
        sizes.append(max_bs)
    return tuple(sizes)


def buffer_plan(target: ModelShapes, spec: SpecSettings, limits: Limits, role: str = "both") -> BufferPlan:
    """Shapes of the static hidden-state buffers (the seed's list; see module docstring). A
    prefill server captures no graphs: its graph buffers have no rows."""
    bs = limits.cuda_graph_max_bs
    hs = target.spec_hidden_size
    b = target.dtype_bytes
    if spec.algorithm == "NONE":
        draft_shape = extend_shape = verify_shape = (0, hs)
        topk = 0
    else:
        hin = draft_input_hidden_size(spec.algorithm, target)
        rows = 0 if role == "prefill" else bs
        draft_shape = (rows * spec.topk, hs)
        extend_shape = (rows * (spec.num_steps + 1), hin)
        verify_shape = (rows * spec.num_draft_tokens, hin)
        topk = spec.topk
    graph_bytes = sum(rows * cols * b for rows, cols in (draft_shape, extend_shape, verify_shape))
    fixed = sum(size * (topk if count == "topk" else count) for _, size, count in METADATA_FIXED_FIELDS)
    hidden_per_request = hs * b
    return BufferPlan(
        max_bs=bs,
        dtype_bytes=b,
        draft_hidden_states_shape=draft_shape,
        draft_extend_hidden_states_shape=extend_shape,
        verify_hidden_states_shape=verify_shape,
        cuda_graph_hidden_states_bytes=graph_bytes,
        metadata_hidden_states_shape=(limits.max_running_requests, hs),
        metadata_hidden_states_bytes_per_request=hidden_per_request,
        metadata_fixed_fields_bytes_per_request=fixed,
        metadata_bytes=limits.max_running_requests * (hidden_per_request + fixed),
    )


def _mlp_width_per_token(shapes: ModelShapes) -> int:
    """Widest MLP intermediate one token produces: dense width, or its routed experts' combined."""
    routed = shapes.num_experts_per_tok * shapes.moe_intermediate_size + shapes.shared_expert_intermediate_size
    return max(shapes.intermediate_size, routed)


def _activation_bytes(shapes: ModelShapes, tokens: int, tp: int, prefix: int = 0, captured: bool = False) -> int:
    """Transient activations of `tokens` rows through one layer, on one GPU (layers run one at a
    time, so one layer's worth is live): hidden-width tensors plus the MLP's gate, up and product.
    DeepSeek-V4: its own phases (engine/planner/deepseek_v4.py v4_forward_peak_bytes), after
    `prefix` committed positions (its compressed entries grow with them); `captured`: a graph's."""
    if shapes.v4 is not None:
        return _v4_activation_bytes(shapes, tokens, tp, prefix, captured)
    # hc_mult = 1: spec_hidden_size is hidden_size, and the residual widths are plain hidden widths.
    per_token = ((LIVE_HIDDEN_WIDTHS - LIVE_RESIDUAL_WIDTHS) * shapes.hidden_size
                 + LIVE_RESIDUAL_WIDTHS * shapes.spec_hidden_size
                 + LIVE_MLP_WIDTHS * _mlp_width_per_token(shapes) // tp)
    hc_float32 = LIVE_HC_FLOAT32_STREAMS * shapes.spec_hidden_size * 4 if shapes.hc_mult > 1 else 0
    return tokens * (per_token * shapes.dtype_bytes + hc_float32 + _fp8_activation_copy(shapes, tp))


def _v4_activation_bytes(shapes: ModelShapes, tokens: int, tp: int, prefix: int, captured: bool) -> int:
    """The largest phase of a DeepSeek-V4 forward, plus the e4m3 copies its FP8 linears make of
    their widest input (the grouped output projection's, o_groups x o_lora_rank)."""
    v4 = shapes.v4
    assert v4 is not None, "a DeepSeek-V4 model's shapes carry its schedule"
    dims = V4ForwardDims(hc_mult=shapes.hc_mult, num_experts=shapes.num_routed_experts,
                         local_experts=max(1, shapes.num_routed_experts // tp),
                         experts_per_tok=shapes.num_experts_per_tok,
                         moe_intermediate_size=shapes.moe_intermediate_size,
                         shared_intermediate_size=shapes.shared_expert_intermediate_size,
                         expert_quant=shapes.expert_quant)
    peak = max(v4_forward_peak_bytes(v4, shapes.role, dims, tokens, prefix, shapes.dtype_bytes, captured).values())
    if _fp8_target(shapes):
        width = max(v4.o_groups * v4.o_lora_rank, shapes.hidden_size)
        peak += tokens * (width + 4 * -(-width // FP8_ACTIVATION_GROUP))
    return peak


def _fp8_target(shapes: ModelShapes) -> bool:
    """An FP8 checkpoint whose linears the engine computes in FP8 (its bytes known from the
    config's quantization)."""
    return shapes.quantization in FP8_QUANT_METHODS and bool(shapes.quantized_weight_bytes)


def _fp8_activation_copy(shapes: ModelShapes, tp: int) -> int:
    """Bytes per token of the e4m3 copy an FP8 checkpoint's prefill linears make of their input
    (engine/kernels/fp8.py act_quant), at the widest input, the MLP's down projection: one byte
    per element plus a float32 scale per 128."""
    if not _fp8_target(shapes):
        return 0
    width = _mlp_width_per_token(shapes) // tp
    return width + 4 * -(-width // FP8_ACTIVATION_GROUP)


def _linear_output_widths(shapes: ModelShapes, tp: int) -> set[int]:
    """Output widths N (one GPU's) of the model's linears that the small-M kernel may split-K."""
    heads = max(1, shapes.num_heads // tp)
    widths = {shapes.hidden_size, -(-shapes.vocab_size // tp), -(-shapes.draft_vocab_size // tp)}
    if shapes.intermediate_size:
        widths.add(2 * shapes.intermediate_size // tp)                    # fused gate/up
    if shapes.shared_expert_intermediate_size:
        widths.add(2 * shapes.shared_expert_intermediate_size // tp)
    if shapes.attention == "gqa":
        widths.add((heads + 2 * kv_heads_per_gpu(shapes.num_kv_heads, tp)) * shapes.head_dim)
    else:  # latent / compressed attention: the low-rank projections and their expansions
        widths |= {shapes.q_lora_rank, shapes.kv_lora_rank + shapes.qk_rope_head_dim,
                   heads * (shapes.qk_nope_head_dim + shapes.qk_rope_head_dim),
                   heads * (shapes.qk_nope_head_dim + shapes.v_head_dim), heads * shapes.head_dim}
    return {w for w in widths if 0 < w <= GEMV_SPLIT_MAX_N}


def gemv_workspace_bytes(models: list[ModelShapes], tp: int) -> int:
    """The small-M kernel's split-K workspaces and counters, kept for the process: one per
    distinct output width over the target's and the draft's linears (engine/kernels/gemv.py)."""
    widths = set().union(*(_linear_output_widths(m, tp) for m in models))
    return sum(gemv_width_bytes(n) for n in widths)


def gemv_width_bytes(n: int) -> int:
    """One output width's split-K workspace (float32) and counters (int32)."""
    return GEMV_MAX_SPLIT_K * GEMV_MAX_M * n * 4 + -(-n // GEMV_MIN_BLOCK_N) * 4


def _extend_graph_pool_bytes(target_shapes: ModelShapes, buffers: BufferPlan, tp: int, context_length: int,
                             with_draft: bool) -> int:
    """The graphs of one request's short prefill chunk (EXTEND_GRAPH_TOKENS): the largest
    bucket's target forward after a full context, its last entry's logits, and (with a draft) the
    features it hands the draft's extend graph (the draft's own forward is narrower and reuses the
    pool). Reserved whenever graphs are captured: the engine captures them unless turned off.
    None for DeepSeek-V4 (KV pools of its own: its chunks run eagerly)."""
    if target_shapes.v4 is not None:
        return 0
    tokens = EXTEND_GRAPH_TOKENS[-1]
    features = tokens * buffers.draft_extend_hidden_states_shape[1] * target_shapes.dtype_bytes if with_draft else 0
    return (EXTEND_GRAPH_POOL_BASE_BYTES + features + _logits_bytes(1, target_shapes.vocab_size, tp)
            + _activation_bytes(target_shapes, tokens, tp, prefix=context_length, captured=True))


def _logits_bytes(rows: int, vocab_size: int, tp: int) -> int:
    return rows * math.ceil(vocab_size / tp) * LOGITS_DTYPE_BYTES


def _tp_refusal(shapes: ModelShapes, tp: int) -> str | None:
    """Why `tp` cannot split this model's attention, or None."""
    if shapes.attention == "compressed":
        # V4 attention stays replicated on every rank; only the routed experts are split.
        if shapes.num_routed_experts % tp:
            return f"{shapes.role} n_routed_experts {shapes.num_routed_experts} is not divisible by {tp}"
        return None
    if shapes.num_heads % tp:
        return f"{shapes.role} num_attention_heads {shapes.num_heads} is not divisible by {tp}"
    if shapes.attention == "gqa" and shapes.num_kv_heads % tp and tp % shapes.num_kv_heads:
        return f"{shapes.role} num_key_value_heads {shapes.num_kv_heads} neither divides nor is divisible by {tp}"
    if shapes.intermediate_size % tp:
        return f"{shapes.role} intermediate_size {shapes.intermediate_size} is not divisible by {tp}"
    if shapes.hidden_size % tp:
        return f"{shapes.role} hidden_size {shapes.hidden_size} is not divisible by {tp}"
    return None


def _weights(shapes: ModelShapes, weight_bytes: int | None, source: str | None) -> tuple[int, str]:
    """(bytes, source) of one model's weights: the checkpoint's when read (its headers or index),
    else what quantization_config implies, else the parameter count at the config's dtype."""
    if weight_bytes is not None:
        if shapes.role == "MTP" and weight_bytes == 0:
            return 0, "target checkpoint"
        return weight_bytes, source or "headers"
    if shapes.quantized_weight_bytes:
        return shapes.quantized_weight_bytes, "quantization_config"
    return shapes.weight_bytes, "shapes"


def in_flight_tokens_per_request(spec: SpecSettings) -> int:
    """Token slots one request holds beyond its committed tokens during a step: the decode token
    (NONE), or the verify tree's nodes plus the draft's multi-step scratch."""
    if spec.algorithm == "NONE":
        return 1
    return spec.num_draft_tokens + (spec.num_steps - 1) * spec.topk


def _weight_bytes_per_gpu(shapes: ModelShapes, weights: int, weight_source: str, tp: int,
                          target_spec_hidden_size: int) -> int:
    """What one rank holds: the whole checkpoint less the split layers' other ranks' share. Bytes
    that do not follow the parameter counts (a quantized checkpoint, an estimate from
    quantization_config) and models the engine does not split by layer: weights / TP."""
    split = tensor_parallel_params(shapes, tp, target_spec_hidden_size)
    if weights == 0:  # MTP layers counted in the target checkpoint
        return 0
    if split is None or shapes.quantization or weight_source == "quantization_config":
        return math.ceil(weights / tp)
    whole, part = split
    return weights - (whole - part) * shapes.dtype_bytes


def _quantized_at_load(shapes: ModelShapes, weights: int, per_gpu: int, tp: int,
                       target_spec_hidden_size: int) -> tuple[int, int]:
    """(weights, weights per GPU) of a draft whose linears the engine quantizes to FP8 as it
    loads them: their stored bytes (the compute dtype's) replaced by their e4m3 codes and block
    scales (draft_linears, fp8_block_bytes). plan() refused the drafts it cannot quantize."""
    def saved(ranks: int) -> int:
        linears = draft_linears(shapes, ranks, target_spec_hidden_size) or []
        return sum(sum(parts) * k * shapes.dtype_bytes - fp8_block_bytes(kind, parts, k) for kind, parts, k in linears)

    return weights - saved(1), per_gpu - saved(tp)


def _model_terms(shapes: ModelShapes, weight_bytes: int | None, source: str | None, tp: int,
                 target_spec_hidden_size: int, quantize: str = "none") -> ModelTerms:
    weights, weight_source = _weights(shapes, weight_bytes, source)
    per_gpu = _weight_bytes_per_gpu(shapes, weights, weight_source, tp, target_spec_hidden_size)
    if quantize != "none":
        weights, per_gpu = _quantized_at_load(shapes, weights, per_gpu, tp, target_spec_hidden_size)
    return ModelTerms(
        model_type=shapes.model_type,
        architecture=shapes.architecture,
        role=shapes.role,
        dtype=shapes.dtype,
        hidden_size=shapes.hidden_size,
        hc_mult=shapes.hc_mult,
        spec_hidden_size=shapes.spec_hidden_size,
        num_layers=shapes.num_layers,
        num_heads=shapes.num_heads,
        num_kv_heads=shapes.num_kv_heads,
        head_dim=shapes.head_dim,
        attention=shapes.attention,
        num_params=shapes.num_params,
        weight_bytes=weights,
        weight_source=weight_source,
        weight_bytes_per_gpu=per_gpu,
        kv_cache_bytes_per_token=shapes.kv_cache_bytes_per_token,
        kv_cache_dtype=shapes.kv_cache_dtype,
        kv_cache_bytes_per_token_per_gpu=kv_cache_bytes_per_token_per_gpu(shapes, tp),
        # V4's recent rows (windows of its single shared K=V head, compressor state) are
        # replicated on every rank
        kv_cache_bytes_per_request_per_gpu=shapes.kv_cache_bytes_per_request,
        kv_cache_bytes_per_in_flight_token_per_gpu=shapes.kv_cache_bytes_per_in_flight_token,
        quantized_at_load=quantize,
    )


def _memory_terms(
    target: ModelTerms, draft: ModelTerms | None, target_shapes: ModelShapes, draft_shapes: ModelShapes | None,
    spec: SpecSettings, gpu: GPU, limits: Limits, buffers: BufferPlan, tp: int, role: str = "both",
) -> MemoryTerms:
    models = [target] + ([draft] if draft else [])
    weights = sum(m.weight_bytes_per_gpu for m in models)
    kv_per_token = sum(m.kv_cache_bytes_per_token_per_gpu for m in models)
    per_request = limits.max_running_requests * sum(m.kv_cache_bytes_per_request_per_gpu for m in models)
    in_flight = sum(m.kv_cache_bytes_per_in_flight_token_per_gpu for m in models)
    if in_flight:
        rows = v4_in_flight_rows(PREFILL_CHUNK_TOKENS, limits.max_running_requests, in_flight_tokens_per_request(spec))
        per_request += rows * in_flight
    # The graphs of every batch size and kind share one private pool, sized by the widest capture:
    # the target verifying max_bs * num_draft_tokens rows, with float32 logits for all of them,
    # which a speculative step that samples warps into probabilities inside the same graph.
    graph_rows = limits.cuda_graph_max_bs * spec.tokens_per_request_step
    logits_copies = SAMPLING_LOGITS_COPIES if draft_shapes is not None else 1
    graph_pool = 0 if role == "prefill" else (  # a prefill server captures no graphs
        CUDA_GRAPH_POOL_BASE_BYTES
        + _activation_bytes(target_shapes, graph_rows, tp, prefix=limits.context_length, captured=True)
        + logits_copies * _logits_bytes(graph_rows, target_shapes.vocab_size, tp)
        + _extend_graph_pool_bytes(target_shapes, buffers, tp, limits.context_length, draft_shapes is not None)
        + (FP8_LIBRARY_GRAPH_POOL_BYTES if _fp8_target(target_shapes) else 0)
    )
    # Eager prefill of one chunk through the target (the draft's extend over the same chunk is
    # narrower and runs after it); logits only for the last token of each request in the chunk.
    # The chunk may be a long prompt's last (its prefix the rest of the context).
    chunk = role_prefill_chunk_tokens(role)
    prefix = max(limits.context_length - chunk, 0)
    workspace = _activation_bytes(target_shapes, chunk, tp, prefix) + _logits_bytes(
        limits.max_running_requests, target_shapes.vocab_size, tp
    )
    if draft_shapes is not None:
        # The draft extend over the chunk holds the target's features for it (3 H wide for EAGLE-3)
        # and its own output (DeepSeek-V4's MTP: the streams, hc H).
        features = chunk * buffers.draft_extend_hidden_states_shape[1] * target_shapes.dtype_bytes
        workspace = max(workspace, _activation_bytes(draft_shapes, chunk, tp, prefix) + features)
    workspace = math.ceil(workspace * (1 + PREFILL_ALLOCATOR_SLACK))
    # The small-M linear kernel's split-K workspaces, made on the first (eager) decode call and kept.
    workspace += gemv_workspace_bytes([target_shapes] + ([draft_shapes] if draft_shapes is not None else []), tp)
    budget = (
        gpu.memory_bytes - weights - graph_pool - workspace - buffers.static_bytes - per_request - RESERVE_BYTES
    )
    tokens = max(0, budget // kv_per_token)
    return MemoryTerms(
        gpu_memory_bytes=gpu.memory_bytes,
        weight_bytes=weights,
        cuda_graph_pool_bytes=graph_pool,
        activation_workspace_bytes=workspace,
        static_buffer_bytes=buffers.static_bytes,
        per_request_state_bytes=per_request,
        reserve_bytes=RESERVE_BYTES,
        kv_cache_budget_bytes=budget,
        kv_cache_bytes_per_token=kv_per_token,
        kv_cache_bytes=tokens * kv_per_token,
    )


def _notes(
    target: ModelShapes, draft: ModelShapes | None, target_weight_bytes: int | None,
    draft_weight_bytes: int | None, limits: Limits, tp: int,
) -> tuple[str, ...]:
    notes = []
    for shapes in (target, draft):
        if shapes is not None and shapes.attention == "gqa" and shapes.num_kv_heads < tp:
            notes.append(
                f"{shapes.role} has {shapes.num_kv_heads} KV heads for TP {tp}: its k/v projections "
                "and KV heads are replicated, each rank holding the head its query heads read"
            )
    for shapes, weights in ((target, target_weight_bytes), (draft, draft_weight_bytes)):
        if shapes is None:
            continue
        if shapes.quantization and weights is None:
            if shapes.quantized_weight_bytes:
                notes.append(
                    f"{shapes.role} weights estimated from quantization_config ({shapes.quantization}); "
                    "the checkpoint's safetensors headers give the exact bytes"
                )
            else:
                notes.append(
                    f"{shapes.role} checkpoint is quantized ({shapes.quantization}); weights counted at "
                    f"{shapes.dtype}, give the model directory for its real size"
                )
    if draft is not None and draft.role == "MTP" and draft_weight_bytes == 0:
        notes.append("MTP layers' weights are in the target checkpoint and counted there")
    if target.has_vision_tower and target_weight_bytes is None:
        notes.append("vision tower weights are not counted from shapes; give the model directory for them")
    if target.max_position_embeddings and limits.context_length > target.max_position_embeddings:
        notes.append(
            f"context_length {limits.context_length} exceeds the target's max_position_embeddings "
            f"{target.max_position_embeddings}"
        )
    if target.attention == "compressed":
        notes.append("weights / TP is approximate: DeepSeek-V4 attention and shared experts are replicated")
    return tuple(notes)


def group_sizes(gpus_per_node: int, max_nodes: int,
                tensor_parallel_size: int | None = None) -> tuple[tuple[int, int], ...]:
    """(tensor-parallel size, nodes) in the order plan() tries them: 1, 2, 4, 8 within a node (at
    most gpus_per_node), then every GPU of 2, 3, ... max_nodes nodes. A requested size is the only
    one, on as many nodes as it needs, or a PlanError when it is none of these."""
    within = tuple((tp, 1) for tp in TENSOR_PARALLEL_SIZES if tp <= gpus_per_node)
    across = tuple((n * gpus_per_node, n) for n in range(2, max_nodes + 1))
    if tensor_parallel_size is None:
        return within + across
    for size, nodes in within + across:
        if size == tensor_parallel_size:
            return ((size, nodes),)
    if tensor_parallel_size <= gpus_per_node:
        raise PlanError("InvalidTensorParallelSize", f"tensor_parallel_size must be one of "
                        f"{', '.join(map(str, TENSOR_PARALLEL_SIZES))} within a node, got {tensor_parallel_size}")
    if tensor_parallel_size % gpus_per_node:
        raise PlanError("InvalidTensorParallelSize", f"tensor_parallel_size {tensor_parallel_size} spans nodes "
                        f"but is not a multiple of the {gpus_per_node} GPU(s) of a node")
    raise PlanError("InvalidTensorParallelSize", f"tensor_parallel_size {tensor_parallel_size} needs "
                    f"{tensor_parallel_size // gpus_per_node} nodes of {gpus_per_node} GPU(s); max_nodes is {max_nodes}")


def plan(
    target: ModelShapes,
    draft: ModelShapes | None,
    spec: SpecSettings,
    gpu: GPU,
    limits: Limits,
    *,
    target_weight_bytes: int | None = None,
    draft_weight_bytes: int | None = None,
    target_weight_source: str | None = None,
    draft_weight_source: str | None = None,
    gpus_per_node: int = 8,
    role: str = "both",
    tensor_parallel_size: int | None = None,
    max_nodes: int = 1,
) -> Plan:
    """Plan memory for `target` + `draft` on `gpu` (see the module docstring for the formula;
    `role` "prefill" or "decode" plans one half of a disaggregated deployment; `max_nodes`: the
    most nodes of `gpus_per_node` GPUs one tensor-parallel group may span).

    Weight bytes come from the checkpoints when given (`*_weight_source` says how they were read:
    "headers", the default, or "index"), else from quantization_config, else from the shapes.
    Raises PlanError: reason "DraftRequired" (EAGLE/EAGLE3/MTP without a draft),
    "InsufficientGPUMemory" (with the bytes needed and available per GPU at the largest TP tried,
    and the TP sizes refused because they do not divide the heads).
    """
    if spec.algorithm != "NONE" and draft is None:
        raise PlanError("DraftRequired", f"draft: algorithm {spec.algorithm} needs a draft model")
    if spec.algorithm == "NONE":
        draft = None
    if gpus_per_node < 1:
        raise PlanError("InvalidGPU", f"gpus_per_node must be >= 1, got {gpus_per_node}")
    if role not in SERVER_ROLES:
        raise PlanError("InvalidRole", f"role {role!r}: use one of {', '.join(SERVER_ROLES)}")
    check_servable(target.v4 is not None, spec.algorithm)
    if draft is not None and spec.draft_quantization != "none":
        unquantizable = (f"the draft checkpoint is already quantized ({draft.quantization}); it loads as it is stored"
                         if draft.quantization else draft_quantization_refusal(draft, 1, target.spec_hidden_size))
        if unquantizable:
            raise PlanError("InvalidSpeculativeSettings",
                            f"draft_quantization {spec.draft_quantization}: {unquantizable}")
    buffers = buffer_plan(target, spec, limits, role)
    required = limits.context_length * limits.max_running_requests
    if not 1 <= max_nodes <= MAX_NODES:
        raise PlanError("InvalidNodes", f"max_nodes must be in [1, {MAX_NODES}], got {max_nodes}")
    refusals: list[str] = []  # TP sizes that cannot split the heads, and why
    last: tuple[int, int, MemoryTerms] | None = None
    for tp, nodes in group_sizes(gpus_per_node, max_nodes, tensor_parallel_size):
        refusal = _tp_refusal(target, tp) or (draft and _tp_refusal(draft, tp)) or (
            draft and spec.draft_quantization != "none"
            and draft_quantization_refusal(draft, tp, target.spec_hidden_size))
        if refusal:
            refusals.append(f"TP {tp}: {refusal}")
            continue
        target_terms = _model_terms(target, target_weight_bytes, target_weight_source, tp, target.spec_hidden_size)
        draft_terms = (_model_terms(draft, draft_weight_bytes, draft_weight_source, tp, target.spec_hidden_size,
                                    spec.draft_quantization) if draft else None)
        memory = _memory_terms(target_terms, draft_terms, target, draft, spec, gpu, limits, buffers, tp, role)
        max_total_tokens = memory.kv_cache_bytes // memory.kv_cache_bytes_per_token
        last = (tp, nodes, memory)
        if max_total_tokens >= required:
            return Plan(
                algorithm=spec.algorithm,
                num_steps=spec.num_steps if draft else 0,
                topk=spec.topk if draft else 0,
                num_draft_tokens=spec.num_draft_tokens if draft else 0,
                gpu=gpu.name,
                gpu_product_label=gpu.product_label,
                gpus_per_node=gpus_per_node,
                spec_hidden_size=target.spec_hidden_size,
                draft_input_hidden_size=draft_input_hidden_size(spec.algorithm, target),
                tensor_parallel_size=tp,
                max_total_tokens=max_total_tokens,
                max_running_requests=limits.max_running_requests,
                context_length=limits.context_length,
                required_tokens=required,
                target=target_terms,
                draft=draft_terms,
                buffers=buffers if role == "both" else dataclasses.replace(
                    buffers, transfer_staging_bytes=transfer_staging_bytes(
                        target, draft, limits.context_length, memory.kv_cache_bytes_per_token, tp)),
                memory_per_gpu=memory,
                cuda_graph_batch_sizes=() if role == "prefill" else cuda_graph_batch_sizes(limits.cuda_graph_max_bs),
                notes=_notes(target, draft, target_weight_bytes, draft_weight_bytes, limits, tp),
                role=role,
                nodes=nodes,
            )
    if last is None:  # only a requested TP size that cannot split the model gets here
        raise PlanError("InvalidTensorParallelSize", "; ".join(refusals))
    tp, nodes, memory = last
    fixed = memory.gpu_memory_bytes - memory.kv_cache_budget_bytes
    needed = fixed + required * memory.kv_cache_bytes_per_token
    hint = ""
    if target.quantization and target_weight_bytes is None:
        hint = (
            f"; weights were estimated from quantization_config ({target.quantization}): the "
            "checkpoint's safetensors headers give the exact bytes"
            if target.quantized_weight_bytes else
            f"; weights were counted at {target.dtype} but the checkpoint is {target.quantization}: "
            "give the model directory to read its real size"
        )
    where = f"{tp} x {gpu.name}" if nodes == 1 else f"{nodes} nodes x {tp // nodes} {gpu.name} (TP {tp})"
    if nodes == max_nodes and tensor_parallel_size is None:
        hint += f"; tried up to max_nodes {max_nodes}"
    raise PlanError(
        "InsufficientGPUMemory",
        f"does not fit on {where}: at TP {tp} each GPU needs "
        f"{needed / GIB:.1f} GiB (weights {memory.weight_bytes / GIB:.1f} GiB + other fixed "
        f"{(fixed - memory.weight_bytes) / GIB:.1f} GiB + KV {required} tokens x "
        f"{memory.kv_cache_bytes_per_token} B) but has {memory.gpu_memory_bytes / GIB:.1f} GiB{hint}"
        + "".join(f"; {refusal}" for refusal in refusals),
    )


def plan_from_configs(
    target_config: dict[str, Any],
    draft_config: dict[str, Any] | None,
    spec: SpecSettings,
    gpu: GPU,
    limits: Limits,
    *,
    target_weight_bytes: int | None = None,
    draft_weight_bytes: int | None = None,
    target_weight_source: str | None = None,
    draft_weight_source: str | None = None,
    gpus_per_node: int = 8,
    role: str = "both",
    kv_cache_dtype: str = "auto",
    tensor_parallel_size: int | None = None,
    dtype: str | None = None,
    max_nodes: int = 1,
    require_compute_dtype: bool = False,
) -> Plan:
    """derive_shapes for both models (the draft in the target's dtype and KV dtype), then plan().
    dtype: the compute dtype, when it is not the config's torch_dtype (`engine serve --dtype`).
    require_compute_dtype: a target dtype outside COMPUTE_DTYPES is UncomputedDtypeError (the
    operator starts the engine in the planned dtype, which it must be able to compute in).
    A pair that cannot speculate together is PlanError "DraftIncompatible" (compat.py), first.
    A ConfigError from a config.json names it in `model` ("target" or "draft")."""
    check_pair(spec.algorithm, target_config, draft_config)
    try:
        target = derive_shapes(target_config, role="target", dtype=dtype, kv_cache_dtype=kv_cache_dtype)
    except ConfigError as err:
        err.model = "target"
        raise
    if require_compute_dtype and target.dtype not in COMPUTE_DTYPES:
        refused = UncomputedDtypeError(f"torch_dtype {target.dtype} is not a dtype the engine computes in"
                                       f" ({', '.join(COMPUTE_DTYPES)})")
        refused.model = "target"
        raise refused
    try:
        draft = derive_draft_shapes(spec.algorithm, target_config, draft_config, dtype=target.dtype,
                                    kv_cache_dtype=kv_cache_dtype)
    except ConfigError as err:
        err.model = "draft"
        raise
    if spec.algorithm == "MTP" and draft_config is None:
        # The MTP layers ship inside the target checkpoint: with its headers read they are already
        # in target_weight_bytes; without them they are counted from the shapes.
        draft_weight_bytes = 0 if target_weight_bytes is not None else None
    return plan(
        target, draft, spec, gpu, limits,
        target_weight_bytes=target_weight_bytes, draft_weight_bytes=draft_weight_bytes,
        target_weight_source=target_weight_source, draft_weight_source=draft_weight_source,
        gpus_per_node=gpus_per_node, role=role, tensor_parallel_size=tensor_parallel_size,
        max_nodes=max_nodes,
    )
