"""Llama-family target model (Llama 3.x, Qwen2, Qwen3, Mistral) over the slot pool.

One `forward` takes a dense [B, Q] rectangle of tokens, writes their K/V into the pool and
returns the final hidden state plus the feature the draft head consumes:
- EAGLE: the last hidden state (post-norm for hc_mult = 1; the flattened residual streams
  [.., hc_mult * H] for hc_mult > 1), width spec_hidden_size;
- EAGLE-3: the outputs of three layers concatenated, [.., 3 * H];
- MTP: the pre-norm last hidden state / flattened streams, width spec_hidden_size.
With hc_mult > 1 every block carries hc_mult residual streams (engine/models/hc.py).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from dataclasses import dataclass, field

import torch
from torch import nn

from specdeploy.engine.models.attention import FP8_KV_DTYPE, AttnBatch, attend, store_kv
from specdeploy.engine.models.fp8 import convert_fp8_linears, fp8_format, ignored_tensor
from specdeploy.engine.models.checkpoint import Checkpoint
from specdeploy.engine.models.hc import (HCConfig, HyperHead, PlainResidual, canonical_hc_key,
                                  expand_embeddings, flatten_streams, make_residual,
                                  unflatten_streams)
from specdeploy.engine.memory.kv import KVPool
from specdeploy.engine.models.protocol import SLOT_ROWS
from specdeploy.engine.models.layers import (GatedMLP, MergedColumnParallelLinear, ParallelLMHead,
                                      RMSNorm, RowParallelLinear, VocabParallelEmbedding,
                                      apply_rope, fused_kernels, kv_head_range,
                                      load_state, register_fused_parts, rope_inv_freq)

log = logging.getLogger("specdeploy.engine.load")

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")
FEATURE_KINDS = ("eagle", "eagle3", "mtp")


@dataclass
class ModelConfig:
    model_type: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    hc_mult: int = 1
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    raw: dict = field(default_factory=dict, repr=False)

    @property
    def spec_hidden_size(self) -> int:
        return self.hidden_size * self.hc_mult

    @property
    def hc(self) -> HCConfig:
        return HCConfig(self.hidden_size, self.hc_mult, self.hc_sinkhorn_iters, self.hc_eps,
                        self.rms_norm_eps)

    @classmethod
    def from_hf(cls, config: dict, allow_any_type: bool = False) -> "ModelConfig":
        cfg = config.get("text_config", config)
        model_type = cfg.get("model_type", config.get("model_type", "llama"))
        if model_type not in SUPPORTED_MODEL_TYPES and not allow_any_type:
            raise ValueError(f"model_type {model_type!r} is not supported by the Llama-family "
                             f"implementation (supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
        for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size",
                    "intermediate_size"):
            if key not in cfg:
                raise ValueError(f"config.json lacks {key!r}")
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        scaling = None if rope.get("rope_type", rope.get("type", "default")) == "default" else rope
        attn_bias = bool(cfg.get("attention_bias", False))
        return cls(
            model_type=model_type,
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            vocab_size=int(cfg["vocab_size"]),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            # Qwen2 always has q/k/v biases and no o_proj bias; Llama's attention_bias covers all four.
            qkv_bias=True if model_type == "qwen2" else attn_bias,
            o_bias=False if model_type == "qwen2" else attn_bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=model_type == "qwen3",
            tie_word_embeddings=bool(config.get("tie_word_embeddings",
                                                cfg.get("tie_word_embeddings", False))),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            hc_mult=int(cfg.get("hc_mult", 1) or 1),
            hc_sinkhorn_iters=int(cfg.get("hc_sinkhorn_iters", 20)),
            hc_eps=float(cfg.get("hc_eps", 1e-6)),
            raw=cfg,
        )


def default_aux_layers(num_layers: int) -> tuple[int, int, int]:
    """Layers whose outputs feed an EAGLE-3 head by default: an early, a middle and a late one
    (the same choice as the published EAGLE-3 heads were trained with)."""
    if num_layers < 5:
        raise ValueError(f"EAGLE-3 needs at least 5 target layers for its default aux layers, "
                         f"got {num_layers}; pass aux_layers explicitly")
    return (1, num_layers // 2 - 1, num_layers - 4)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, in_features: int | None = None,
                 tp_rank: int = 0, tp_size: int = 1):
        super().__init__()
        if cfg.num_heads % tp_size:
            raise ValueError(f"num_heads={cfg.num_heads} is not divisible by tp_size={tp_size}")
        in_features = in_features or cfg.hidden_size
        self.head_dim = cfg.head_dim
        d = cfg.head_dim
        kv_lo, kv_hi = kv_head_range(cfg.num_kv_heads, tp_rank, tp_size)
        self.local_heads = cfg.num_heads // tp_size
        self.local_kv_heads = kv_hi - kv_lo
        self.scale = cfg.head_dim ** -0.5
        # q, k and v in one matmul (checkpoint names q_proj/k_proj/v_proj); each is sharded by
        # heads on its own, so a rank's slice is [its q heads; its kv heads; its kv heads]
        # (with fewer kv heads than ranks, the one kv head its q heads read).
        kv_rows = (kv_lo * d, kv_hi * d)
        self.qkv_proj = MergedColumnParallelLinear(
            in_features, (cfg.num_heads * d, cfg.num_kv_heads * d, cfg.num_kv_heads * d),
            cfg.qkv_bias, tp_rank, tp_size, part_rows=(None, kv_rows, kv_rows))
        register_fused_parts(self, {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1),
                                    "v_proj": ("qkv_proj", 2)})
        self.o_proj = RowParallelLinear(cfg.num_heads * d, cfg.hidden_size, cfg.o_bias, tp_rank, tp_size)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps)
        # An FP8 KV pool's per-layer scales: the checkpoint's k_scale / v_scale where it ships
        # them (compressed-tensors kv_cache_scheme), else 1. Buffers so that load_state fills them,
        # not persistent so that checkpoints without them load; `kv_scales` holds them as floats
        # (set by load_target), which a CUDA graph can capture without a host sync.
        self.register_buffer("k_scale", torch.ones((), dtype=torch.float32), persistent=False)
        self.register_buffer("v_scale", torch.ones((), dtype=torch.float32), persistent=False)
        self.kv_scales = (1.0, 1.0)

    def load_param(self, name: str, full: torch.Tensor) -> None:
        """k_scale / v_scale, stored as [] or [1]."""
        with torch.no_grad():
            getattr(self, name).copy_(full.float().reshape(()))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, batch: AttnBatch) -> torch.Tensor:
        """x [B, Q, in]; cos/sin [B, Q, D]; caches [slots, Hkv_local, D] -> [B, Q, H]."""
        b, q_len, _ = x.shape
        hq, hkv, d = self.local_heads, self.local_kv_heads, self.head_dim
        qkv = self.qkv_proj(x)                                          # [B, Q, (Hq + 2 Hkv) D]
        # CUDA inference: rope on q and k and both K/V writes in one kernel (a power-of-two
        # head size, no q/k norm in between); elsewhere the torch code below.
        # An e4m3 pool holds codes of K / k_scale and V / v_scale, saturated (store_kv).
        fp8_kv = k_cache.dtype == FP8_KV_DTYPE
        fused = None if hasattr(self, "q_norm") or d & (d - 1) else fused_kernels(qkv)
        if fused is not None:
            q = fused.rope_store(qkv, cos, sin, k_cache, v_cache, batch.out_slots, hq, hkv, self.kv_scales)
        else:
            v = qkv[..., (hq + hkv) * d:].view(b, q_len, hkv, d)
            if hasattr(self, "q_norm"):
                q, k, _ = self.qkv_proj.split(qkv)
                q = apply_rope(self.q_norm(q.view(b, q_len, hq, d)), cos, sin)
                k = apply_rope(self.k_norm(k.view(b, q_len, hkv, d)), cos, sin)
            else:
                # q and k sit side by side in the fused output: rotate all their heads at once.
                qk = apply_rope(qkv[..., :(hq + hkv) * d].view(b, q_len, hq + hkv, d), cos, sin)
                q, k = qk.split((hq, hkv), dim=2)                       # [B, Q, Hq | Hkv, D]
            k_cache[batch.out_slots] = store_kv(k, k_cache.dtype, self.kv_scales[0])
            v_cache[batch.out_slots] = store_kv(v, v_cache.dtype, self.kv_scales[1])
        out = attend(q, k_cache, v_cache, batch, self.scale, self.kv_scales if fp8_kv else None)
        return self.o_proj(out.reshape(b, q_len, -1))


class DecoderLayer(nn.Module):
    """Pre-norm block. hc_mult = 1: x [B, Q, H] plain residual. hc_mult > 1: x [B, Q, hc, H]
    residual streams, collapsed before each sublayer and expanded back after it."""

    def __init__(self, cfg: ModelConfig, tp_rank: int = 0, tp_size: int = 1,
                 input_norm: bool = True):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if input_norm else nn.Identity()
        self.self_attn = Attention(cfg, None, tp_rank, tp_size)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias, tp_rank, tp_size)
        # hc_mult = 1: PlainResidual (x + F(x)); hc_mult > 1: HyperConnection over the streams.
        self.attn_hc = make_residual(cfg.hc)
        self.ffn_hc = make_residual(cfg.hc)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, batch: AttnBatch) -> torch.Tensor:
        if self.plain:
            residual, delta = self.forward_plain(x, None, cos, sin, k_cache, v_cache, batch)
            return residual + delta
        x = self.attn_hc(x, lambda h: self.self_attn(self.input_layernorm(h), cos, sin,
                                                     k_cache, v_cache, batch))
        return self.ffn_hc(x, lambda h: self.mlp(self.post_attention_layernorm(h)))

    @property
    def plain(self) -> bool:
        return isinstance(self.attn_hc, PlainResidual)

    def forward_plain(self, residual: torch.Tensor, delta: torch.Tensor | None, cos, sin,
                      k_cache, v_cache, batch) -> tuple[torch.Tensor, torch.Tensor]:
        """hc_mult = 1 block on a residual left unsummed: its input is residual + delta (delta
        None: residual alone), its output (residual', mlp output) sums to the block's output.
        Each residual add is done by the norm that follows it (one kernel on CUDA), the last one
        by the next block or the final norm."""
        if delta is None:
            h = self.input_layernorm(residual)
        else:
            residual, h = self.input_layernorm.add_forward(residual, delta)
        attn = self.self_attn(h, cos, sin, k_cache, v_cache, batch)
        residual, h = self.post_attention_layernorm.add_forward(residual, attn)
        return residual, self.mlp(h)


def rope_tables(inv_freq: torch.Tensor, positions: torch.Tensor,
                dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [B, Q] -> cos, sin [B, Q, D], computed in float32 and then cast to `dtype` (as
    the reference implementations cast them to the activations' dtype); computed per call: no
    table sized by the model's maximum context."""
    freqs = positions.to(torch.float32)[..., None] * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


@dataclass
class TargetOutput:
    hidden: torch.Tensor          # [B, Q, H] final hidden after the norm (feeds lm_head)
    feature: torch.Tensor | None  # [B, Q, Hin] what the draft head consumes, None without a draft


class LlamaModel(nn.Module):
    kv_layout = SLOT_ROWS   # models/protocol.py: the runner allocates its KVPool

    def __init__(self, cfg: ModelConfig, feature_kind: str | None = None,
                 aux_layers: tuple[int, ...] | None = None, tp_rank: int = 0, tp_size: int = 1):
        super().__init__()
        if feature_kind not in (None, *FEATURE_KINDS):
            raise ValueError(f"feature_kind {feature_kind!r} not in {FEATURE_KINDS}")
        self.cfg = cfg
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp_rank, tp_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, tp_rank, tp_size) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.hc_mult > 1:
            self.hc_head = HyperHead(cfg.hc)
        self.lm_head = ParallelLMHead(cfg.hidden_size, cfg.vocab_size, tp_rank, tp_size)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.register_buffer("inv_freq", rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling),
                             persistent=False)
        self.set_feature(feature_kind, aux_layers)

    def set_feature(self, feature_kind: str | None, aux_layers: tuple[int, ...] | None = None) -> None:
        self.feature_kind = feature_kind
        self.aux_layers = ()
        if feature_kind == "eagle3":
            self.aux_layers = tuple(aux_layers) if aux_layers else default_aux_layers(self.cfg.num_layers)
            bad = [i for i in self.aux_layers if not 0 <= i < self.cfg.num_layers]
            if len(self.aux_layers) != 3 or bad:
                raise ValueError(f"EAGLE-3 needs 3 aux layer ids in [0, {self.cfg.num_layers}), "
                                 f"got {self.aux_layers}")

    @property
    def feature_size(self) -> int:
        """Width of `TargetOutput.feature`: the draft input hidden size."""
        if self.feature_kind == "eagle3":
            return 3 * self.cfg.hidden_size
        return self.cfg.spec_hidden_size

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttnBatch,
                kv: KVPool) -> TargetOutput:
        """input_ids, positions [B, Q] -> TargetOutput."""
        x = self.embed_tokens(input_ids)                                  # [B, Q, H]
        hc_mult = self.cfg.hc_mult
        if hc_mult > 1:
            x = expand_embeddings(x, hc_mult)                             # [B, Q, hc, H]
        # cos/sin cast once to the activations' dtype, not in every layer's rope.
        cos, sin = rope_tables(self.inv_freq, positions, self.embed_tokens.weight.dtype)
        aux = {}
        if hc_mult == 1:
            # Residual stream kept as (residual, delta) across blocks: every add happens inside
            # the norm after it (engine/models/layers.py RMSNorm.add_forward).
            delta = None
            for i, layer in enumerate(self.layers):
                x, delta = layer.forward_plain(x, delta, cos, sin, kv.k[i], kv.v[i], batch)
                if i in self.aux_layers:
                    aux[i] = x + delta                                    # [B, Q, H]
            prenorm, hidden = self.norm.add_forward(x, delta)
        else:
            for i, layer in enumerate(self.layers):
                x = layer(x, cos, sin, kv.k[i], kv.v[i], batch)
                if i in self.aux_layers:
                    # EAGLE-3 consumes 3 x hidden_size; the streams' mean stands for the layer.
                    aux[i] = x.mean(dim=2)
            prenorm = x
            hidden = self.norm(self.hc_head(x))                           # [B, Q, H]
        if self.feature_kind is None:
            feature = None
        elif self.feature_kind == "eagle3":
            feature = torch.cat([aux[i] for i in self.aux_layers], dim=-1)  # [B, Q, 3H]
        elif hc_mult > 1:
            feature = flatten_streams(prenorm)                            # [B, Q, hc * H]
        else:
            feature = hidden if self.feature_kind == "eagle" else prenorm
        return TargetOutput(hidden, feature)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., H] (post-norm) -> [..., vocab] in float32 (whole vocabulary on every rank)."""
        return self.lm_head(hidden).float()

    def logits_from_feature(self, feature: torch.Tensor) -> torch.Tensor:
        """Logits from a spec_hidden_size-wide pre-norm state (flattened streams when hc_mult > 1):
        how MTP and hc-target EAGLE heads reach the shared lm_head."""
        if self.cfg.hc_mult > 1:
            feature = self.hc_head(unflatten_streams(feature, self.cfg.hc_mult))
        return self.logits(self.norm(feature))


def read_config(path: str) -> dict:
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise FileNotFoundError(f"{path} has no config.json")
    with open(cfg_path) as f:
        return json.load(f)


def _is_mtp(name: str) -> bool:
    return name.removeprefix("model.").startswith("mtp.")


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    """torch's default dtype set to `dtype` (a floating dtype) for the block."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def random_init_(module: nn.Module, seed: int, std: float = 0.02) -> None:
    """Random weights in place, where the module lives: N(0, std) matrices, norms 1 (engine serve
    --random-weights: real shapes without their checkpoint; the text is noise)."""
    g = torch.Generator(device=next(module.parameters()).device).manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            elif p.is_floating_point() and p.element_size() > 1:
                p.normal_(0.0, std, generator=g)


def build_target(cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str,
                 feature_kind: str | None = None, aux_layers=None,
                 tp_rank: int = 0, tp_size: int = 1) -> LlamaModel:
    # Parameters are allocated in `dtype` from the start: a float32 model cast afterwards would
    # need twice the final memory (a 70B shard at TP 2 is 70 GiB in bf16, 141 GiB in float32).
    with torch.device(device), default_dtype(dtype):
        model = LlamaModel(cfg, feature_kind, aux_layers, tp_rank, tp_size)
    model.to(dtype)  # hyper-connection mixers keep float32 (engine/models/hc.py)
    # Rotary frequencies are recomputed in float32 rather than cast back: a round trip through
    # bf16 shifts them by up to 0.3%, and the angle error grows with position.
    model.inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling).to(model.inv_freq.device)
    return model.eval()


def check_against_shapes(cfg: ModelConfig, config: dict) -> None:
    """The planner reads the same config.json through shapes.derive_shapes; the model it sizes
    memory for must be the model built here."""
    from specdeploy.engine.planner.shapes import derive_shapes

    # Only dimensions are compared; the dtype argument just satisfies configs that name none.
    shapes = derive_shapes(config, role="target", dtype="bfloat16")
    for name in ("hidden_size", "hc_mult", "spec_hidden_size", "num_layers", "num_heads",
                 "num_kv_heads", "head_dim", "vocab_size"):
        ours, planned = getattr(cfg, name), getattr(shapes, name)
        if ours != planned:
            raise ValueError(f"config.json read two ways: {name} is {ours} for the model but "
                             f"{planned} for the plan (shapes.derive_shapes)")


def load_target(path: str, dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cpu",
                feature_kind: str | None = None, aux_layers=None,
                tp_rank: int = 0, tp_size: int = 1) -> LlamaModel:
    """Build the target from an HF directory (config.json + weights in any published layout,
    engine/models/checkpoint.py; HF weight names), each tensor cast into the parameter's dtype."""
    raw = read_config(path)
    cfg = ModelConfig.from_hf(raw)
    check_against_shapes(cfg, raw)
    model = build_target(cfg, dtype, device, feature_kind, aux_layers, tp_rank, tp_size)
    checkpoint = Checkpoint(path)
    fmt = fp8_format(raw)
    if fmt is not None:
        # The linears the checkpoint stores in FP8 become e4m3 codes + scales (engine/models/fp8.py);
        # embeddings, norms and lm_head keep `dtype` unless the checkpoint quantized them too.
        names = {canonical_hc_key(n.removeprefix("model.")) for n in checkpoint.names() if not _is_mtp(n)}
        converted = convert_fp8_linears(model, fmt, names)
        log.info("fp8: %d linears from %s %s checkpoint weights", len(converted), fmt.scheme, fmt.scale_name)
    # The MTP layer some targets ship (mtp.*) is the draft's: not read here.
    # Under tensor parallelism each rank reads only its slices (lazy sources).
    pairs = checkpoint.sources(skip=_is_mtp) if tp_size > 1 else checkpoint.tensors(skip=_is_mtp)
    tensors = ((canonical_hc_key(name.removeprefix("model.")), t) for name, t in pairs)
    load_state(model, tensors, ignore=("rotary_emb.inv_freq", *ignored_tensor(fmt)))
    set_kv_scales(model)
    return model


def set_kv_scales(model: nn.Module) -> None:
    """Every attention's k_scale / v_scale buffers, as the floats its forward uses."""
    for module in model.modules():
        if isinstance(module, Attention):
            module.kv_scales = (float(module.k_scale), float(module.v_scale))
