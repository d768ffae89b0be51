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
from types import ModuleType


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
