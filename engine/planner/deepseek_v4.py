"""DeepSeek-V4's config in either field-naming scheme, and what its KV cache really stores.

Two schemes name the same architecture (both are read; a test holds them to one result):

    original (the published checkpoint)     newer (transformers 5.x DeepseekV4Config)
    compress_ratios [0|4|128 per layer,     layer_types [sliding_attention | compressed_sparse_attention
      decoder layers then MTP layers]         | heavily_compressed_attention] + compress_rates {type: ratio}
    num_hash_layers                         mlp_layer_types [hash_moe | moe]
    rope_theta, compress_rope_theta,        rope_parameters {main: {...}, compress: {...}}
      rope_scaling (yarn)
    qk_rope_head_dim                        partial_rotary_factor (x head_dim)

`read_v4_config(config)` turns either into one `V4Config`. A field that decides the KV size and
cannot be read (no layer schedule at all, an unknown layer type or ratio, a window of 0, ...)
raises ConfigError naming it: guessing a schedule would silently misplan every byte.

What one layer stores (hd = head_dim, ihd = index_head_dim, r = its compression ratio, W =
sliding_window; every layer kind has the sliding-window branch of its single shared K=V head):

    per token (compressed entries, kept for the whole request)
        sliding  -
        CSA      one hd entry + one ihd indexer key per r tokens (the Lightning Indexer's keys)
        HCA      one hd entry per r tokens
    per request (recent tokens, a bounded number of rows however long the request)
        all      the window: the last W - 1 committed tokens' K (hd each); the next query is the
                 W-th token of its window
        CSA      the compressor's and the indexer's raw projections (kv and gate, 2 hd + 2 hd and
                 2 ihd + 2 ihd) of the last 2 r - 1 committed tokens: entry w mixes windows w - 1
                 and w (overlapping windows), so a window that is not closed yet needs the one
                 before it
        HCA      kv and gate (hd + hd) of the last r - 1 committed tokens (the open window)
    per in-flight token (a prefill chunk's tokens, a decode token, the verify tree's nodes, the
    draft's scratch: slots taken for one step) one row in every recent pool and one row in every
    entry pool (a tree node may close a window; which one is known only on the device). A step
    holds at most max(prefill chunk, running requests x slots per request per step) of them.

The engine (engine/memory/compressed_kv.py) allocates exactly `v4_pool_rows` of these widths,
so the planner's bytes and the engine's bytes are one formula.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from specdeploy.engine.planner.errors import MAX_CONFIG_INT, MAX_LAYERS, ConfigError

SLIDING, CSA, HCA = "sliding", "csa", "hca"
ATTENTION_KINDS = (SLIDING, CSA, HCA)

# The newer scheme's layer type names, and the ratio each has when compress_rates is silent
# (transformers' DeepseekV4Config defaults).
LAYER_TYPE_KIND = {
    "sliding_attention": SLIDING,
    "compressed_sparse_attention": CSA,
    "heavily_compressed_attention": HCA,
}
DEFAULT_COMPRESS_RATES = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}
# The original scheme names a layer by its ratio alone; these are the ratios it ships.
RATIO_KIND = {0: SLIDING, 4: CSA, 128: HCA}

HASH_MOE, MOE = "hash_moe", "moe"
MLP_KINDS = (HASH_MOE, MOE)

# Bytes of the per-slot maps the engine keeps for each V4 model: the slot's position (int64) and,
# per recent pool and per entry pool, the row it owns (int64): see engine/memory/kv.py.
SLOT_INDEX_BYTES = 8

# Quantized routed experts (FP8 codes; FP4 ones off CUDA / in float32) are dequantized into
# model-dtype weights inside the expert computation, at most this many experts' (or rows') copies
# of one projection at a time (engine/models/deepseek_v4.py _Experts): the transient the plan's
# expert workspace counts. FP4 experts in bf16 on CUDA make no copy (engine/kernels/fp4_moe.py).
EXPERT_DEQUANT_CHUNK = 16


@dataclass(frozen=True)
class RopeSpec:
    """One rotary table: plain (rope_type "default") or YaRN-scaled."""

    theta: float
    rope_type: str = "default"  # "default" | "yarn"
    factor: float = 1.0
    original_max_position_embeddings: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float = 1.0
    truncate: bool = True


@dataclass(frozen=True)
class V4Config:
    """DeepSeek-V4's architecture, one scheme. Per-layer tuples cover the decoder layers and then
    the MTP layers (indices num_hidden_layers ..)."""

    num_hidden_layers: int
    num_nextn_predict_layers: int
    attention_kinds: tuple[str, ...]
    compress_ratios: tuple[int, ...]  # 0 for sliding-window-only layers
    mlp_kinds: tuple[str, ...]
    hidden_size: int
    num_heads: int
    head_dim: int
    qk_rope_head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    sliding_window: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    rope_main: RopeSpec  # sliding-window-only layers
    rope_compress: RopeSpec  # CSA / HCA layers, their compressors and the indexer

    def layers(self, role: str) -> range:
        """Layer indices a role runs: the decoder stack ("target") or the MTP layers ("MTP")."""
        n = self.num_hidden_layers
        return range(n, n + self.num_nextn_predict_layers) if role == "MTP" else range(n)


def is_deepseek_v4(c: dict[str, Any]) -> bool:
    return str(c.get("model_type") or "").startswith("deepseek_v4") or any(
        key in c for key in ("compress_ratios", "compress_rates")
    )


def _positive_int(c: dict[str, Any], name: str, default: int | None = None, where: str = "") -> int:
    value = c.get(name, default)
    label = f"{where}.{name}" if where else name
    if value is None:
        raise ConfigError(f"{label}: missing from config.json (DeepSeek-V4 needs it to size its KV cache)")
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{label}: expected a positive integer, got {value!r}")
    if value > MAX_CONFIG_INT:
        raise ConfigError(f"{label}: {value} is implausible (at most {MAX_CONFIG_INT})")
    return value


def _number(c: dict[str, Any], name: str, default: float, where: str = "") -> float:
    """A real-number field; absent: `default`; anything but a number is an error naming it."""
    value = c.get(name, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(f"{f'{where}.{name}' if where else name}: expected a number, got {value!r}")
    return float(value)


def _schedule(c: dict[str, Any], n: int, nextn: int) -> tuple[tuple[str, ...], tuple[int, ...]]:
    total = n + nextn
    ratios = c.get("compress_ratios")
    types = c.get("layer_types")
    if ratios is not None:
        if not isinstance(ratios, list) or not all(isinstance(r, int) and not isinstance(r, bool) for r in ratios):
            raise ConfigError("compress_ratios: expected a list of integers")
        if len(ratios) < n:
            raise ConfigError(f"compress_ratios: has {len(ratios)} entries for {n} layers")
        bad = [r for r in ratios if r not in RATIO_KIND]
        if bad:
            raise ConfigError(f"compress_ratios: unknown ratio {bad[0]}; expected one of {sorted(RATIO_KIND)}")
        # The published list carries the MTP layers' entries after the decoder's; layers past
        # its end are sliding-window only.
        ratios = list(ratios[:total]) + [0] * max(0, total - len(ratios))
        return tuple(RATIO_KIND[r] for r in ratios), tuple(ratios)
    if types is None:
        raise ConfigError("compress_ratios: missing (and no layer_types): the per-layer attention "
                          "schedule decides DeepSeek-V4's KV size")
    if not isinstance(types, list) or len(types) < n:
        raise ConfigError(f"layer_types: expected a list of {n} layer types")
    rates = c.get("compress_rates")
    if rates is None:
        rates = {}
    if not isinstance(rates, dict):
        raise ConfigError("compress_rates: expected an object {layer type: ratio}")
    rates = {**DEFAULT_COMPRESS_RATES, **rates}
    for key in ("compress_rate_csa", "compress_rate_hca"):  # scalar overrides some configs ship
        if c.get(key) is not None:
            name = "compressed_sparse_attention" if key.endswith("csa") else "heavily_compressed_attention"
            rates[name] = c[key]
    kinds: list[str] = []
    out: list[int] = []
    for t in list(types[:n]) + ["sliding_attention"] * nextn:
        if t not in LAYER_TYPE_KIND:
            raise ConfigError(f"layer_types: unknown layer type {t!r}; expected one of {', '.join(LAYER_TYPE_KIND)}")
        kind = LAYER_TYPE_KIND[t]
        ratio = 0 if kind == SLIDING else rates.get(t)
        if isinstance(ratio, bool) or not isinstance(ratio, int) or (kind != SLIDING and ratio < 1):
            raise ConfigError(f"compress_rates: {t} needs a positive integer ratio, got {ratio!r}")
        kinds.append(kind)
        out.append(ratio)
    return tuple(kinds), tuple(out)


def _mlp_kinds(c: dict[str, Any], n: int, nextn: int) -> tuple[str, ...]:
    types = c.get("mlp_layer_types")
    if types is not None:
        if not isinstance(types, list) or len(types) < n or any(t not in MLP_KINDS for t in types[:n]):
            raise ConfigError(f"mlp_layer_types: expected {n} entries of {', '.join(MLP_KINDS)}")
        kinds = list(types[:n])
    else:
        hashed = c.get("num_hash_layers", 3)  # transformers' default when neither field is given
        if isinstance(hashed, bool) or not isinstance(hashed, int) or hashed < 0:
            raise ConfigError(f"num_hash_layers: expected a non-negative integer, got {hashed!r}")
        kinds = [HASH_MOE] * min(n, hashed) + [MOE] * max(0, n - hashed)
    return tuple(kinds) + (MOE,) * nextn  # MTP layers route by their learned gate


def _rope(raw: dict[str, Any], theta: float, where: str) -> RopeSpec:
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected an object")
    rope_type = str(raw.get("rope_type", raw.get("type", "default")))
    theta = _number(raw, "rope_theta", theta, where)
    if rope_type == "default":
        return RopeSpec(theta)
    if rope_type != "yarn":
        raise ConfigError(f"{where}: rope type {rope_type!r} is not supported for DeepSeek-V4 (default or yarn)")
    for required in ("factor", "original_max_position_embeddings"):
        if raw.get(required) is None:
            raise ConfigError(f"{where}.{required}: missing for yarn rope")
    return RopeSpec(
        theta=theta,
        rope_type="yarn",
        factor=_number(raw, "factor", 1.0, where),
        original_max_position_embeddings=_positive_int(raw, "original_max_position_embeddings", where=where),
        beta_fast=_number(raw, "beta_fast", 32.0, where),
        beta_slow=_number(raw, "beta_slow", 1.0, where),
        # DeepSeek-V4 does not scale cos/sin by YaRN's mscale (transformers forces 1.0 too).
        attention_factor=_number(raw, "attention_factor", 1.0, where) if raw.get("attention_factor") else 1.0,
        truncate=bool(raw.get("truncate", True)),
    )


def _ropes(c: dict[str, Any]) -> tuple[RopeSpec, RopeSpec]:
    main_theta = _number(c, "rope_theta", 10000.0)
    compress_theta = _number(c, "compress_rope_theta", 160000.0)
    params = c.get("rope_parameters")
    if isinstance(params, dict) and isinstance(params.get("main"), dict) and isinstance(params.get("compress"), dict):
        return (_rope(params["main"], main_theta, "rope_parameters.main"),
                _rope(params["compress"], compress_theta, "rope_parameters.compress"))
    # Flat form: YaRN (rope_scaling, or a flat rope_parameters) applies to the compressed layers
    # only; sliding-window layers use plain rope at rope_theta.
    flat = params if isinstance(params, dict) else (c.get("rope_scaling") or {})
    if not isinstance(flat, dict):
        raise ConfigError(f"rope_scaling: expected an object, got {flat!r}")
    flat = {k: v for k, v in flat.items() if k not in ("rope_theta", "partial_rotary_factor")}
    return RopeSpec(main_theta), _rope(flat, compress_theta, "rope_scaling")


def read_v4_config(config: dict[str, Any]) -> V4Config:
    """The one reading of a DeepSeek-V4 config.json (either scheme; see module docstring)."""
    c = config.get("text_config", config) if isinstance(config.get("text_config"), dict) else config
    n = _positive_int(c, "num_hidden_layers")
    if n > MAX_LAYERS:
        raise ConfigError(f"num_hidden_layers: {n} is implausible (at most {MAX_LAYERS})")
    nextn = c.get("num_nextn_predict_layers", 0) or 0
    if isinstance(nextn, bool) or not isinstance(nextn, int) or not 0 <= nextn <= MAX_LAYERS:
        raise ConfigError(f"num_nextn_predict_layers: expected a non-negative integer, got {nextn!r}")
    head_dim = _positive_int(c, "head_dim")
    if c.get("qk_rope_head_dim") is not None:
        rope_dim = _positive_int(c, "qk_rope_head_dim")
    elif c.get("partial_rotary_factor") is not None:
        rope_dim = int(head_dim * _number(c, "partial_rotary_factor", 1.0))
    else:
        rope_dim = head_dim * 64 // 512  # transformers' default partial_rotary_factor, 64 / 512
    if rope_dim < 2 or rope_dim % 2 or rope_dim > head_dim:
        raise ConfigError(f"qk_rope_head_dim: {rope_dim} must be even and within head_dim {head_dim}")
    kinds, ratios = _schedule(c, n, nextn)
    main, compress = _ropes(c)
    heads = _positive_int(c, "num_attention_heads")
    o_groups = _positive_int(c, "o_groups", 1)
    if heads % o_groups:
        raise ConfigError(f"o_groups: {o_groups} does not divide num_attention_heads {heads}")
    return V4Config(
        num_hidden_layers=n,
        num_nextn_predict_layers=nextn,
        attention_kinds=kinds,
        compress_ratios=ratios,
        mlp_kinds=_mlp_kinds(c, n, nextn),
        hidden_size=_positive_int(c, "hidden_size"),
        num_heads=heads,
        head_dim=head_dim,
        qk_rope_head_dim=rope_dim,
        q_lora_rank=_positive_int(c, "q_lora_rank"),
        o_groups=o_groups,
        o_lora_rank=_positive_int(c, "o_lora_rank"),
        sliding_window=_positive_int(c, "sliding_window"),
        index_n_heads=_positive_int(c, "index_n_heads", 1) if CSA in kinds else int(c.get("index_n_heads") or 0),
        index_head_dim=_positive_int(c, "index_head_dim") if CSA in kinds else int(c.get("index_head_dim") or 0),
        index_topk=_positive_int(c, "index_topk", 512) if CSA in kinds else int(c.get("index_topk") or 0),
        rope_main=main,
        rope_compress=compress,
    )


# --------------------------------------------------------------------------------------------
# the KV pools


@dataclass(frozen=True)
class PoolSpec:
    """One pool of the engine: `layers` layers x rows x `width` elements of the model dtype.
    kind "entries": rows grow with the tokens held (one per `ratio` tokens); kind "recent": a
    bounded number of rows per request (`keep` committed tokens)."""

    name: str
    kind: str  # "entries" | "recent"
    layers: tuple[int, ...]  # model layer indices that own a slice of this pool
    width: int
    ratio: int = 0  # entries: tokens per entry
    keep: int = 0  # recent: committed tokens kept per request


def v4_pools(v4: V4Config, role: str) -> tuple[PoolSpec, ...]:
    """The pools one role's layers need (see module docstring); empty pools are left out."""
    hd, ihd, w = v4.head_dim, v4.index_head_dim, v4.sliding_window
    layers = list(v4.layers(role))
    by_kind = {k: [i for i in layers if v4.attention_kinds[i] == k] for k in ATTENTION_KINDS}
    pools = [PoolSpec("window", "recent", tuple(layers), hd, keep=w - 1)]
    for kind in (CSA, HCA):
        ids = by_kind[kind]
        for ratio in sorted({v4.compress_ratios[i] for i in ids}):
            group = tuple(i for i in ids if v4.compress_ratios[i] == ratio)
            tag = f"{kind}{ratio}"
            if kind == CSA:
                pools.append(PoolSpec(f"{tag}_entries", "entries", group, hd + ihd, ratio=ratio))
                pools.append(PoolSpec(f"{tag}_state", "recent", group, 4 * hd + 4 * ihd, keep=2 * ratio - 1))
            else:
                pools.append(PoolSpec(f"{tag}_entries", "entries", group, hd, ratio=ratio))
                pools.append(PoolSpec(f"{tag}_state", "recent", group, 2 * hd, keep=ratio - 1))
    return tuple(pools)


def v4_kept_positions(pool: PoolSpec, n: int) -> range:
    """The positions of an n-token request whose rows `pool` still holds once they are committed:
    a recent pool's last `keep`, an entries pool's window closers. What a finished request gives
    back, and what moves to a decode server."""
    if pool.kind == "recent":
        return range(max(0, n - pool.keep), n)
    return range(pool.ratio - 1, n, pool.ratio)


def v4_staged_bytes(v4: V4Config, role: str, dtype_bytes: int, n: int) -> int:
    """Bytes an n-token request's kept rows of every pool take in a staging region (transfer.py's
    layout: per pool its layers x (kept rows + an unused row 0) x width)."""
    return sum(len(p.layers) * (len(v4_kept_positions(p, n)) + 1) * p.width * dtype_bytes
               for p in v4_pools(v4, role))


def v4_in_flight_rows(prefill_chunk_tokens: int, max_running_requests: int, in_flight_per_request: int) -> int:
    """Rows every pool keeps for the slots of one step: a prefill chunk, or every running
    request's decode / tree / scratch slots (a step does one, then the other)."""
    return max(prefill_chunk_tokens, max_running_requests * in_flight_per_request)


def v4_pool_rows(pool: PoolSpec, max_total_tokens: int, max_running_requests: int, in_flight: int) -> int:
    """Rows the engine allocates for `pool`: its padding row 0, the committed rows, `in_flight`
    (v4_in_flight_rows) rows for a step's slots."""
    if pool.kind == "entries":
        return 1 + math.ceil(max_total_tokens / pool.ratio) + in_flight
    return 1 + max_running_requests * pool.keep + in_flight


def v4_slot_maps(pools: tuple[PoolSpec, ...]) -> int:
    """Per-slot index maps the engine keeps for a V4 model: the position, and one row per pool."""
    return 1 + len(pools)


@dataclass(frozen=True)
class V4KVBytes:
    per_token: int  # entries + slot maps, per token slot
    per_request: int  # the committed recent rows of one request
    per_in_flight_token: int  # one row in every pool, for each slot a step holds


def v4_kv_bytes(v4: V4Config, role: str, dtype_bytes: int) -> V4KVBytes:
    pools = v4_pools(v4, role)
    per_token = Fraction(v4_slot_maps(pools) * SLOT_INDEX_BYTES)
    per_request = 0
    in_flight = 0
    for p in pools:
        size = len(p.layers) * p.width * dtype_bytes
        in_flight += size
        if p.kind == "entries":
            per_token += Fraction(size, p.ratio)
        else:
            per_request += p.keep * size
    return V4KVBytes(math.ceil(per_token), per_request, in_flight)


# ---------------------------------------------------------------------------------------------
# transient memory of one forward (the plan's activation workspace and graph pool)

# Queries one attention block carries when a forward has more (engine/models/deepseek_v4.py
# runs each block from its q projections to the low-rank output).
QUERY_BLOCK = 256  # query rows (B x Q) of one block

# Bytes per weight element one projection's dequantization holds while it runs
# (engine/models/deepseek_v4.py _Experts.weight), by checkpoint kind, for model dtype bytes d:
# FP4 none: on CUDA the fused grouped GEMM (engine/kernels/fp4_moe.py) dequantizes the codes in
# registers and writes no weight copy (the torch code, CPU only, is not planned for); FP8 the
# float32 codes, their float32 per-element scales and product (fp8.dequantize_fp8), and the output.
DEQUANT_TRANSIENT_BYTES = {"fp4": (0, 0), "fp8": (12, 1)}  # (bytes, times d)


@dataclass(frozen=True)
class V4ForwardDims:
    """What the transient memory needs beyond V4Config (the planner's shapes carry these)."""

    hc_mult: int
    num_experts: int  # router width
    local_experts: int  # routed experts on one rank
    experts_per_tok: int
    moe_intermediate_size: int
    shared_intermediate_size: int
    expert_quant: str = ""  # "" | "fp4" | "fp8"


def v4_forward_peak_bytes(v4: V4Config, role: str, dims: V4ForwardDims, tokens: int, prefix: int,
                          dtype_bytes: int, captured: bool = False) -> dict[str, int]:
    """Bytes one V4 forward over `tokens` rows (B x Q, after `prefix` committed positions) allocates
    beyond its inputs and the pools, at the peak of each phase of a layer, the largest over the
    role's layers: {phase: bytes}; the largest phase is what the forward needs. Named after the
    tensors of engine/models/deepseek_v4.py and models/hc.py on CUDA (the hyper-connection
    kernels), held to the code by tests/engine/planner/test_v4_workspace.py. d = dtype bytes,
    T = tokens, S = T hc H d (one copy of the streams), R = T k (token, expert) rows; every phase
    adds the step's gather plan (T span 9 + per ratio T entries + entries 8):

        hc_mixes   2 S (the layer's input streams, which the model loop holds, and the sublayer's)
                   + T hc H 4 (the float32 flattened streams the mixes matmul reads)
        attention  2 S + 2 T H d (collapsed and normed input) + the larger of the blocks'
                   low-rank outputs T G o_lora d with one query block and their concatenation
                   (2 T G o_lora d); a query block of n = min(T, QUERY_BLOCK) rows (over prompts
                   and queries; `captured`: a graph's forward is one block, n = T), the larger
                   of its q norm (q = n heads hd
                   elements at d + 8: the projection, its float32 copy and square) and its
                   attention: q d + on CSA layers the indexer's float32 scores n index_heads
                   entries 4 (entries = prefix / r + T / r + 1), with the larger of their
                   weighted copy and what the softmax then holds: the keys' and values' gathers
                   n (W + keys) hd d x 2 and logits n heads (W + keys) 4 x 3 (keys: CSA
                   min(index_topk, entries), HCA entries)
        moe        2 S + 2 T H d + router T E 4 x 3 + xs R H d + the activation R (2I + 4I) d
                   (gate/up output, clamped gate and up, silu, product) + the sort R 24 + FP8 experts:
                   EXPERT_DEQUANT_CHUNK experts' gate/up dequantized and the output R H d (FP4:
                   nothing more, the fused kernel holds no weight copy)
        shared     2 S + 3 T H d + the shared expert's gate, up, clamps, silu, product 6 T Is d
        mtp_input  (MTP) the hnorm of the target's streams: 2 S + T hc H 4 x 2
    """
    d, h = dtype_bytes, v4.hidden_size
    s = tokens * dims.hc_mult * h * d
    rows = tokens * dims.experts_per_tok
    i = dims.moe_intermediate_size
    n = tokens if captured else min(tokens, QUERY_BLOCK)  # rows of one query block
    w = v4.sliding_window
    low_rank = tokens * v4.o_groups * v4.o_lora_rank * d
    attention = 0
    for layer in v4.layers(role):
        kind, r = v4.attention_kinds[layer], v4.compress_ratios[layer]
        keys = scores = 0
        if kind == CSA:
            entries = -(-prefix // r) + -(-tokens // r) + 1
            keys = min(v4.index_topk, entries)
            scores = n * v4.index_n_heads * entries * 4
        elif kind == HCA:
            keys = -(-prefix // r) + -(-tokens // r) + 1
        q = n * v4.num_heads * v4.head_dim
        keys_values = 2 * n * (w + keys) * v4.head_dim * d + 3 * n * v4.num_heads * (w + keys) * 4
        block = max(q * (d + 8), q * d + max(2 * scores, scores + keys_values))
        attention = max(attention, block)
    # the step's gather plan (_build_step), alive through the forward: the path's slots and
    # validity [T, span], per ratio the entry candidates' visibility [T, entries] and slots
    ratios = {(v4.attention_kinds[j], v4.compress_ratios[j]) for j in v4.layers(role) if v4.compress_ratios[j]}
    span = max([w] + [2 * r if kind == CSA else r for kind, r in ratios])
    step = tokens * span * 9
    for r in {r for _, r in ratios}:
        entries = -(-prefix // r) + -(-tokens // r) + 1
        step += tokens * entries + entries * 8
    moe = 2 * tokens * h * d + 3 * tokens * dims.num_experts * 4 + rows * (h * d + 6 * i * d + 24)
    if dims.expert_quant:
        per, times_d = DEQUANT_TRANSIENT_BYTES[dims.expert_quant]
        if per or times_d:  # a dequantizing path: the chunk's copies and its partial output
            chunk = min(EXPERT_DEQUANT_CHUNK, dims.local_experts)
            moe += chunk * 2 * i * h * (per + times_d * d) + rows * h * d
    s2 = 2 * s + step
    phases = {
        "hc_mixes": s2 + tokens * dims.hc_mult * h * 4,
        "attention": s2 + 2 * tokens * h * d + max(low_rank + attention, 2 * low_rank),
        "moe": s2 + moe,
        "shared": s2 + 3 * tokens * h * d + 6 * tokens * dims.shared_intermediate_size * d,
    }
    if role == "MTP":
        phases["mtp_input"] = 2 * s + 2 * tokens * dims.hc_mult * h * 4
    return phases
