"""Attention over the slot pool.

Every forward sees a dense rectangle of B requests x Q query tokens. What each query may read is
described structurally, not as one dense [B, Q, K] mask, so that a fast kernel can walk only the
valid prefix of each request:

- the committed *prefix* of request b: `prefix_slots[b, :prefix_lens[b]]`, visible to all its
  queries;
- the *in-flight* tokens `new_slots[b]` (this forward's own tokens, the verify tree, or the
  draft scratch), visible where `new_mask[b, q, j]` is True (causal, tree or ancestor mask).

K/V pools in float8_e4m3fn (`--kv-cache-dtype fp8_e4m3`) hold e4m3 codes of K / k_scale and
V / v_scale, one float scale per layer for each (`kv_scales`; from the checkpoint's k_scale /
v_scale where it has them, else 1): `store_kv` writes them, both paths read them back scaled.

Two implementations share this contract: `reference` (gather K/V by slot, one SDPA call; used
on CPU and as the oracle in tests) and `fast` (GPU: a Triton kernel over the slot pool that
skips the padded prefix). Select with `set_backend`; the default, `auto`, takes the fast path
for CUDA tensors when Triton is installed and the head size suits the kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specdeploy.engine import kernels
from specdeploy.engine.models.fp8 import FP8_MAX


@dataclass
class AttnBatch:
    out_slots: torch.Tensor     # [B, Q] int64: where each new token's K/V is written
    prefix_slots: torch.Tensor  # [B, Kp] int64: committed slots (padded with the pad slot)
    prefix_lens: torch.Tensor   # [B] int64: valid prefix length per request
    new_slots: torch.Tensor     # [B, Kn] int64: in-flight slots
    new_mask: torch.Tensor      # [B, Q, Kn] bool: query q may read in-flight key j

    def full_mask(self) -> torch.Tensor:
        """[B, Q, Kp + Kn] bool, the dense equivalent (reference path and tests)."""
        b, q, _ = self.new_mask.shape
        kp = self.prefix_slots.shape[1]
        prefix = torch.arange(kp, device=self.prefix_lens.device) < self.prefix_lens[:, None]
        return torch.cat([prefix[:, None, :].expand(b, q, kp), self.new_mask], dim=-1)


FP8_KV_DTYPE = torch.float8_e4m3fn


def store_kv(x: torch.Tensor, cache_dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """K or V rows as the pool stores them: the pool's dtype, or e4m3 codes of x / scale
    (saturated at +-448, as the GPU's conversion does)."""
    if cache_dtype == FP8_KV_DTYPE:
        return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_KV_DTYPE)
    return x.to(cache_dtype)


def _read_kv(rows: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    return (rows.float() * scale).to(dtype) if rows.dtype == FP8_KV_DTYPE else rows


def reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              batch: AttnBatch, scale: float, kv_scales: tuple[float, float] | None = None) -> torch.Tensor:
    """q [B, Q, Hq, D]; k_cache/v_cache [slots, Hkv, D] -> [B, Q, Hq, D]. kv_scales: (k_scale,
    v_scale) of an FP8 pool."""
    slots = torch.cat([batch.prefix_slots, batch.new_slots], dim=1)    # [B, K]
    ks, vs = kv_scales or (1.0, 1.0)
    k = _read_kv(k_cache[slots], q.dtype, ks).transpose(1, 2)           # [B, Hkv, K, D]
    v = _read_kv(v_cache[slots], q.dtype, vs).transpose(1, 2)
    mask = batch.full_mask()[:, None]                                   # [B, 1, Q, K]
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=mask, scale=scale,
                                         enable_gqa=q.shape[2] != k.shape[1])
    return out.transpose(1, 2)


_BACKEND = "auto"
_BACKENDS = ("auto", "reference", "fast")


def set_backend(name: str) -> None:
    """'auto' (fast on CUDA where possible), 'reference' (any device, differentiable) or
    'fast' (CUDA + Triton)."""
    global _BACKEND
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; use one of {_BACKENDS}")
    if name == "fast":
        if kernels.attention_ops() is None:
            raise ValueError("attention backend 'fast' needs Triton, which is not installed")
    _BACKEND = name


def get_backend() -> str:
    return _BACKEND


def attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
           batch: AttnBatch, scale: float, kv_scales: tuple[float, float] | None = None) -> torch.Tensor:
    fast = kernels.attention_ops() if _BACKEND != "reference" and q.is_cuda else None
    if fast is not None and fast.supported(q):
        return fast.attend(q, k_cache, v_cache, batch, scale, kv_scales=kv_scales)
    return reference(q, k_cache, v_cache, batch, scale, kv_scales)


def causal_batch(out_slots: torch.Tensor, lens: torch.Tensor, prefix_slots: torch.Tensor,
                 prefix_lens: torch.Tensor) -> AttnBatch:
    """Rows of in-flight tokens that see the prefix and, causally, each other.
    out_slots [B, Q] (padding = pad slot); lens [B] valid tokens per row. Padded query rows are
    allowed their own (pad) key so no softmax row is empty."""
    b, q = out_slots.shape
    idx = torch.arange(q, device=out_slots.device)
    causal = idx[None, :, None] >= idx[None, None, :]                    # [1, Q, Q]
    valid = idx[None, :] < lens[:, None]                                 # [B, Q]
    mask = causal & valid[:, None, :]
    mask = mask | (~valid[:, :, None] & (idx[None, :, None] == idx[None, None, :]))
    return AttnBatch(out_slots, prefix_slots, prefix_lens, out_slots, mask)
