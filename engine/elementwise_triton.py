"""Triton kernels for the small per-layer element-wise steps of the decode path (CUDA only;
layers.py calls them where no autograd is involved and uses its torch code otherwise).

At batch 1 every torch element-wise op is its own kernel launch costing a few microseconds
whatever its size: RMSNorm is seven of them (cast, square, mean, add, rsqrt, multiply, cast,
weight) and SwiGLU's SiLU-times-up two. Each kernel here does one of those steps in one launch
with the torch code's roundings (the same casts in the same places), so outputs agree with it up
to the order of a float32 sum.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, stride_x, stride_out, n_cols, eps,
                     BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    valid = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=valid, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, 0) / n_cols + eps)
    # torch: (x32 * rstd).to(x.dtype), then weight * that in the promoted dtype.
    y = (x * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=valid, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (w * y).to(out_ptr.dtype.element_ty), mask=valid)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., H], weight [H] -> [..., H] in the dtype of weight * x (torch's promotion)."""
    h = x.shape[-1]
    rows = x.reshape(-1, h)                     # a view for contiguous activations
    out = torch.empty(rows.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    if rows.shape[0]:
        _rms_norm_kernel[(rows.shape[0],)](rows, weight, out, rows.stride(0), out.stride(0), h, eps,
                                           BLOCK=triton.next_power_of_2(h))
    return out.view(x.shape)


@triton.jit
def _silu_mul_kernel(gate_ptr, up_ptr, out_ptr, stride_in, stride_out, n_cols,
                     BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    valid = cols < n_cols
    g = tl.load(gate_ptr + row * stride_in + cols, mask=valid, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + row * stride_in + cols, mask=valid, other=0.0).to(tl.float32)
    # torch: silu(gate) rounded to the activation dtype, then times up.
    s = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (s * u).to(out_ptr.dtype.element_ty), mask=valid)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gate, up [..., I]: the two halves of one [..., 2I] matmul output (same row stride)
    -> silu(gate) * up [..., I]."""
    n = gate.shape[-1]
    g, u = gate.reshape(-1, n), up.reshape(-1, n)
    if g.stride(0) != u.stride(0) or g.stride(-1) != 1 or u.stride(-1) != 1:
        raise ValueError("gate and up must be row slices of one tensor")
    out = torch.empty(g.shape, dtype=gate.dtype, device=gate.device)
    block = min(1024, triton.next_power_of_2(n))
    if g.shape[0]:
        _silu_mul_kernel[(g.shape[0], triton.cdiv(n, block))](g, u, out, g.stride(0), out.stride(0),
                                                              n, BLOCK=block)
    return out.view(*gate.shape[:-1], n)
