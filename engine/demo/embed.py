"""A small trained Llama target and its EAGLE head, embedded exactly into a larger shape.

What speculation buys depends on what a step costs, and a step of the 55 M demo target costs
kernel launches, not bytes: its speed-up says little about an 8B model. Here the trained pair is
written into models of the large shape (Llama-3.1-8B: 32 layers x 4096, 32 query / 8 KV heads of
128, MLP 14336, vocabulary 128256) that compute the same function, so that every step reads
the large model's bytes while the acceptance is the trained head's:

- width: every small hidden vector sits in the first Hs of the Hb dims, the rest stay 0 (every
  projection that writes the residual stream writes 0 there);
- RMSNorm: the mean of squares over Hb dims is Hs / Hb of the mean over the real ones, so the
  norm weights are scaled by sqrt(Hs / Hb) and eps by Hs / Hb, which gives the small norm's
  output exactly;
- heads: small query head h of KV group g becomes query head g * (Qb / Kb) + h mod (Qs / Ks) of
  KV head g; head dim e goes to dim r e (e < hs / 2) or r (e - hs / 2) + hb / 2 (r = hb / hs), so
  that rotary pairs (e, e + hs / 2) land on big pairs with the same frequency (same rope_theta,
  no rope scaling); q is scaled by sqrt(hb / hs) for the 1 / sqrt(head_dim) of the softmax; the
  other query heads have zero q (uniform attention) and zero o_proj columns, the other KV heads
  zero k and v;
- MLP: gate/up rows and down columns past the small intermediate size are 0;
- layers: the small layers are spread over the big stack; the others ("extra" layers) have
  random q/k/v/gate/up (their attention and MLP run for real) and zero o_proj and down_proj, so
  they add exactly 0 to the residual stream;
- vocabulary: the small tokens are the first Vs ids; the other rows of the embedding and the LM
  head are 0, so their logits are exactly 0 (greedy picks one only where every real logit is
  below 0, which `real_logits_below_zero` counts; sampling would give them mass, so the
  end-to-end run is greedy);
- EAGLE-1 head: its fc reads [embedding; feature] with both halves padded the same way, its
  decoder layer(s) as above; it shares the big target's embedding and LM head.

In float32 the big model's logits over the small vocabulary equal the small model's to rounding
(tests/engine/demo/test_embed.py); in bfloat16 the longer sums round differently, as any second
implementation of a model does.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from specdeploy.engine.models.draft import EagleHead, build_draft
from specdeploy.engine.models.llama import LlamaModel, ModelConfig, build_target

# Llama-3.1-8B's shape (config.json of meta-llama/Llama-3.1-8B-Instruct); bench/common.py holds
# the same numbers as the HF config dict the benchmarks build random models from.
LLAMA_31_8B_SHAPE = {"hidden_size": 4096, "intermediate_size": 14336, "num_layers": 32,
                     "num_heads": 32, "num_kv_heads": 8, "head_dim": 128, "vocab_size": 128256}
_EXTRA_STD = 0.02


def embedded_config(small: ModelConfig, shape: dict) -> ModelConfig:
    """The big model's config: `shape`'s sizes, the small model's rope (no scaling), eps scaled
    by Hs / Hb, untied embeddings (the big LM head is its own tensor, as Llama-3.1-8B's)."""
    big = dataclasses.replace(small, **shape, tie_word_embeddings=False, raw={},
                              rms_norm_eps=small.rms_norm_eps * small.hidden_size / shape["hidden_size"])
    _check_fits(small, big)
    return big


def _check_fits(s: ModelConfig, b: ModelConfig) -> None:
    problems = []
    for name in ("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "vocab_size"):
        if getattr(b, name) < getattr(s, name):
            problems.append(f"{name} {getattr(b, name)} < {getattr(s, name)}")
    if b.head_dim % s.head_dim or s.head_dim % 2:
        problems.append(f"head_dim {b.head_dim} is not a multiple of {s.head_dim}")
    if s.num_heads // s.num_kv_heads > b.num_heads // b.num_kv_heads:
        problems.append("the small model's query groups are larger than the big one's")
    if s.rope_scaling is not None or s.hc_mult != 1 or s.qkv_bias or s.o_bias or s.mlp_bias or s.qk_norm:
        problems.append("only plain Llama blocks embed (no rope scaling, biases, q/k norm or hc_mult)")
    if problems:
        raise ValueError("cannot embed: " + "; ".join(problems))


class _Maps:
    """Index maps from the small model's q/k/v rows and o_proj columns into the big one's."""

    def __init__(self, s: ModelConfig, b: ModelConfig, device):
        hs, hb = s.head_dim, b.head_dim
        r = hb // hs
        e = torch.arange(hs, device=device)
        # Rotary dims: pairs (e, e + hs/2) -> (r e, r e + hb/2), the same frequency.
        self.rope_dim = torch.where(e < hs // 2, r * e, r * (e - hs // 2) + hb // 2)
        gs, gb = s.num_heads // s.num_kv_heads, b.num_heads // b.num_kv_heads
        h = torch.arange(s.num_heads, device=device)
        self.q_head = (h // gs) * gb + h % gs
        self.q_rows = (self.q_head[:, None] * hb + self.rope_dim).reshape(-1)          # [Qs * hs]
        g = torch.arange(s.num_kv_heads, device=device)
        self.k_rows = (g[:, None] * hb + self.rope_dim).reshape(-1)                    # [Ks * hs]
        self.v_rows = (g[:, None] * hb + e).reshape(-1)                                # [Ks * hs]
        self.o_cols = (self.q_head[:, None] * hb + e).reshape(-1)                      # [Qs * hs]
        self.q_scale = math.sqrt(hb / hs)
        self.norm_scale = math.sqrt(s.hidden_size / b.hidden_size)


def layer_positions(small_layers: int, big_layers: int) -> list[int]:
    """Where the small model's layers go in the big stack: spread evenly, in order."""
    return [i * big_layers // small_layers for i in range(small_layers)]


@torch.no_grad()
def _fill_layer(dst: dict, src: dict | None, prefix_dst: str, prefix_src: str, maps: _Maps,
                hs_: int, is_: int, gen: torch.Generator) -> None:
    """One decoder layer: the small layer's weights embedded (src given), or an extra layer."""
    def d(name):
        return dst[prefix_dst + name]

    if src is None:
        for name in ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                     "mlp.gate_proj.weight", "mlp.up_proj.weight"):
            t = d(name)
            t.copy_(torch.randn(t.shape, generator=gen, device=gen.device, dtype=t.dtype).mul_(_EXTRA_STD))
        for name in ("self_attn.o_proj.weight", "mlp.down_proj.weight"):
            d(name).zero_()
        for name in ("input_layernorm.weight", "post_attention_layernorm.weight"):
            if prefix_dst + name in dst:
                d(name).fill_(1.0)
        return

    def s(name, scale=1.0):
        # Scaled in float32, rounded once to the big model's dtype.
        return (src[prefix_src + name].float() * scale).to(dst[prefix_dst + name].dtype)

    for name in ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                 "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
                 "mlp.down_proj.weight", "input_layernorm.weight", "post_attention_layernorm.weight"):
        if prefix_dst + name in dst:
            d(name).zero_()
    d("self_attn.q_proj.weight")[maps.q_rows, :hs_] = s("self_attn.q_proj.weight", maps.q_scale)
    d("self_attn.k_proj.weight")[maps.k_rows, :hs_] = s("self_attn.k_proj.weight")
    d("self_attn.v_proj.weight")[maps.v_rows, :hs_] = s("self_attn.v_proj.weight")
    d("self_attn.o_proj.weight")[:hs_, maps.o_cols] = s("self_attn.o_proj.weight")
    d("mlp.gate_proj.weight")[:is_, :hs_] = s("mlp.gate_proj.weight")
    d("mlp.up_proj.weight")[:is_, :hs_] = s("mlp.up_proj.weight")
    d("mlp.down_proj.weight")[:hs_, :is_] = s("mlp.down_proj.weight")
    for name in ("input_layernorm.weight", "post_attention_layernorm.weight"):
        if prefix_dst + name in dst:
            d(name)[:hs_] = s(name, maps.norm_scale)


@torch.no_grad()
def embed_target(small: LlamaModel, shape: dict | None = None, *, dtype=None, device=None,
                 seed: int = 0) -> LlamaModel:
    """The big model (`shape`, default Llama-3.1-8B's) computing `small`'s function."""
    s = small.cfg
    b = embedded_config(s, shape or LLAMA_31_8B_SHAPE)
    dtype = dtype or small.embed_tokens.weight.dtype
    device = device or small.embed_tokens.weight.device
    big = build_target(b, dtype, device)
    dst = big.state_dict()          # views of the parameters: filled in place
    src = small.state_dict()
    maps = _Maps(s, b, device)
    gen = torch.Generator(device=device).manual_seed(seed)
    hs_, vs = s.hidden_size, s.vocab_size
    where = dict(zip(layer_positions(s.num_layers, b.num_layers), range(s.num_layers)))
    for j in range(b.num_layers):
        i = where.get(j)
        _fill_layer(dst, src if i is not None else None, f"layers.{j}.", f"layers.{i}.", maps,
                    hs_, s.intermediate_size, gen)
    for name in ("embed_tokens.weight", "lm_head.weight"):
        dst[name].zero_()
        dst[name][:vs, :hs_] = src[name if name in src else "embed_tokens.weight"].to(dtype)
    dst["norm.weight"].zero_()
    dst["norm.weight"][:hs_] = (src["norm.weight"].float() * maps.norm_scale).to(dtype)
    return big


@torch.no_grad()
def embed_eagle_head(small_head: EagleHead, big_target: LlamaModel, seed: int = 1) -> EagleHead:
    """An EAGLE-1/2 head for `big_target` computing `small_head`'s function (on big_target's
    embedding and LM head, as the small head used the small target's)."""
    if small_head.algorithm != "EAGLE" or small_head.hc_mult != 1:
        raise ValueError("only EAGLE-1/2 heads on hc_mult 1 targets embed")
    s, b = small_head.cfg, big_target.cfg
    shape = {k: getattr(b, k) for k in ("hidden_size", "num_heads", "num_kv_heads", "head_dim", "vocab_size")}
    shape["intermediate_size"] = max(b.intermediate_size, s.intermediate_size)
    shape["num_layers"] = s.num_layers
    head_cfg = embedded_config(s, shape)
    dtype = big_target.embed_tokens.weight.dtype
    device = big_target.embed_tokens.weight.device
    big = build_draft("EAGLE", head_cfg, big_target, dtype, device, fc_bias=small_head.fc.bias is not None)
    dst, src = big.state_dict(), small_head.state_dict()
    maps = _Maps(s, head_cfg, device)
    hs_, hb = s.hidden_size, head_cfg.hidden_size
    fc = dst["fc.weight"]
    fc.zero_()
    fc[:hs_, :hs_] = src["fc.weight"][:, :hs_].to(dtype)                 # the embedding's half
    fc[:hs_, hb:hb + hs_] = src["fc.weight"][:, hs_:].to(dtype)         # the feature's half
    if "fc.bias" in dst:
        dst["fc.bias"].zero_()
        dst["fc.bias"][:hs_] = src["fc.bias"].to(dtype)
    gen = torch.Generator(device=device).manual_seed(seed)
    for i in range(s.num_layers):
        _fill_layer(dst, src, f"layers.{i}.", f"layers.{i}.", maps, hs_, s.intermediate_size, gen)
    return big


def config_json(cfg: ModelConfig) -> dict:
    """An HF config.json for an embedded model (what transformers' LlamaForCausalLM is built from)."""
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "torch_dtype": "bfloat16",
            "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
            "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_layers,
            "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
            "head_dim": cfg.head_dim, "max_position_embeddings": cfg.max_position_embeddings,
            "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta,
            "tie_word_embeddings": cfg.tie_word_embeddings, "hidden_act": "silu"}


def real_logits_below_zero(logits: torch.Tensor, small_vocab: int) -> int:
    """Positions (rows of logits [..., Vb]) where every small-vocabulary logit is below 0, so
    that an extra token's exact 0 would win the argmax: 0 means greedy never leaves the small
    vocabulary there."""
    return int((logits[..., :small_vocab].amax(-1) < 0).sum())
