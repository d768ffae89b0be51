"""Triton kernels: the only package that imports triton.

Each kernel module imports triton at its top, so importing one without Triton fails. Callers
never import them directly: they ask the loaders below, which return the module where Triton is
installed and None where it is not (CPU-only installs, CI). A kernel module that fails to import
with Triton present raises: a broken kernel is a bug to see, never a reason to fall back to the
torch code quietly.

- `elementwise`: fused RMSNorm (+residual add), SiLU-and-mul, rope on q/k, two-stage argmax.
- `attention`: paged decode/verify/extend attention over the KV slot pool.
- `hc`: the hyper-connection residual (mHC pre-mix with Sinkhorn, post expand).
- `fp8`: linears over FP8 e4m3 weights with block / per-channel / per-tensor scales (weight-only
  for decode, per-token-group activation quantization and an FP8 GEMM for prefill).
- `fp4`: DeepSeek-V4's FP4 routed experts (e2m1 pairs + E8M0 scales) dequantized in one pass.
- `fp4_moe`: the same experts' grouped GEMM with the codes dequantized in registers (no copy),
  the gate/up activation and the routing weights in its epilogues.
- `launch`: launch options the kernel modules share (programmatic dependent launch).
- `gemv`: the small-M (<= 16 rows) weight-streaming linear over FP8 or plain weights, split-K
  finished in-kernel.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from types import ModuleType
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    import torch


@functools.cache
def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


@functools.cache
def elementwise_ops() -> ModuleType | None:
    if not triton_available():
        return None
    from specdeploy.engine.kernels import elementwise

    return elementwise


@functools.cache
def attention_ops() -> ModuleType | None:
    if not triton_available():
        return None
    from specdeploy.engine.kernels import attention

    return attention


@functools.cache
def hc_ops() -> ModuleType | None:
    if not triton_available():
        return None
    from specdeploy.engine.kernels import hc

    return hc


@functools.cache
def fp4_ops() -> ModuleType | None:
    if not triton_available():
        return None
    from specdeploy.engine.kernels import fp4

    return fp4


@functools.cache
def fp4_moe_ops() -> ModuleType | None:
    if not triton_available():
        return None
    from specdeploy.engine.kernels import fp4_moe

    return fp4_moe


@functools.cache
def fp8_ops() -> ModuleType | None:
    if not triton_available():
        return None
    from specdeploy.engine.kernels import fp8

    return fp8


@functools.cache
def gemv_ops() -> ModuleType | None:
    if not triton_available():
        return None
    from specdeploy.engine.kernels import gemv

    return gemv


class Prologue(NamedTuple):
    """What the small-M linear (engine/kernels/gemv.py, fp8_mma_gemv.cu) computes on its input
    before the product, in place of a kernel of its own before it (a decode step's norms and
    SwiGLU are a third of its launches at batch 1):

    - "silu_mul": x [M, 2K] is a gate/up matmul's output; the input is silu(gate) * up, with the
      SiLU rounded to x's dtype as elementwise.silu_mul rounds it (the same input, bit for bit).
    - "rms_norm": x [M, K] is the residual stream; the input is rms_norm(x + delta) * weight
      (delta None: no add) and x + delta, rounded to x's dtype, is written to residual_out. The
      product runs on weight * (x + delta) and is scaled by 1 / rms at the end, so the normed
      input is not rounded to x's dtype first: the result equals rms_norm-then-linear up to that
      one rounding. One row only, and one program along K (the sum of squares is the program's
      own): launches that are not take the two kernels.
    """

    kind: str
    delta: object = None  # torch.Tensor | None
    weight: object = None
    eps: float = 0.0
    residual_out: object = None


PROLOGUE_ENV = "SPECDEPLOY_PROLOGUE"  # "0": every prologue runs as its own kernel (for comparisons)
PROLOGUE_CODES = {"silu_mul": 1, "rms_norm": 2}  # the kernels' PRO: rms_norm without a delta is 3


def prologue_code(prologue: Prologue | None) -> int:
    if prologue is None:
        return 0
    if prologue.kind not in PROLOGUE_CODES:
        raise ValueError(f"prologue {prologue.kind!r} (one of {sorted(PROLOGUE_CODES)})")
    return 3 if prologue.kind == "rms_norm" and prologue.delta is None else PROLOGUE_CODES[prologue.kind]


def norm_args(prologue: Prologue | None, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]:
    """(delta, norm weight, residual out, eps) of a norm prologue; x in place of each tensor a
    launch does not read (no norm, or no delta)."""
    if prologue is None or prologue.kind != "rms_norm":
        return x, x, x, 0.0
    if prologue.delta is not None and (prologue.residual_out is None or prologue.delta.shape != x.shape
                                       or prologue.residual_out.shape != x.shape):
        raise ValueError("a norm prologue's delta and residual_out are x's shape")
    pick = lambda t: t if t is not None else x  # noqa: E731
    return pick(prologue.delta), prologue.weight, pick(prologue.residual_out), float(prologue.eps)


@functools.cache
def prologue_kinds() -> frozenset[str]:
    """The prologues the small-M linear computes where its launch can, from SPECDEPLOY_PROLOGUE
    (read once; reset_prologues() reads it again): "1" (the default) all, "0" none, or a
    comma-separated list of kinds (comparisons)."""
    value = os.environ.get(PROLOGUE_ENV, "1").strip()
    kinds = set(PROLOGUE_CODES) if value == "1" else set() if value == "0" else {v.strip() for v in value.split(",")}
    if not kinds <= set(PROLOGUE_CODES):
        raise ValueError(f"{PROLOGUE_ENV}={value!r}: 1 (the default), 0 or kinds of {sorted(PROLOGUE_CODES)}")
    return frozenset(kinds)


def reset_prologues() -> None:
    prologue_kinds.cache_clear()
