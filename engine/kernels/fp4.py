"""Triton kernel for DeepSeek-V4's FP4 routed experts (engine/models/deepseek_v4.py _Experts; CUDA
only: the torch code there runs elsewhere and is what this kernel is held to).

The experts ship as e2m1 pairs, one byte per two weights (element 2j in the low nibble, 2j + 1
in the high), with one E8M0 scale byte per 32 weights along the input dimension. The expert
computation dequantizes the weights its step uses into the model dtype before its matmuls. In
torch that is an int32 copy of the code bytes, a table lookup and an in-place scale: about 12
bytes of traffic per weight. Here one pass reads the codes and scales (0.53 bytes per weight)
and writes the output (2 bytes in bf16):

    dequant_fp4   codes [M, K / 2] uint8, scale bits [M, ceil(K / 32)] uint8 -> [M, K] dtype
                  value(nibble) = (-1)^s x (e == 0 ? m / 2 : 2^(e - 1) (1 + m / 2)), with s, e, m
                  the nibble's bits 3, 2-1 and 0; times 2^(bits - 127)

Both factors are exact in float32 and their product (at most two significant bits times a power
of two) is exact in bf16 as well: the result equals the torch code's bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Bytes (half as many as weights) per program along a row, and rows per program.
BLOCK_BYTES = 128
BLOCK_ROWS = 16
GROUP = 32  # weights per E8M0 scale


@triton.jit
def _e2m1(nibble):
    sign = nibble >> 3
    e = (nibble >> 1) & 3
    m = (nibble & 1).to(tl.float32)
    magnitude = tl.where(e == 0, 0.5 * m, tl.exp2((e - 1).to(tl.float32)) * (1.0 + 0.5 * m))
    return tl.where(sign == 1, -magnitude, magnitude)


@triton.jit
def _dequant_fp4_kernel(codes_ptr, bits_ptr, out_ptr, M, KB, stride_c, stride_s, stride_o,
                        GROUP: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_BYTES: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.program_id(1) * BLOCK_BYTES + tl.arange(0, BLOCK_BYTES)      # byte j: weights 2j, 2j + 1
    ok = (rows[:, None] < M) & (cols[None, :] < KB)
    c = tl.load(codes_ptr + rows[:, None] * stride_c + cols[None, :], mask=ok, other=0).to(tl.int32)
    bits = tl.load(bits_ptr + rows[:, None] * stride_s + (cols // (GROUP // 2))[None, :], mask=ok,
                   other=127).to(tl.int32)
    scale = tl.exp2((bits - 127).to(tl.float32))
    lo = _e2m1(c & 15) * scale
    hi = _e2m1((c >> 4) & 15) * scale
    pair = tl.reshape(tl.join(lo, hi), (BLOCK_ROWS, 2 * BLOCK_BYTES))        # 2j, 2j + 1 interleaved
    out_cols = tl.program_id(1) * 2 * BLOCK_BYTES + tl.arange(0, 2 * BLOCK_BYTES)
    ok2 = (rows[:, None] < M) & (out_cols[None, :] < 2 * KB)
    tl.store(out_ptr + rows[:, None] * stride_o + out_cols[None, :], pair.to(out_ptr.dtype.element_ty), mask=ok2)


def dequant_fp4(codes: torch.Tensor, bits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """codes [M, K / 2] (int8 or uint8), bits [M, ceil(K / 32)] uint8 -> [M, K] in `dtype`."""
    m, kb = codes.shape
    codes = codes.view(torch.uint8)
    if codes.stride(-1) != 1:
        codes = codes.contiguous()
    if bits.stride(-1) != 1:
        bits = bits.contiguous()
    out = torch.empty(m, 2 * kb, dtype=dtype, device=codes.device)
    if m and kb:
        grid = (triton.cdiv(m, BLOCK_ROWS), triton.cdiv(kb, BLOCK_BYTES))
        _dequant_fp4_kernel[grid](codes, bits, out, m, kb, codes.stride(0), bits.stride(0), out.stride(0),
                                  GROUP=GROUP, BLOCK_ROWS=BLOCK_ROWS, BLOCK_BYTES=BLOCK_BYTES)
    return out
