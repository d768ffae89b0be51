"""Manifold-constrained hyper-connections (mHC): the residual of models with `hc_mult > 1`.

DeepSeek-V4 replaces the single residual stream of a decoder block by `hc_mult` parallel streams.
Each sublayer (attention, then MLP) reads a learned mix of the streams and writes its output back
into every stream, while the old streams are blended through a doubly stochastic matrix (rows and
columns sum to 1, so the residual neither grows nor shrinks across a deep stack).

Per sublayer, for every token, with streams `S [hc, H]` and `F` the sublayer (norm included):

    mixes        = fn @ flatten(S) / rms(flatten(S))                 fn [(2 + hc) * hc, hc * H]
    pre  [hc]    = sigmoid(mixes_pre  * scale[0] + base_pre) + hc_eps
    post [hc]    = 2 * sigmoid(mixes_post * scale[1] + base_post)
    comb [hc,hc] = sinkhorn(mixes_comb * scale[2] + base_comb)
    x    [H]     = sum_i pre[i] * S[i]                                      (hc_collapse)
    S'[j]        = post[j] * F(x) + sum_i comb[i, j] * S[i]                  (hc_expand)

The mixing weights are computed in float32 and the streams are mixed in float32, then cast once to
the stream dtype, as DeepSeek-V4's inference code does; the parameters are float32 in published
checkpoints and these modules keep them float32 when the model is cast to bfloat16. On CUDA, with
no gradient to track, a sublayer's residual runs as two Triton kernels around the mixes matmul
(engine/kernels/hc.py) instead of this module's torch code, which is a hundred small launches.

API (all tensors token-flattened `[T, ...]`; any leading dims work, `[B, S, ...]` included):

    cfg = HCConfig.from_hf_config(config_json)                  # hidden_size, hc_mult, ...
    streams = expand_embeddings(embeds [T, H], cfg.hc_mult)     # [T, hc, H]
    # in each decoder block (modules named `attn_hc`, `ffn_hc` so the name map applies):
    streams = self.attn_hc(streams, lambda x: self.self_attn(self.input_layernorm(x)))
    streams = self.ffn_hc(streams, lambda x: self.mlp(self.post_attention_layernorm(x)))
    # after the last block (module named `hc_head`), before the final norm:
    hidden = self.norm(self.hc_head(streams))                   # [T, H] -> lm_head
    # what the draft receives (EAGLE / MTP input), width spec_hidden_size = hc * H:
    spec_hidden = flatten_streams(streams)                      # [T, hc * H]

The lower-level pieces are public for kernels and tests: `HyperConnection.mixing_weights`,
`hc_collapse`, `hc_expand`, `sinkhorn`, `unflatten_streams`.

hc_mult = 1 means "no hyper-connections" (Llama-family checkpoints carry no mixing weights):
`make_residual` then returns `PlainResidual` (`x + F(x)` on `[T, H]`, no stream axis) with the same
call signature, and the model uses neither `expand_embeddings` nor a head; the draft gets `[T, H]`.
(HyperConnection is still well defined for one stream, as a learned gate rather than the
identity, and matches DeepSeek-V4 there; it is just not what a config without `hc_mult` means.)

Checkpoint names: `canonical_hc_key` maps both published layouts onto this module's names:
    DeepSeek-V4 release   layers.{i}.hc_attn_{fn,base,scale}  -> layers.{i}.attn_hc.{fn,base,scale}
                          layers.{i}.hc_ffn_{fn,base,scale}   -> layers.{i}.ffn_hc.{fn,base,scale}
                          hc_head_{fn,base,scale}             -> hc_head.{fn,base,scale}
                          mtp.{k}.hc_{attn,ffn,head}_*        -> mtp.{k}.{attn_hc,ffn_hc,hc_head}.*
    transformers          model.layers.{i}.attn_hc.fn         -> unchanged
                          model.hc_head.hc_{fn,base,scale}    -> model.hc_head.{fn,base,scale}
Prefixes (`model.`) are left to the caller's loader.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from specdeploy.engine import kernels
from specdeploy.engine.models.layers import fused_kernels

Sublayer = Callable[[torch.Tensor], torch.Tensor]  # [*, H] -> [*, H]


@dataclass(frozen=True)
class HCConfig:
    """The hyper-connection fields of a model config (defaults are DeepSeek-V4's)."""

    hidden_size: int
    hc_mult: int = 1
    sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    norm_eps: float = 1e-6  # eps of the unweighted RMS norm over the flattened streams

    def __post_init__(self) -> None:
        if self.hc_mult < 1:
            raise ValueError(f"hc_mult must be >= 1, got {self.hc_mult}")
        if self.sinkhorn_iters < 1:
            raise ValueError(f"hc_sinkhorn_iters must be >= 1, got {self.sinkhorn_iters}")

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any]) -> "HCConfig":
        """Read a config.json dict (nested `text_config` included); absent fields take defaults."""
        text = config.get("text_config") or config

        def field(name: str, default: float) -> Any:
            value = text.get(name)
            return default if value is None else value

        return cls(
            hidden_size=int(text["hidden_size"]),
            hc_mult=int(field("hc_mult", 1)),
            sinkhorn_iters=int(field("hc_sinkhorn_iters", 20)),
            hc_eps=float(field("hc_eps", 1e-6)),
            norm_eps=float(field("rms_norm_eps", 1e-6)),
        )


# ---------------------------------------------------------------------------------------------
# Pure functions
# ---------------------------------------------------------------------------------------------


def expand_embeddings(embeds: torch.Tensor, hc_mult: int) -> torch.Tensor:
    """[*, H] -> [*, hc, H]: every stream starts as a copy of the token embedding."""
    # A real copy, not a broadcast view: the flattened streams feed F.linear every sublayer.
    return embeds.unsqueeze(-2).expand(*embeds.shape[:-1], hc_mult, embeds.shape[-1]).contiguous()


def flatten_streams(streams: torch.Tensor) -> torch.Tensor:
    """[*, hc, H] -> [*, hc * H] (stream-major): the spec_hidden_size-wide state for the draft."""
    return streams.flatten(-2)


def unflatten_streams(spec_hidden: torch.Tensor, hc_mult: int) -> torch.Tensor:
    """[*, hc * H] -> [*, hc, H]; refuses a width that is not a multiple of hc_mult."""
    width = spec_hidden.shape[-1]
    if width % hc_mult:
        raise ValueError(f"width {width} is not hc_mult ({hc_mult}) x hidden_size")
    return spec_hidden.unflatten(-1, (hc_mult, width // hc_mult))


def sinkhorn(comb_logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """[*, hc, hc] logits -> [*, hc, hc] approximately doubly stochastic matrix (float32).

    Row softmax first (positive entries, rows sum to 1), then `iters` column normalisations with
    `iters - 1` row normalisations between them, as DeepSeek-V4 does; the result ends on a column
    step, so columns sum to 1 up to `eps` and rows converge with the iteration count.
    """
    comb = torch.softmax(comb_logits.float(), dim=-1) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


def hc_collapse(streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """streams [*, hc, H], pre [*, hc] (float32) -> sublayer input [*, H] in the streams' dtype."""
    return (pre.unsqueeze(-1) * streams.float()).sum(dim=-2).to(streams.dtype)


def hc_expand(
    sublayer_out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
) -> torch.Tensor:
    """New streams [*, hc, H] = post ⊗ sublayer_out + combᵀ · streams.

    sublayer_out [*, H], streams [*, hc, H], post [*, hc], comb [*, hc, hc] (float32).
    comb[i, j] moves old stream i into new stream j (a sum over the first hc axis); Sinkhorn's
    result is not symmetric, so the transpose matters. Mixed in float32, cast once.
    """
    written = post.unsqueeze(-1) * sublayer_out.float().unsqueeze(-2)  # [*, hc, H]
    carried = torch.matmul(comb.transpose(-1, -2), streams.float())  # [*, hc, H]
    return (written + carried).to(streams.dtype)


def _rms_scale(flat: torch.Tensor, eps: float) -> torch.Tensor:
    """flat [*, hc * H] float32 -> [*, 1]: 1 / rms, the unweighted RMS norm as a scale."""
    return torch.rsqrt(flat.square().mean(dim=-1, keepdim=True) + eps)


# ---------------------------------------------------------------------------------------------
# Modules
# ---------------------------------------------------------------------------------------------


class _Float32Params(nn.Module):
    """Parameters that follow device moves but never dtype casts.

    DeepSeek-V4 ships the mixing weights in float32 and computes with them in float32; a model
    cast with `.to(torch.bfloat16)` must not round them (transformers keeps these modules in
    float32 for the same reason).
    """

    def _apply(self, fn, recurse=True):
        def keep_float32(t: torch.Tensor) -> torch.Tensor:
            # Learn only the target device from `fn`, on an empty probe (no copy of the data).
            probe = fn(torch.empty(0, dtype=t.dtype, device=t.device))
            if t.device.type == "meta" or probe.device.type == "meta":
                # Meta tensors hold no data to move (`to_empty`, deferred init): allocate.
                return torch.empty_like(t, device=probe.device)
            return t.to(device=probe.device)

        return super()._apply(keep_float32, recurse)


class HyperConnection(_Float32Params):
    """The mHC residual around one sublayer: `streams = hc(streams, sublayer)`.

    Parameters (float32, frozen like every engine parameter; training unfreezes them):
    fn [(2 + hc) * hc, hc * H], base [(2 + hc) * hc], scale [3] (the pre / post / comb scales).
    Named like transformers' `DeepseekV4HyperConnection`.
    """

    def __init__(self, cfg: HCConfig) -> None:
        super().__init__()
        self.hc_mult = cfg.hc_mult
        self.sinkhorn_iters = cfg.sinkhorn_iters
        self.hc_eps = cfg.hc_eps
        self.norm_eps = cfg.norm_eps
        num_mixes = (2 + cfg.hc_mult) * cfg.hc_mult  # pre (hc) + post (hc) + comb (hc * hc)
        stream_width = cfg.hc_mult * cfg.hidden_size
        self.fn = nn.Parameter(torch.zeros(num_mixes, stream_width, dtype=torch.float32), requires_grad=False)
        self.base = nn.Parameter(torch.zeros(num_mixes, dtype=torch.float32), requires_grad=False)
        self.scale = nn.Parameter(torch.ones(3, dtype=torch.float32), requires_grad=False)

    def mixing_weights(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams [*, hc, H] -> pre [*, hc], post [*, hc], comb [*, hc, hc], all float32."""
        hc = self.hc_mult
        flat = flatten_streams(streams).float()  # [*, hc * H]
        # Scaling the [*, mixes] product by 1/rms equals normalising the [*, hc * H] input first.
        mixes = F.linear(flat, self.fn.float()) * _rms_scale(flat, self.norm_eps)  # [*, (2+hc)*hc]
        pre_mix, post_mix, comb_mix = mixes.split([hc, hc, hc * hc], dim=-1)
        pre_base, post_base, comb_base = self.base.float().split([hc, hc, hc * hc])
        pre_scale, post_scale, comb_scale = self.scale.float().unbind(0)
        pre = torch.sigmoid(pre_mix * pre_scale + pre_base) + self.hc_eps
        post = 2 * torch.sigmoid(post_mix * post_scale + post_base)
        comb_logits = (comb_mix * comb_scale + comb_base).unflatten(-1, (hc, hc))  # [*, hc, hc]
        return pre, post, sinkhorn(comb_logits, self.sinkhorn_iters, self.hc_eps)

    def forward(self, streams: torch.Tensor, sublayer: Sublayer) -> torch.Tensor:
        """streams [*, hc, H] -> [*, hc, H]; `sublayer` maps [*, H] -> [*, H] (norm included)."""
        fast = fused_kernels(streams, self.fn, self.base, self.scale, ops=kernels.hc_ops)
        if fast is not None:  # CUDA: two launches around the mixes matmul (engine/kernels/hc.py)
            mixes = F.linear(flatten_streams(streams).float(), self.fn)
            x, _, post, comb = fast.hc_pre(streams, mixes, self.base, self.scale, self.sinkhorn_iters,
                                           self.norm_eps, self.hc_eps)
            out = sublayer(x)
            if torch.is_grad_enabled() and out.requires_grad:  # the sublayer trains: keep its gradient
                return hc_expand(out, streams, post, comb)
            return fast.hc_expand(out, streams, post, comb)
        pre, post, comb = self.mixing_weights(streams)
        return hc_expand(sublayer(hc_collapse(streams, pre)), streams, post, comb)


class HyperHead(_Float32Params):
    """Collapses the streams [*, hc, H] -> [*, H] after the last block, before the final norm.

    A learned, token-dependent `pre` mix (no post, no Sinkhorn). Parameters (float32):
    fn [hc, hc * H], base [hc], scale [1].
    """

    def __init__(self, cfg: HCConfig) -> None:
        super().__init__()
        self.hc_eps = cfg.hc_eps
        self.norm_eps = cfg.norm_eps
        self.fn = nn.Parameter(torch.zeros(cfg.hc_mult, cfg.hc_mult * cfg.hidden_size, dtype=torch.float32),
                               requires_grad=False)
        self.base = nn.Parameter(torch.zeros(cfg.hc_mult, dtype=torch.float32), requires_grad=False)
        self.scale = nn.Parameter(torch.ones(1, dtype=torch.float32), requires_grad=False)

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        flat = flatten_streams(streams).float()  # [*, hc * H]
        fast = fused_kernels(streams, self.fn, self.base, self.scale, ops=kernels.hc_ops)
        if fast is not None:
            return fast.hc_pre(streams, F.linear(flat, self.fn), self.base, self.scale, 1, self.norm_eps,
                               self.hc_eps, head=True)[0]
        mixes = F.linear(flat, self.fn.float()) * _rms_scale(flat, self.norm_eps)  # [*, hc]
        pre = torch.sigmoid(mixes * self.scale.float() + self.base.float()) + self.hc_eps
        return hc_collapse(streams, pre)


class PlainResidual(nn.Module):
    """The hc_mult = 1 residual, with HyperConnection's call signature: hidden [*, H] + F(hidden)."""

    def forward(self, hidden: torch.Tensor, sublayer: Sublayer) -> torch.Tensor:
        return hidden + sublayer(hidden)


def make_residual(cfg: HCConfig) -> nn.Module:
    """The residual a block of this config uses: HyperConnection if hc_mult > 1, else plain."""
    return HyperConnection(cfg) if cfg.hc_mult > 1 else PlainResidual()


# ---------------------------------------------------------------------------------------------
# Checkpoint names
# ---------------------------------------------------------------------------------------------

# (pattern, replacement) applied to the end of a key; `(^|\.)` keeps any prefix intact.
HC_KEY_RENAMES: tuple[tuple[re.Pattern[str], str], ...] = (
    # DeepSeek-V4 release: flat parameters on the block / MTP layer / model.
    (re.compile(r"(^|\.)hc_attn_(fn|base|scale)$"), r"\1attn_hc.\2"),
    (re.compile(r"(^|\.)hc_ffn_(fn|base|scale)$"), r"\1ffn_hc.\2"),
    (re.compile(r"(^|\.)hc_head_(fn|base|scale)$"), r"\1hc_head.\2"),
    # transformers: the head's parameters carry an extra `hc_` prefix.
    (re.compile(r"(^|\.)hc_head\.hc_(fn|base|scale)$"), r"\1hc_head.\2"),
)


def canonical_hc_key(key: str) -> str:
    """Rename a hyper-connection parameter to this module's layout; other keys pass unchanged."""
    for pattern, replacement in HC_KEY_RENAMES:
        renamed, count = pattern.subn(replacement, key)
        if count:
            return renamed
    return key


def canonical_hc_state_dict(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`canonical_hc_key` over a whole state dict; two source keys landing on one name is an error."""
    renamed: dict[str, torch.Tensor] = {}
    for key, tensor in state_dict.items():
        new_key = canonical_hc_key(key)
        if new_key in renamed:
            raise KeyError(f"{key!r} and another key both map to {new_key!r}")
        renamed[new_key] = tensor
    return renamed
