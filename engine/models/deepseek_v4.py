"""DeepSeek-V4 over the engine's slot pools: compressed attention, hash-routed MoE, mHC residual.

The architecture as its config defines it (read through engine/planner/deepseek_v4.py, both
field-naming schemes), module and parameter names as transformers' DeepseekV4ForCausalLM:

attention, per layer kind (0 = sliding window only, CSA = compressed sparse, HCA = heavily
compressed), every kind with one shared K=V head of head_dim:
    q      = rope(rms(q_b_proj(q_a_norm(q_a_proj(x)))))            [T, heads, hd], rope on the
             trailing qk_rope_head_dim dims, pairs interleaved
    kv     = rope(kv_norm(kv_proj(x)))                               [T, hd]: key and value
    keys   = the window (the last W positions, the query's own included)
             + CSA: the index_topk compressed entries the Lightning Indexer picks
             + HCA: every compressed entry of a closed window
    out    = softmax([q k^T / sqrt(hd), sink]) without the sink column, times the keys (K = V),
             then rope^-1 on the rope dims at the query position, grouped low-rank projection
             o_b_proj(o_a_proj per head group)
    compressed entry of window w (positions w r .. w r + r - 1; closed by position w r + r - 1):
             softmax over the window's tokens of (gate + position_bias) times kv, kv_norm, rope at
             position w r; CSA mixes window w - 1's first-half projections with window w's second
             half (overlapping windows of 2 r tokens), and its indexer compresses its own keys the
             same way at index_head_dim
    rope:    sliding layers plain rope at rope_theta; CSA / HCA layers, their compressors and the
             indexer YaRN at compress_rope_theta (no mscale on cos/sin)
MoE (every layer): routed experts scored by sqrtsoftplus, top-k on score + e_score_correction_bias
    (noaux_tc), or expert ids looked up per token (tid2eid) in the first hash layers; weights
    renormalised and scaled by routed_scaling_factor; swiglu_limit clamps gate (above) and up (both
    sides) before silu(gate) * up; plus the shared expert.
residual: hc_mult streams with the mHC mixing of engine/models/hc.py around each sublayer;
    hc_head collapses them before the final norm. The MTP draft reads the flattened streams.
tensor parallel: everything replicated (one shared K=V head leaves nothing to split in
    attention) but the routed experts, split across the ranks (expert parallelism inside the TP
    group): each rank adds its experts' share and one all-reduce per MoE layer sums them.

Memory (engine/memory/compressed_kv.py): every forward first writes its tokens' window K,
compressor projections and closed-window entries into the pools through the slot maps, then
reads back what each query needs as fixed-shape gathers: `path [B, Q, S]`, the slots of the
positions P, P - 1, .., P - S + 1 along the query's own ancestry (committed prefix, then the
in-flight tokens its mask lets it see), and the entry candidates (committed closed windows,
then in-flight tokens that close one). Decode, verify trees and draft steps use this as it is
(CUDA graphs capture it); a long prefill chunk takes a contiguous-positions shortcut and runs the
attention over blocks of queries.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from specdeploy.engine import kernels
from specdeploy.engine.models.attention import AttnBatch
from specdeploy.engine.models.draft import DraftHead
from specdeploy.engine.models.hc import (HCConfig, HyperHead, _Float32Params, canonical_hc_key,
                                         expand_embeddings, flatten_streams, make_residual,
                                         unflatten_streams)
from specdeploy.engine.models.protocol import OWN_POOLS
from specdeploy.engine.models.layers import (ColumnParallelLinear, ParallelLMHead, VocabParallelEmbedding,
                                             fused_kernels)
# QUERY_BLOCK: queries per block when a long chunk runs the attention (bounds the [block, heads,
# keys] logits; the plan's workspace counts one block)
from specdeploy.engine.planner.deepseek_v4 import (CSA, EXPERT_DEQUANT_CHUNK, HASH_MOE, HCA, QUERY_BLOCK,
                                                   SLIDING, RopeSpec, V4Config, read_v4_config)
from specdeploy.engine.memory.compressed_kv import V4KV
from specdeploy.engine.memory.kv import PAD_SLOT

# In-flight key sets larger than this are prefill / extend chunks (causal, contiguous positions):
# their paths are indexed by position instead of matched key by key.
CONTIGUOUS_MIN_KEYS = 64
# Routed experts: three computations of the same sums (_Experts.path picks one per call):
#   "grouped"   the rows (token, expert) sorted by expert, one grouped GEMM per projection over the
#               layer's experts (torch's grouped_mm). No host sync, so CUDA graphs capture it, but
#               only on torch's fast path: bf16 on Hopper / Blackwell; anywhere else grouped_mm
#               copies its offsets to the host (a sync, and an error inside a graph capture).
#               Quantized experts are dequantized EXPERT_DEQUANT_CHUNK at a time, each chunk's
#               grouped GEMM over every row with the other experts' rows zeroed (device bounds).
#   "gathered"  each row with its own expert's weights gathered ([r, N, K]), batched matmuls over
#               EXPERT_DEQUANT_CHUNK rows at a time: fixed shapes, no host sync, any dtype and
#               device. Quantized experts take it when a call has fewer rows than the rank has
#               experts (a decode step dequantizes the experts its rows use, not all of them);
#               unquantized ones off the fast path up to GATHERED_MAX_ROWS rows, or in a capture.
#   "chunked"   eager only (one host sync): the experts a call hits, EXPERT_DEQUANT_CHUNK at a time
#               (a grouped GEMM over the chunk's rows on the fast path, a matmul per expert
#               elsewhere): the long prefill chunks.
# So no call holds more than EXPERT_DEQUANT_CHUNK experts' weights dequantized at once: the
# transient the plan counts (engine/planner/deepseek_v4.py, where the constant lives).
# FP4 experts on CUDA in bf16 skip all three: one fused grouped GEMM per projection
# (engine/kernels/fp4_moe.py) dequantizes the codes in registers, no weight copy at all, and picks
# its own tile map (fp4_moe.gathered_map; a forced EXPERT_PATH "gathered" forces a tile per row).
GATHERED_MAX_ROWS = 256
# Tests force one path ("grouped" / "gathered" / "chunked"; grouped_mm runs on CPU too, slowly).
EXPERT_PATH: str | None = None
# Benchmarks and tests turn the fused FP4 kernel off to time / check the dequantizing paths.
FP4_FUSED_MOE = True


def capturing(t: torch.Tensor) -> bool:
    """Whether this forward is being captured into a CUDA graph (then every choice between a
    fixed-shape and a data-dependent computation takes the fixed-shape one)."""
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def grouped_mm_without_sync(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether torch's grouped_mm runs its fast path (device-side offsets, no host copy) here."""
    if not hasattr(F, "grouped_mm") or device.type != "cuda" or dtype != torch.bfloat16:
        return False
    return torch.cuda.get_device_capability(device)[0] in (9, 10)


def expert_path(rows: int, num_experts: int, quantized: bool, fast_grouped: bool, in_capture: bool) -> str:
    """The routed-expert computation for a call of `rows` (token, expert) rows (see above)."""
    if fast_grouped and not quantized:
        return "grouped"
    if quantized and rows < num_experts:
        return "gathered"
    if in_capture:
        return "grouped" if fast_grouped else "gathered"
    if not fast_grouped and rows <= GATHERED_MAX_ROWS:
        return "gathered"
    return "chunked"


@dataclass
class V4ModelConfig:
    """The engine's view of a DeepSeek-V4 config.json (the planner's V4Config plus what only
    the model needs)."""

    v4: V4Config
    vocab_size: int
    rms_norm_eps: float
    hc: HCConfig
    num_experts: int
    num_shared_experts: int
    moe_intermediate_size: int
    num_experts_per_tok: int
    routed_scaling_factor: float
    swiglu_limit: float
    scoring_func: str
    tie_word_embeddings: bool
    max_position_embeddings: int
    model_type: str = "deepseek_v4"
    raw: dict = field(default_factory=dict, repr=False)

    @property
    def hidden_size(self) -> int:
        return self.v4.hidden_size

    @property
    def hc_mult(self) -> int:
        return self.hc.hc_mult

    @property
    def spec_hidden_size(self) -> int:
        return self.hidden_size * self.hc_mult

    @property
    def num_layers(self) -> int:
        return self.v4.num_hidden_layers

    @classmethod
    def from_hf(cls, config: dict) -> "V4ModelConfig":
        c = config.get("text_config", config)
        v4 = read_v4_config(c)
        scoring = str(c.get("scoring_func", "sqrtsoftplus"))
        if scoring not in _SCORE_FNS:
            raise ValueError(f"scoring_func {scoring!r} is not supported (expected one of {', '.join(_SCORE_FNS)})")
        for key in ("vocab_size", "n_routed_experts", "moe_intermediate_size", "num_experts_per_tok"):
            if key not in c:
                raise ValueError(f"config.json lacks {key!r}")
        return cls(
            v4=v4,
            vocab_size=int(c["vocab_size"]),
            rms_norm_eps=float(c.get("rms_norm_eps", 1e-6)),
            hc=HCConfig(v4.hidden_size, int(c.get("hc_mult", 4)), int(c.get("hc_sinkhorn_iters", 20)),
                        float(c.get("hc_eps", 1e-6)), float(c.get("rms_norm_eps", 1e-6))),
            num_experts=int(c["n_routed_experts"]),
            num_shared_experts=int(c.get("n_shared_experts", 1)),
            moe_intermediate_size=int(c["moe_intermediate_size"]),
            num_experts_per_tok=int(c["num_experts_per_tok"]),
            routed_scaling_factor=float(c.get("routed_scaling_factor", 1.0)),
            swiglu_limit=float(c.get("swiglu_limit") or 0.0),
            scoring_func=scoring,
            tie_word_embeddings=bool(config.get("tie_word_embeddings", c.get("tie_word_embeddings", False))),
            max_position_embeddings=int(c.get("max_position_embeddings", 4096)),
            model_type=str(c.get("model_type", "deepseek_v4")),
            raw=c,
        )


_SCORE_FNS = {
    "sqrtsoftplus": lambda x: F.softplus(x).sqrt(),
    "sigmoid": torch.sigmoid,
    "softmax": lambda x: x.softmax(-1),
}


# ---------------------------------------------------------------------------------------------
# small pieces


class _KeepFloat32(nn.Module):
    """Keeps the parameters / buffers named in `float32_names` float32 when the module is cast
    (published checkpoints store sinks, position biases and the score-correction bias in float32,
    and transformers keeps them so); they still follow device moves."""

    float32_names: tuple[str, ...] = ()

    def _apply(self, fn, recurse=True):
        kept = {}
        for name in self.float32_names:
            if name in self._parameters:
                kept[name] = (True, self._parameters.pop(name))
            elif name in self._buffers:
                kept[name] = (False, self._buffers.pop(name))
        try:
            super()._apply(fn, recurse)
        finally:
            for name, (is_param, t) in kept.items():
                device = fn(torch.empty(0, dtype=t.dtype, device=t.device)).device
                moved = torch.empty_like(t, device=device) if "meta" in (device.type, t.device.type) else t.data.to(device)
                if is_param:
                    self._parameters[name] = nn.Parameter(moved, requires_grad=False)
                else:
                    self._buffers[name] = moved
        return self


class V4RMSNorm(_Float32Params):
    """RMSNorm whose weight stays float32 (as published); normalised and scaled in float32, cast
    once to the input dtype."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * h).to(x.dtype)


def _unweighted_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


def rope_inv_freq_v4(rope: RopeSpec, dim: int) -> torch.Tensor:
    """[dim / 2] inverse frequencies, plain or YaRN (transformers' _compute_yarn_parameters)."""
    pos_freqs = rope.theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    if rope.rope_type == "default":
        return 1.0 / pos_freqs

    def correction_dim(rotations: float) -> float:
        return dim * math.log(rope.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    return (1.0 / (rope.factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor, scale: float, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [...] -> cos, sin [..., rope_dim / 2] (one angle per interleaved pair)."""
    freqs = positions.to(torch.float32)[..., None] * inv_freq
    return (freqs.cos() * scale).to(dtype), (freqs.sin() * scale).to(dtype)


def apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the trailing 2 * cos.shape[-1] dims of x [..., D] as consecutive pairs (2i, 2i + 1).
    cos/sin [..., rope_dim / 2] broadcast against x's leading dims (insert head axes before)."""
    rd = 2 * cos.shape[-1]
    nope, rope = x[..., :-rd], x[..., -rd:].float()
    even, odd = rope[..., 0::2], rope[..., 1::2]
    c, s = cos.float(), sin.float()
    rotated = torch.stack((even * c - odd * s, odd * c + even * s), dim=-1).flatten(-2)
    return torch.cat([nope, rotated.to(x.dtype)], dim=-1)


class _Rope(nn.Module):
    def __init__(self, spec: RopeSpec, dim: int):
        super().__init__()
        self.spec, self.dim = spec, dim
        self.register_buffer("inv_freq", rope_inv_freq_v4(spec, dim), persistent=False)

    def forward(self, positions: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return rope_cos_sin(self.inv_freq, positions, self.spec.attention_factor, dtype)

    def _apply(self, fn, recurse=True):
        # Frequencies are recomputed in float32 rather than cast (a bf16 round trip shifts them).
        super()._apply(fn, recurse)
        self.inv_freq = rope_inv_freq_v4(self.spec, self.dim).to(self.inv_freq.device)
        return self


# ---------------------------------------------------------------------------------------------
# the per-forward gather plan


@dataclass
class _Step:
    """Per-forward index tensors shared by every layer (see module docstring)."""

    positions: torch.Tensor        # [B, Q]
    out_slots: torch.Tensor        # [B, Q]
    path: torch.Tensor             # [B, Q, S] slot at position P - o
    path_valid: torch.Tensor       # [B, Q, S]
    entries: dict[int, tuple[torch.Tensor, torch.Tensor]]  # ratio -> slots [B, Ke], visible [B, Q, Ke]
    input_ids: torch.Tensor        # [B, Q]


def _build_step(v4: V4Config, layers: range, input_ids, positions, batch: AttnBatch, kv: V4KV) -> _Step:
    dev = positions.device
    b, q = positions.shape
    kv.slot_pos[batch.out_slots] = positions
    span = v4.sliding_window
    ratios = set()
    for i in layers:
        r = v4.compress_ratios[i]
        if r:
            ratios.add(r)
            span = max(span, 2 * r if v4.attention_kinds[i] == CSA else r)
    prefix, plens = batch.prefix_slots, batch.prefix_lens
    kp = prefix.shape[1]
    new_slots, new_mask = batch.new_slots, batch.new_mask
    kn = new_slots.shape[1]
    offsets = torch.arange(span, device=dev)
    x = positions[:, :, None] - offsets                                     # [B, Q, S] positions
    committed = (x >= 0) & (x < plens[:, None, None])
    if kp:
        slot_c = prefix.gather(1, x.clamp(0, kp - 1).view(b, -1)).view(b, q, span)
    else:
        slot_c = torch.full_like(x, PAD_SLOT)
    contiguous = kn > CONTIGUOUS_MIN_KEYS
    if contiguous:
        # prefill / extend chunk: in-flight key j sits at position prefix_len + j
        j = x - plens[:, None, None]
        inside = (j >= 0) & (j < kn)
        jc = j.clamp(0, kn - 1)
        seen = new_mask.gather(2, jc) & inside
        slot_f = new_slots.gather(1, jc.view(b, -1)).view(b, q, span)
    else:
        key_pos = kv.slot_pos[new_slots]                                    # [B, Kn]
        dist = positions[:, :, None] - key_pos[:, None, :]                  # [B, Q, Kn]
        onehot = new_mask[..., None] & (dist[..., None] == offsets)         # [B, Q, Kn, S]
        seen = onehot.any(2)
        slot_f = (onehot.long() * new_slots[:, None, :, None]).sum(2)
    path = torch.where(committed, slot_c, torch.where(seen, slot_f, PAD_SLOT))
    valid = committed | seen

    entries = {}
    for r in sorted(ratios):
        ce = prefix[:, r - 1::r]                                            # [B, Kp // r]
        n_ce = ce.shape[1]
        vis_c = (torch.arange(n_ce, device=dev) < (plens // r)[:, None])[:, None, :].expand(b, q, n_ce)
        if contiguous:
            first = (r - 1 - plens % r)                                     # [B] first closing j
            je = first[:, None] + r * torch.arange((kn + r - 1) // r + 1, device=dev)
            inside = je < kn
            jec = je.clamp(0, kn - 1)
            fe = new_slots.gather(1, jec)
            vis_f = new_mask.gather(2, jec[:, None, :].expand(b, q, -1)) & inside[:, None, :]
        else:
            key_pos = kv.slot_pos[new_slots]
            fe = new_slots
            vis_f = new_mask & ((key_pos + 1) % r == 0)[:, None, :]
        entries[r] = (torch.cat([ce, fe], 1), torch.cat([vis_c, vis_f], 2))
    return _Step(positions, batch.out_slots, path, valid, entries, input_ids)


# ---------------------------------------------------------------------------------------------
# attention


class _Compressor(_KeepFloat32):
    """kv_proj / gate_proj / position_bias / kv_norm of one compressed series (transformers'
    names). overlap: CSA's two series per token (width 2 * dim)."""

    float32_names = ("position_bias",)

    def __init__(self, hidden: int, dim: int, ratio: int, overlap: bool, eps: float):
        super().__init__()
        width = 2 * dim if overlap else dim
        self.dim, self.ratio, self.overlap = dim, ratio, overlap
        self.kv_proj = ColumnParallelLinear(hidden, width, False)
        self.gate_proj = ColumnParallelLinear(hidden, width, False)
        self.position_bias = nn.Parameter(torch.zeros(ratio, width), requires_grad=False)
        self.kv_norm = V4RMSNorm(dim, eps)

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """x [.., H] -> the raw state row [.., 2 * width]: kv then gate."""
        return torch.cat([self.kv_proj(x), self.gate_proj(x)], -1)

    def compress(self, states: torch.Tensor, valid: torch.Tensor, positions: torch.Tensor,
                 rope: _Rope) -> torch.Tensor:
        """states [N, S, 2 * width] at offsets o = 0.. (positions P - o) of queries at P that close a
        window; valid [N, S] -> entries [N, dim] (rope'd at the window's first position)."""
        r, d = self.ratio, self.dim
        width = 2 * d if self.overlap else d
        o = torch.arange(r, device=states.device)
        pos_in_window = r - 1 - o                                           # offset o -> slot in window
        kv, gate = states[..., :width], states[..., width:]
        bias = self.position_bias.float()
        if self.overlap:
            # current window (o < r): the second series; previous window (r <= o < 2r): the first
            cur_kv, cur_g = kv[:, :r, d:], gate[:, :r, d:].float() + bias[pos_in_window, d:]
            prev_kv, prev_g = kv[:, r:2 * r, :d], gate[:, r:2 * r, :d].float() + bias[pos_in_window, :d]
            kv = torch.cat([cur_kv, prev_kv], 1)
            g = torch.cat([cur_g, prev_g], 1)
            ok = valid[:, :2 * r]
        else:
            kv, g, ok = kv[:, :r], gate[:, :r].float() + bias[pos_in_window], valid[:, :r]
        g = g.masked_fill(~ok[..., None], float("-inf"))
        # A row with no valid token (a padded or non-closing query, computed for a fixed shape)
        # gets zero weights, not NaN: its entry lands in a row that may be read with weight 0.
        w = torch.where(ok.any(1)[:, None, None], g.softmax(dim=1, dtype=torch.float32), 0.0).to(kv.dtype)
        entry = self.kv_norm((kv * w).sum(1))                               # [N, dim]
        cos, sin = rope(positions - r + 1, entry.dtype)
        return apply_rope_interleaved(entry, cos, sin)


class _IndexerScorer(nn.Module):
    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.weights_proj = ColumnParallelLinear(hidden, heads, False)


class _Indexer(_Compressor):
    """The Lightning Indexer: its own compressed keys (index_head_dim, overlapping windows) and
    index_n_heads queries from the q low-rank residual."""

    def __init__(self, cfg: V4ModelConfig, ratio: int):
        v4 = cfg.v4
        super().__init__(v4.hidden_size, v4.index_head_dim, ratio, True, cfg.rms_norm_eps)
        self.heads, self.topk = v4.index_n_heads, v4.index_topk
        self.q_b_proj = ColumnParallelLinear(v4.q_lora_rank, v4.index_n_heads * v4.index_head_dim, False)
        self.scorer = _IndexerScorer(v4.hidden_size, v4.index_n_heads)


class _CSACompressor(_Compressor):
    def __init__(self, cfg: V4ModelConfig, ratio: int):
        super().__init__(cfg.hidden_size, cfg.v4.head_dim, ratio, True, cfg.rms_norm_eps)
        self.indexer = _Indexer(cfg, ratio)


class V4Attention(_KeepFloat32):
    float32_names = ("sinks",)

    def __init__(self, cfg: V4ModelConfig, layer: int):
        super().__init__()
        v4 = cfg.v4
        self.layer, self.kind, self.ratio = layer, v4.attention_kinds[layer], v4.compress_ratios[layer]
        self.heads, self.hd, self.window = v4.num_heads, v4.head_dim, v4.sliding_window
        self.o_groups, self.o_lora = v4.o_groups, v4.o_lora_rank
        self.eps = cfg.rms_norm_eps
        h = v4.hidden_size
        self.q_a_proj = ColumnParallelLinear(h, v4.q_lora_rank, False)
        self.q_a_norm = V4RMSNorm(v4.q_lora_rank, cfg.rms_norm_eps)
        self.q_b_proj = ColumnParallelLinear(v4.q_lora_rank, self.heads * self.hd, False)
        self.kv_proj = ColumnParallelLinear(h, self.hd, False)
        self.kv_norm = V4RMSNorm(self.hd, cfg.rms_norm_eps)
        # grouped output: weight [o_groups * o_lora, heads * hd / o_groups], one block per group
        self.o_a_proj = ColumnParallelLinear(self.heads * self.hd // self.o_groups, self.o_groups * self.o_lora, False)
        self.o_b_proj = ColumnParallelLinear(self.o_groups * self.o_lora, h, False)
        self.sinks = nn.Parameter(torch.zeros(self.heads, dtype=torch.float32), requires_grad=False)
        self.compressor = None
        if self.kind == CSA:
            self.compressor = _CSACompressor(cfg, self.ratio)
        elif self.kind == HCA:
            self.compressor = _Compressor(h, self.hd, self.ratio, False, cfg.rms_norm_eps)
        self.rope = _Rope(v4.rope_main if self.kind == SLIDING else v4.rope_compress, v4.qk_rope_head_dim)

    def forward(self, x: torch.Tensor, step: _Step, kv: V4KV) -> torch.Tensor:
        """x [B, Q, H] (normed sublayer input) -> [B, Q, H]."""
        b, q_len, _ = x.shape
        dtype = x.dtype
        cos, sin = self.rope(step.positions, dtype)                        # [B, Q, rd / 2]
        k = apply_rope_interleaved(self.kv_norm(self.kv_proj(x)), cos, sin)  # [B, Q, hd]

        window = kv.pool_for(self.layer, "window")
        wpool = kv.tensor(window, self.layer)
        wpool[kv.maps[window][step.out_slots]] = k.to(wpool.dtype)
        entry_keys = None
        if self.compressor is not None:
            self._write_states_and_entries(x, step, kv)
            entry_keys = self._entry_candidates(step, kv)
        # Queries in blocks of at most QUERY_BLOCK rows (B x Q: a long chunk's queries, or many
        # prompts' of one prefill), each block from its projections to the low-rank output: the
        # logits are [block, heads, keys], and no [B, Q, heads, hd] tensor exists for the whole
        # forward (heads x hd is 8 hidden widths on Flash). A captured forward (decode, verify,
        # draft steps) is one block.
        w = self.o_a_proj.weight.view(self.o_groups, self.o_lora, -1)
        if capturing(x) or b * q_len <= QUERY_BLOCK:
            blocks = [(slice(0, b), slice(0, q_len))]
        else:
            qb = min(q_len, QUERY_BLOCK)
            bb = max(1, QUERY_BLOCK // qb)
            blocks = [(slice(b0, min(b, b0 + bb)), slice(q0, min(q_len, q0 + qb)))
                      for b0 in range(0, b, bb) for q0 in range(0, q_len, qb)]
        mixed = x.new_empty(b, q_len, self.o_groups * self.o_lora) if len(blocks) > 1 else None
        for bs, sl in blocks:
            c, s = cos[bs, sl, None], sin[bs, sl, None]
            xb = x[bs, sl]
            q_res = self.q_a_norm(self.q_a_proj(xb))
            nb, n = q_res.shape[:2]
            q = _unweighted_rms(self.q_b_proj(q_res).view(nb, n, self.heads, self.hd), self.eps)
            q = apply_rope_interleaved(q, c, s)
            out = self._attend(q, q_res, xb, step, bs, sl, kv, wpool, window, entry_keys)
            del q
            out = apply_rope_interleaved(out, c, -s)                        # [b', n, heads, hd]
            grouped = out.reshape(nb, n, self.o_groups, -1)                # [b', n, G, heads * hd / G]
            low_rank = torch.einsum("bqgi,goi->bqgo", grouped, w).reshape(nb, n, -1)
            del out, grouped
            if mixed is None:
                mixed = low_rank                                            # [B, Q, G * o_lora]
            else:
                mixed[bs, sl] = low_rank
        return self.o_b_proj(mixed)

    # -- compressor -----------------------------------------------------------------------------

    def _write_states_and_entries(self, x: torch.Tensor, step: _Step, kv: V4KV) -> None:
        comp = self.compressor
        state_name = kv.pool_for(self.layer, "state")
        spool = kv.tensor(state_name, self.layer)
        if self.kind == CSA:
            row = torch.cat([comp.project(x), comp.indexer.project(x)], -1)
        else:
            row = comp.project(x)
        spool[kv.maps[state_name][step.out_slots]] = row.to(spool.dtype)
        r = self.ratio
        closes = (step.positions + 1) % r == 0                              # [B, Q]
        span = 2 * r if self.kind == CSA else r
        path, valid = step.path[..., :span], step.path_valid[..., :span]
        if capturing(x) or closes.numel() <= 64:
            # every query (fixed shapes for the graphs); a query that closes no window writes
            # its own entry row, which nothing reads
            paths, valids = path.reshape(-1, span), valid.reshape(-1, span)
            pos, outs = step.positions.reshape(-1), step.out_slots.reshape(-1)
        else:
            sel = closes.reshape(-1).nonzero().squeeze(1)                   # only the closing ones
            paths, valids = path.reshape(-1, span)[sel], valid.reshape(-1, span)[sel]
            pos, outs = step.positions.reshape(-1)[sel], step.out_slots.reshape(-1)[sel]
        states = spool[kv.maps[state_name][paths]]                          # [N, span, width]
        hd = self.hd
        if self.kind == CSA:
            cw = 4 * hd
            entry = comp.compress(states[..., :cw], valids, pos, self.rope)
            ikey = comp.indexer.compress(states[..., cw:], valids, pos, self.rope)
            entry = torch.cat([entry, ikey], -1)
        else:
            entry = comp.compress(states, valids, pos, self.rope)
        entries_name = kv.pool_for(self.layer, "entries")
        epool = kv.tensor(entries_name, self.layer)
        epool[kv.maps[entries_name][outs]] = entry.to(epool.dtype)

    def _entry_candidates(self, step: _Step, kv: V4KV):
        slots, vis = step.entries[self.ratio]
        name = kv.pool_for(self.layer, "entries")
        return kv.tensor(name, self.layer)[kv.maps[name][slots]], vis      # [B, Ke, width], [B, Q, Ke]

    # -- attention core -------------------------------------------------------------------------

    def _attend(self, q, q_res, x, step: _Step, bs: slice, sl: slice, kv: V4KV, wpool, window, entry_keys):
        """q [b', q, heads, hd] for the rows `bs` and queries `sl` of this forward -> [b', q, heads, hd]."""
        scale = self.hd ** -0.5
        path = step.path[bs, sl, :self.window]
        wk = wpool[kv.maps[window][path]].to(q.dtype)                       # [B, q, W, hd]
        logits = [torch.einsum("bqhd,bqkd->bqhk", q, wk) * scale]
        masks = [step.path_valid[bs, sl, :self.window]]
        values = [wk]
        if entry_keys is not None:
            ent_all, vis = entry_keys
            vis = vis[bs, sl]
            ent_all = ent_all[bs].to(q.dtype)
            ent = ent_all[..., :self.hd]                                    # [B, Ke, hd]
            if self.kind == CSA:
                ix = self.compressor.indexer
                cos, sin = self.rope(step.positions[bs, sl], q.dtype)
                qi = ix.q_b_proj(q_res).view(*q_res.shape[:2], ix.heads, ix.dim)
                qi = apply_rope_interleaved(qi, cos[:, :, None], sin[:, :, None])
                ikey = ent_all[..., self.hd:]                                # [B, Ke, ihd]
                scores = F.relu(torch.einsum("bqhd,bkd->bqhk", qi.float(), ikey.float())) * ix.dim ** -0.5
                weights = ix.scorer.weights_proj(x).float() * ix.heads ** -0.5   # [B, q, ih]
                score = (scores * weights[..., None]).sum(2).masked_fill(~vis, float("-inf"))
                k = min(ix.topk, score.shape[-1])
                # Exact ties (ReLU zeros) go to the older entry: a stable sort, not topk, whose
                # order among equal scores is unspecified.
                top, idx = score.sort(dim=-1, descending=True, stable=True)
                top, idx = top[..., :k], idx[..., :k]                       # [B, q, k]
                chosen = torch.gather(ent[:, None].expand(-1, idx.shape[1], -1, -1), 2,
                                      idx[..., None].expand(-1, -1, -1, self.hd))  # [B, q, k, hd]
                logits.append(torch.einsum("bqhd,bqkd->bqhk", q, chosen) * scale)
                masks.append(top > float("-inf"))
                values.append(chosen)
            else:
                logits.append(torch.einsum("bqhd,bkd->bqhk", q, ent) * scale)
                masks.append(vis)
                values.append(ent[:, None].expand(-1, q.shape[1], -1, -1))
        lg = torch.cat(logits, -1).float()                                  # [B, q, heads, K]
        mask = torch.cat(masks, -1)[:, :, None, :]
        lg = lg.masked_fill(~mask, float("-inf"))
        sinks = self.sinks.float()[None, None, :, None].expand(*lg.shape[:3], 1)
        lg = torch.cat([lg, sinks], -1)
        lg = lg - lg.max(-1, keepdim=True).values
        p = lg.softmax(-1)[..., :-1].to(q.dtype)
        v = torch.cat(values, 2)                                            # [B, q, K, hd]
        return torch.einsum("bqhk,bqkd->bqhd", p, v)


# ---------------------------------------------------------------------------------------------
# MoE


class _Router(_KeepFloat32):
    float32_names = ("e_score_correction_bias",)

    def __init__(self, cfg: V4ModelConfig, hashed: bool):
        super().__init__()
        self.hashed = hashed
        self.top_k, self.scale = cfg.num_experts_per_tok, cfg.routed_scaling_factor
        self.score = _SCORE_FNS[cfg.scoring_func]
        self.weight = nn.Parameter(torch.zeros(cfg.num_experts, cfg.hidden_size), requires_grad=False)
        if hashed:
            self.register_buffer("tid2eid", torch.zeros(cfg.vocab_size, cfg.num_experts_per_tok, dtype=torch.int64))
        else:
            self.register_buffer("e_score_correction_bias", torch.zeros(cfg.num_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H], ids [T] -> expert ids [T, k], weights [T, k]."""
        scores = self.score(F.linear(x, self.weight))
        if self.hashed:
            idx = self.tid2eid[ids].long()
        else:
            idx = torch.topk(scores + self.e_score_correction_bias, self.top_k, dim=-1, sorted=False).indices
        w = scores.gather(1, idx)
        return idx, w / (w.sum(-1, keepdim=True) + 1e-20) * self.scale


class _Experts(nn.Module):
    """Routed experts as stacked weights (transformers' layout): gate_up_proj [E, 2I, H],
    down_proj [E, H, I] in the model dtype; or, from a quantized checkpoint (`quantize`), its codes
    as stored (FP4: e2m1 pairs int8 [E, N, K / 2] with E8M0 scale bits uint8 [E, N, K / 32]; FP8:
    e4m3 [E, N, K] with block scales [E, N / bn, K / bk]) in `<proj>` and `<proj>_scale`,
    dequantized inside the expert computation, at most EXPERT_DEQUANT_CHUNK experts' copies of
    one projection at a time (the three paths at the top of this module)."""

    def __init__(self, cfg: V4ModelConfig, tp_rank: int = 0, tp_size: int = 1):
        super().__init__()
        e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        if e % tp_size:
            raise ValueError(f"n_routed_experts={e} is not divisible by tp_size={tp_size}")
        # Expert parallelism inside the TP group: this rank holds experts [lo, lo + e / tp).
        e //= tp_size
        self.lo, self.num_local, self.tp_size = tp_rank * e, e, tp_size
        self.limit = cfg.swiglu_limit
        self.quant: str | None = None  # None | "fp4" | "fp8"
        self.block = (128, 128)
        self.gate_up_proj = nn.Parameter(torch.zeros(e, 2 * i, h), requires_grad=False)
        self.down_proj = nn.Parameter(torch.zeros(e, h, i), requires_grad=False)

    def quantize(self, kind: str, block: tuple[int, int] = (128, 128),
                 scale_dtype: torch.dtype = torch.float32) -> None:
        """Hold the codes of a `kind` ("fp4" / "fp8") checkpoint instead of model-dtype weights."""
        from specdeploy.engine.models.fp8 import E2M1_VALUES, FP4_GROUP

        self.quant, self.block, self.compute_dtype = kind, block, self.gate_up_proj.dtype
        dev = self.gate_up_proj.device
        # code byte -> (value of its low nibble, of its high one), made once: a table built during
        # a CUDA-graph capture would be a host-to-device copy, which capture forbids
        pairs = [(E2M1_VALUES[b & 0xF], E2M1_VALUES[b >> 4]) for b in range(256)]
        self.register_buffer("e2m1_pairs", torch.tensor(pairs, dtype=torch.float32, device=dev), persistent=False)
        for name in ("gate_up_proj", "down_proj"):
            e, n, k = getattr(self, name).shape
            if kind == "fp4":
                codes = torch.zeros(e, n, k // 2, dtype=torch.int8, device=dev)
                scale = torch.zeros(e, n, -(-k // FP4_GROUP), dtype=torch.uint8, device=dev)
            else:
                codes = torch.zeros(e, n, k, dtype=torch.float8_e4m3fn, device=dev)
                scale = torch.zeros(e, -(-n // block[0]), -(-k // block[1]), dtype=scale_dtype, device=dev)
            setattr(self, name, nn.Parameter(codes, requires_grad=False))
            self.register_parameter(name + "_scale", nn.Parameter(scale, requires_grad=False))

    def weight(self, name: str, experts: slice | int | torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """[.., N, K] weights of `experts` (a slice, one id, or ids [R]: one matrix per id) for
        projection `name` in `dtype`."""
        w = getattr(self, name)[experts]
        if self.quant is None:
            return w.to(dtype)
        from specdeploy.engine.models.fp8 import dequantize_fp8

        s = getattr(self, name + "_scale")[experts]
        if self.quant == "fp4":  # scales are per row: the experts' rows stack into one matrix
            shape = (*w.shape[:-1], 2 * w.shape[-1])
            return self._fp4(w.reshape(-1, w.shape[-1]), s.reshape(-1, s.shape[-1]), dtype).view(shape)
        if w.dim() == 2:
            return dequantize_fp8(w, s, self.block, dtype)
        e, n = w.shape[:2]
        if n % self.block[0] == 0:  # whole row blocks: likewise
            return dequantize_fp8(w.reshape(e * n, -1), s.reshape(-1, s.shape[-1]), self.block, dtype).view(e, n, -1)
        return torch.stack([dequantize_fp8(w[j], s[j], self.block, dtype) for j in range(e)])

    def _fp4(self, codes: torch.Tensor, bits: torch.Tensor, dtype: torch.dtype, kernel: bool = True) -> torch.Tensor:
        """Packed e2m1 [N, K / 2] (element 2j in the low nibble) with E8M0 bits [N, K / 32] ->
        [N, K] (fp8.dequantize_fp4's layout and values). On CUDA one Triton pass
        (engine/kernels/fp4.py, equal bit for bit). The torch code computes in `dtype` itself: an
        e2m1 value times a power of two is exact in bf16 as in float32, so nothing rounds, and
        the transient is the int32 code bytes and the output (4 bytes per weight in bf16)."""
        from specdeploy.engine.models.fp8 import FP4_GROUP

        n, k = codes.shape[0], 2 * codes.shape[1]
        fast = fused_kernels(codes, ops=kernels.fp4_ops) if kernel and k % FP4_GROUP == 0 else None
        if fast is not None:
            return fast.dequant_fp4(codes, bits, dtype)
        values = F.embedding(codes.view(torch.uint8).int(), self.e2m1_pairs.to(dtype)).view(n, k)
        scale = torch.exp2(bits.float() - 127.0).to(dtype)                  # [N, K / 32]
        if k % FP4_GROUP == 0:
            return values.view(n, -1, FP4_GROUP).mul_(scale[..., None]).view(n, k)
        return values.mul_(scale[..., None].expand(*scale.shape, FP4_GROUP).flatten(-2)[..., :k])

    def _act(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        if self.limit:
            gate, up = gate.clamp(max=self.limit), up.clamp(-self.limit, self.limit)
        return F.silu(gate) * up

    def path(self, x: torch.Tensor, rows: int) -> str:
        if EXPERT_PATH is not None:
            return EXPERT_PATH
        return expert_path(rows, self.num_local, self.quant is not None,
                           grouped_mm_without_sync(x.device, x.dtype), capturing(x))

    def forward(self, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """x [T, H], idx / w [T, k] (global expert ids) -> [T, H]: this rank's experts' share.
        Every path but "chunked" runs on the device alone with shapes fixed by [T, k]."""
        t, k = idx.shape
        if self.tp_size > 1:
            # Another rank's expert: weight 0, computed by local expert 0 (fixed shapes, no sync).
            local = idx - self.lo
            mine = (local >= 0) & (local < self.num_local)
            idx, w = torch.where(mine, local, 0), torch.where(mine, w, torch.zeros_like(w))
        flat = idx.reshape(-1)                                              # [R = T k]
        fused = self._fused_fp4(x)
        if fused is not None:
            return fused.fp4_moe(x.contiguous(), idx, w, (self.gate_up_proj, self.gate_up_proj_scale),
                                 (self.down_proj, self.down_proj_scale), limit=self.limit or None,
                                 gathered=None if EXPERT_PATH is None else EXPERT_PATH == "gathered")
        path = self.path(x, flat.numel())
        if path == "gathered":
            xr = x[:, None, :].expand(t, k, x.shape[-1]).reshape(t * k, -1, 1)  # [R, H, 1]
            ys = torch.cat([self._gathered(xr[r0:r0 + EXPERT_DEQUANT_CHUNK], flat[r0:r0 + EXPERT_DEQUANT_CHUNK])
                            for r0 in range(0, t * k, EXPERT_DEQUANT_CHUNK)])       # [R, H]
            return (ys.view(t, k, -1) * w[..., None].to(ys.dtype)).sum(1)
        order = torch.argsort(flat, stable=True)                            # rows by expert
        token = order // k
        xs = x[token]                                                       # [R, H] by expert
        e = self.num_local
        if path == "grouped":
            # rows per expert by scatter_add (bincount would sync for its length), ends as int32
            counts = torch.zeros(e, dtype=torch.int32, device=x.device).scatter_add_(
                0, flat, torch.ones_like(flat, dtype=torch.int32))
            offs = counts.cumsum(0).to(torch.int32)                         # [E] on the device
            if self.quant is None:
                ys = self._grouped(xs, slice(0, e), offs)
            else:  # dequantized EXPERT_DEQUANT_CHUNK experts at a time: rows outside a chunk add zero
                ys = torch.zeros_like(xs)
                for c0 in range(0, e, EXPERT_DEQUANT_CHUNK):
                    c1 = min(e, c0 + EXPERT_DEQUANT_CHUNK)
                    ys += self._grouped(xs, slice(c0, c1), offs, chunk=(c0, c1))
        else:
            sorted_ids = flat[order]
            ys = torch.empty_like(xs)
            bounds = torch.searchsorted(sorted_ids, torch.arange(e + 1, device=x.device)).tolist()  # host sync
            fast = grouped_mm_without_sync(x.device, x.dtype)
            for c0 in range(0, e, EXPERT_DEQUANT_CHUNK):
                c1 = min(e, c0 + EXPERT_DEQUANT_CHUNK)
                lo, hi = bounds[c0], bounds[c1]
                if hi == lo:
                    continue
                if fast:
                    ends = torch.tensor(bounds[c0 + 1:c1 + 1], dtype=torch.int32) - lo
                    ys[lo:hi] = self._grouped(xs[lo:hi], slice(c0, c1), ends.to(x.device))
                    continue
                for ex in range(c0, c1):
                    a, b = bounds[ex], bounds[ex + 1]
                    if b > a:
                        h = self._act(F.linear(xs[a:b], self.weight("gate_up_proj", ex, x.dtype)))
                        ys[a:b] = F.linear(h, self.weight("down_proj", ex, x.dtype))
        ys = ys * w.reshape(-1)[order, None].to(ys.dtype)
        return torch.zeros_like(x).index_add_(0, token, ys)

    def _fused_fp4(self, x: torch.Tensor):
        """engine/kernels/fp4_moe.py where it applies (FP4 codes, bf16 on CUDA, K a multiple of a
        scale group in both projections), else None."""
        from specdeploy.engine.models.fp8 import FP4_GROUP

        if self.quant != "fp4" or not FP4_FUSED_MOE or x.dtype != torch.bfloat16:
            return None
        if (2 * self.gate_up_proj.shape[-1]) % FP4_GROUP or (2 * self.down_proj.shape[-1]) % FP4_GROUP:
            return None
        return fused_kernels(x, ops=kernels.fp4_moe_ops)

    def _gathered(self, xr: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """xr [r, H, 1] rows, ids [r] their experts -> [r, H]: r <= EXPERT_DEQUANT_CHUNK expert copies."""
        h = self._act(torch.bmm(self.weight("gate_up_proj", ids, xr.dtype), xr)[..., 0])  # [r, I]
        return torch.bmm(self.weight("down_proj", ids, xr.dtype), h[..., None])[..., 0]

    def _grouped(self, xs: torch.Tensor, experts: slice, offs: torch.Tensor, chunk=None) -> torch.Tensor:
        """Rows xs [R, H] sorted by expert, offs [E'] the ends of the experts' groups -> [R, H]
        through the experts `experts` (one grouped GEMM per projection). chunk (c0, c1): offs
        covers every expert and only the rows of experts c0 .. c1 - 1 come out, the others zero:
        they are zeroed on the way in (the chunk's first expert takes the rows before its group,
        its last the rows after) and dropped on the way out, with device-side bounds."""
        dtype = xs.dtype
        inside = None
        if chunk is not None:
            c0, c1 = chunk
            r = torch.arange(xs.shape[0], device=xs.device)
            inside = ((r >= offs[c0 - 1]) if c0 else True) & (r < offs[c1 - 1])   # [R]
            xs = torch.where(inside[:, None], xs, 0)
            offs = torch.cat([offs[c0:c1 - 1], offs.new_full((1,), xs.shape[0])])
        up = self.weight("gate_up_proj", experts, dtype)                    # [E', 2I, H]
        h = self._act(F.grouped_mm(xs, up.transpose(1, 2), offs=offs))
        del up  # the dequantized gate/up copy goes before the down projection's comes
        out = F.grouped_mm(h, self.weight("down_proj", experts, dtype).transpose(1, 2), offs=offs)
        return out if inside is None else torch.where(inside[:, None], out, 0)


class _SharedExpert(nn.Module):
    def __init__(self, cfg: V4ModelConfig):
        super().__init__()
        h, i = cfg.hidden_size, cfg.moe_intermediate_size * max(cfg.num_shared_experts, 1)
        self.limit = cfg.swiglu_limit
        self.gate_proj = ColumnParallelLinear(h, i, False)
        self.up_proj = ColumnParallelLinear(h, i, False)
        self.down_proj = ColumnParallelLinear(i, h, False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_proj(x), self.up_proj(x)
        if self.limit:
            gate, up = gate.clamp(max=self.limit), up.clamp(-self.limit, self.limit)
        return self.down_proj(F.silu(gate) * up)


class V4MoE(nn.Module):
    """Router and shared expert replicated on every TP rank, routed experts split across them:
    each rank adds its experts' share and one all-reduce sums the shares."""

    def __init__(self, cfg: V4ModelConfig, layer: int, tp_rank: int = 0, tp_size: int = 1):
        super().__init__()
        self.tp_size = tp_size
        self.gate = _Router(cfg, cfg.v4.mlp_kinds[layer] == HASH_MOE)
        self.experts = _Experts(cfg, tp_rank, tp_size)
        self.shared_experts = _SharedExpert(cfg)

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        idx, w = self.gate(flat, ids.reshape(-1))
        routed = self.experts(flat, idx, w)
        if self.tp_size > 1:
            from specdeploy.engine import parallel

            routed = parallel.all_reduce(routed)
        return (routed + self.shared_experts(flat)).view_as(x)


# ---------------------------------------------------------------------------------------------
# blocks and the model


class V4DecoderLayer(nn.Module):
    def __init__(self, cfg: V4ModelConfig, layer: int, tp_rank: int = 0, tp_size: int = 1):
        super().__init__()
        self.self_attn = V4Attention(cfg, layer)
        self.mlp = V4MoE(cfg, layer, tp_rank, tp_size)
        self.input_layernorm = V4RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = V4RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn_hc = make_residual(cfg.hc)
        self.ffn_hc = make_residual(cfg.hc)

    def forward(self, streams: torch.Tensor, step: _Step, kv: V4KV) -> torch.Tensor:
        """streams [B, Q, hc, H] -> [B, Q, hc, H]."""
        streams = self.attn_hc(streams, lambda h: self.self_attn(self.input_layernorm(h), step, kv))
        return self.ffn_hc(streams, lambda h: self.mlp(self.post_attention_layernorm(h), step.input_ids))


@dataclass
class TargetOutput:
    hidden: torch.Tensor          # [B, Q, H] after hc_head and the final norm
    feature: torch.Tensor | None  # [B, Q, hc * H]: the streams before hc_head (the MTP input)


class DeepseekV4Model(nn.Module):
    """The target: same calling convention as LlamaModel (forward(ids, positions, batch, kv))."""

    kv_layout = OWN_POOLS   # models/protocol.py: make_kv

    def __init__(self, cfg: V4ModelConfig, feature_kind: str | None = None, tp_rank: int = 0, tp_size: int = 1):
        super().__init__()
        if cfg.hc_mult < 2:
            raise ValueError("DeepSeek-V4 needs hc_mult >= 2")
        self.cfg = cfg
        # Tensor parallel: attention, embeddings, norms and the shared experts replicated (one
        # shared K=V head), the routed experts split (expert parallelism inside the TP group).
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(V4DecoderLayer(cfg, i, tp_rank, tp_size) for i in range(cfg.num_layers))
        self.norm = V4RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hc_head = HyperHead(cfg.hc)
        self.lm_head = ParallelLMHead(cfg.hidden_size, cfg.vocab_size)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.aux_layers = ()
        self.set_feature(feature_kind)

    def set_feature(self, feature_kind: str | None, aux_layers=None) -> None:
        if feature_kind not in (None, "mtp", "eagle"):
            raise ValueError(f"DeepSeek-V4 feeds MTP (or EAGLE) drafts, not {feature_kind!r}")
        self.feature_kind = feature_kind

    @property
    def feature_size(self) -> int:
        return self.cfg.spec_hidden_size

    def make_kv(self, num_slots: int, max_total_tokens: int, max_running_requests: int,
                in_flight_rows: int, dtype: torch.dtype, device) -> V4KV:
        return V4KV(self.cfg.v4, "target", num_slots, max_total_tokens, max_running_requests,
                    in_flight_rows, dtype, device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttnBatch,
                kv: V4KV) -> TargetOutput:
        step = _build_step(self.cfg.v4, self.cfg.v4.layers("target"), input_ids, positions, batch, kv)
        x = expand_embeddings(self.embed_tokens(input_ids), self.cfg.hc_mult)  # [B, Q, hc, H]
        for layer in self.layers:
            x = layer(x, step, kv)
        hidden = self.norm(self.hc_head(x))
        return TargetOutput(hidden, flatten_streams(x) if self.feature_kind else None)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def logits_from_feature(self, feature: torch.Tensor) -> torch.Tensor:
        return self.logits(self.norm(self.hc_head(unflatten_streams(feature, self.cfg.hc_mult))))


def build_target(cfg: V4ModelConfig, dtype: torch.dtype, device, feature_kind: str | None = None,
                 tp_rank: int = 0, tp_size: int = 1) -> DeepseekV4Model:
    with torch.device(device):
        model = DeepseekV4Model(cfg, feature_kind, tp_rank, tp_size)
    return model.to(dtype).eval()


def canonical_v4_key(name: str) -> str:
    """A transformers-layout checkpoint name -> this module's name (`model.` dropped, the
    hyper-connection names of engine/models/hc.py)."""
    return canonical_hc_key(name.removeprefix("model."))


# ---------------------------------------------------------------------------------------------
# the MTP draft


class DeepseekV4MTP(DraftHead):
    """DeepSeek-V4's next-token-prediction layer as the draft, consuming and emitting the
    target's hc_mult streams flattened, [.., hc * H] (spec_hidden_size):

        streams = e_proj(enorm(embed(token j + 1))) (to every stream) + h_proj(hnorm(streams at j))
        streams = the MTP decoder block (its own attention kind and MoE, mHC residual)
        logits  = lm_head(norm(hc_head(streams)))                 (the target's embed / lm_head)

    The published checkpoint's first MTP layer (mtp.0.*) drafts every step (multi-step drafting
    feeds the layer its own streams); further MTP layers of a config are not used."""

    algorithm = "MTP"
    kv_layout = OWN_POOLS   # models/protocol.py: make_kv

    def __init__(self, target: DeepseekV4Model):
        super().__init__()
        cfg = target.cfg
        if cfg.v4.num_nextn_predict_layers < 1:
            raise ValueError("num_nextn_predict_layers: 0, the model has no MTP layer to draft with")
        self.cfg = cfg
        h = cfg.hidden_size
        self.layer_index = cfg.v4.num_hidden_layers                       # mtp.0 follows the decoder stack
        self.hc_mult = cfg.hc_mult
        self.input_size = self.carried_size = cfg.spec_hidden_size
        self.draft_vocab_size = cfg.vocab_size
        self.enorm = V4RMSNorm(h, cfg.rms_norm_eps)
        self.hnorm = V4RMSNorm(h, cfg.rms_norm_eps)
        self.e_proj = ColumnParallelLinear(h, h, False)
        self.h_proj = ColumnParallelLinear(h, h, False)
        self.layers = nn.ModuleList([V4DecoderLayer(cfg, self.layer_index, target.tp_rank, target.tp_size)])
        self.hc_head = HyperHead(cfg.hc)
        self.norm = V4RMSNorm(h, cfg.rms_norm_eps)
        self.bind_target(target)

    def make_kv(self, num_slots: int, max_total_tokens: int, max_running_requests: int,
                in_flight_rows: int, dtype: torch.dtype, device) -> V4KV:
        return V4KV(self.cfg.v4, "MTP", num_slots, max_total_tokens, max_running_requests,
                    in_flight_rows, dtype, device)

    def num_kv_layers(self) -> int:
        return 1

    def forward(self, input_ids, hidden, positions, batch: AttnBatch, kv: V4KV) -> torch.Tensor:
        target = self.__dict__["target"]
        e = self.enorm(target.embed_tokens(input_ids))                      # [B, Q, H]
        streams = unflatten_streams(hidden.to(e.dtype), self.hc_mult)       # [B, Q, hc, H]
        x = expand_embeddings(self.e_proj(e), self.hc_mult) + self.h_proj(self.hnorm(streams))
        step = _build_step(self.cfg.v4, self.cfg.v4.layers("MTP")[:1], input_ids, positions, batch, kv)
        return flatten_streams(self.layers[0](x, step, kv))

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        return self.__dict__["target"].logits(self.norm(self.hc_head(unflatten_streams(out, self.hc_mult))))


def build_mtp(target: DeepseekV4Model, dtype: torch.dtype, device) -> DeepseekV4MTP:
    with torch.device(device):
        head = DeepseekV4MTP(target)
    return head.to(dtype).eval()
