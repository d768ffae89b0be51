"""Triton kernels for the small per-layer element-wise steps of the decode path (CUDA only;
layers.py calls them where no autograd is involved and uses its torch code otherwise).

At batch 1 every torch element-wise op is its own kernel launch costing a few microseconds
whatever its size: RMSNorm is seven of them (cast, square, mean, add, rsqrt, multiply, cast,
weight), SwiGLU's SiLU-times-up two, rope on q and k five and the K/V writes two. Each kernel
here does one of those steps in one launch with the torch code's roundings (the same casts in
the same places), so outputs agree with it up to the order of a float32 sum.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specdeploy.engine.kernels.launch import gdc, pdl_args


@triton.jit
def _rms_norm_kernel(x_ptr, delta_ptr, sum_ptr, w_ptr, out_ptr, stride_x, stride_out, n_cols, eps,
                     ADD: tl.constexpr, BLOCK: tl.constexpr, USE_GDC: tl.constexpr = False):
    gdc(USE_GDC)
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    valid = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=valid, other=0.0)
    if ADD:
        # torch: the residual sum is rounded to the activation dtype before it is normalised.
        x = (x.to(tl.float32) + tl.load(delta_ptr + row * stride_x + cols, mask=valid,
                                        other=0.0).to(tl.float32)).to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * stride_x + cols, x, mask=valid)
    x = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, 0) / n_cols + eps)
    # torch: (x32 * rstd).to(x.dtype), then weight * that in the promoted dtype.
    y = (x * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=valid, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (w * y).to(out_ptr.dtype.element_ty), mask=valid)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., H], weight [H] -> [..., H] in the dtype of weight * x (torch's promotion)."""
    return _rms_norm(x, None, weight, eps)[1]


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add and the next norm in one launch: x, delta [..., H] (same dtype)
    -> (x + delta, rms_norm(x + delta))."""
    if delta.dtype != x.dtype or delta.shape != x.shape:
        raise ValueError("residual and delta must have one shape and dtype")
    return _rms_norm(x, delta, weight, eps)


def _rms_norm(x, delta, weight, eps):
    h = x.shape[-1]
    rows = x.contiguous().view(-1, h)
    out = torch.empty(rows.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    total = torch.empty_like(rows) if delta is not None else rows
    if rows.shape[0]:
        _rms_norm_kernel[(rows.shape[0],)](
            rows, rows if delta is None else delta.contiguous().view(-1, h), total, weight, out,
            rows.stride(0), out.stride(0), h, eps, ADD=delta is not None,
            BLOCK=triton.next_power_of_2(h), **pdl_args(rows))
    return total.view(x.shape), out.view(x.shape)


@triton.jit
def _silu_mul_kernel(gate_ptr, up_ptr, out_ptr, stride_in, stride_out, n_cols,
                     BLOCK: tl.constexpr, USE_GDC: tl.constexpr = False):
    gdc(USE_GDC)
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
                                                              n, BLOCK=block, **pdl_args(g))
    return out.view(*gate.shape[:-1], n)


@triton.jit
def _rope_store_kernel(qkv_ptr, cos_ptr, sin_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr, slots_ptr,
                       stride_qkv, stride_cs, stride_cache_s, stride_cache_h,
                       num_heads, num_kv_heads, k_scale, v_scale,
                       HEAD_DIM: tl.constexpr, FP8: tl.constexpr, USE_GDC: tl.constexpr = False):
    gdc(USE_GDC)
    token = tl.program_id(0)        # b * Q + q
    head = tl.program_id(1)         # [0, Hq): q head; [Hq, Hq + Hkv): k head; then v heads
    half = tl.arange(0, HEAD_DIM // 2)
    row = qkv_ptr + token * stride_qkv + head * HEAD_DIM
    slot = tl.load(slots_ptr + token)
    if head >= num_heads + num_kv_heads:
        full = tl.arange(0, HEAD_DIM)
        v = tl.load(row + full)
        if FP8:
            # an e4m3 pool holds codes of v / v_scale, saturated (attention.store_kv)
            v = tl.clamp(v.to(tl.float32) / v_scale, -448.0, 448.0)
        kv_head = head - num_heads - num_kv_heads
        tl.store(v_cache_ptr + slot * stride_cache_s + kv_head * stride_cache_h + full,
                 v.to(v_cache_ptr.dtype.element_ty))
    else:
        dt = qkv_ptr.dtype.element_ty
        x1 = tl.load(row + half).to(tl.float32)
        x2 = tl.load(row + HEAD_DIM // 2 + half).to(tl.float32)
        c1 = tl.load(cos_ptr + token * stride_cs + half).to(tl.float32)
        c2 = tl.load(cos_ptr + token * stride_cs + HEAD_DIM // 2 + half).to(tl.float32)
        s1 = tl.load(sin_ptr + token * stride_cs + half).to(tl.float32)
        s2 = tl.load(sin_ptr + token * stride_cs + HEAD_DIM // 2 + half).to(tl.float32)
        # torch (rotate-half): x * cos + cat(-x2, x1) * sin, each product and the sum rounded
        # to the activation dtype.
        y1 = ((x1 * c1).to(dt).to(tl.float32) + (-x2 * s1).to(dt).to(tl.float32)).to(dt)
        y2 = ((x2 * c2).to(dt).to(tl.float32) + (x1 * s2).to(dt).to(tl.float32)).to(dt)
        # One pointer name per branch: the compiler requires a variable to keep one type across
        # both branches, and the pool may hold another dtype than the activations (autocast).
        if head < num_heads:
            q_row = q_out_ptr + (token * num_heads + head) * HEAD_DIM
            tl.store(q_row + half, y1)
            tl.store(q_row + HEAD_DIM // 2 + half, y2)
        else:
            k_row = k_cache_ptr + slot * stride_cache_s + (head - num_heads) * stride_cache_h
            k1, k2 = y1, y2
            if FP8:
                k1 = tl.clamp(y1.to(tl.float32) / k_scale, -448.0, 448.0)
                k2 = tl.clamp(y2.to(tl.float32) / k_scale, -448.0, 448.0)
            tl.store(k_row + half, k1.to(k_cache_ptr.dtype.element_ty))
            tl.store(k_row + HEAD_DIM // 2 + half, k2.to(k_cache_ptr.dtype.element_ty))


def rope_store(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
               v_cache: torch.Tensor, out_slots: torch.Tensor, num_heads: int,
               num_kv_heads: int, kv_scales: tuple[float, float] = (1.0, 1.0)) -> torch.Tensor:
    """One launch for what follows the fused q/k/v projection: rope on q and k, k and v written
    into the pool at out_slots. qkv [B, Q, (Hq + 2 Hkv) D]; cos/sin [B, Q, D] in qkv's dtype;
    caches [slots, Hkv, D]; out_slots [B, Q] -> rotated q [B, Q, Hq, D]. An e4m3 pool gets the
    codes of k / k_scale and v / v_scale (kv_scales), as attention.store_kv writes them."""
    b, q_len, width = qkv.shape
    d = width // (num_heads + 2 * num_kv_heads)
    rows = qkv.reshape(b * q_len, width)
    cos, sin = cos.to(qkv.dtype), sin.to(qkv.dtype)  # as apply_rope casts them
    cs_cos, cs_sin = cos.reshape(b * q_len, d), sin.reshape(b * q_len, d)
    if rows.stride(1) != 1 or cs_cos.stride(1) != 1 or cs_sin.stride() != cs_cos.stride():
        raise ValueError("qkv and cos/sin must have contiguous rows")
    if k_cache.stride() != v_cache.stride() or k_cache.stride(2) != 1:
        raise ValueError("k and v caches must share one dense layout")
    q = torch.empty(b, q_len, num_heads, d, dtype=qkv.dtype, device=qkv.device)
    if b * q_len:
        _rope_store_kernel[(b * q_len, num_heads + 2 * num_kv_heads)](
            rows, cs_cos, cs_sin, q, k_cache, v_cache, out_slots.reshape(-1),
            rows.stride(0), cs_cos.stride(0), k_cache.stride(0), k_cache.stride(1),
            num_heads, num_kv_heads, float(kv_scales[0]), float(kv_scales[1]),
            HEAD_DIM=d, FP8=k_cache.dtype == torch.float8_e4m3fn, **pdl_args(rows))
    return q


# Argmax over a long last dimension (a vocabulary): torch reduces each row in one thread block,
# ~28 us for one 128K-wide row on an H200, the same for a handful of rows. Here each row is cut
# into ARGMAX_CHUNK-wide pieces reduced in parallel, then the pieces' winners are compared.
ARGMAX_CHUNK = 4096


@triton.jit
def _argmax_chunks_kernel(x_ptr, val_ptr, idx_ptr, n_cols, stride_x, num_chunks, BLOCK: tl.constexpr,
                          USE_GDC: tl.constexpr = False):
    gdc(USE_GDC)
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    cols = chunk * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * stride_x + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
    best = tl.max(x, 0)
    # The first column holding the maximum (as torch.argmax returns); padding columns come last.
    first = tl.min(tl.where(x == best, cols, 2147483647), 0)
    tl.store(val_ptr + row * num_chunks + chunk, best)
    tl.store(idx_ptr + row * num_chunks + chunk, first)


@triton.jit
def _argmax_combine_kernel(val_ptr, idx_ptr, out_ptr, num_chunks, BLOCK_C: tl.constexpr,
                           USE_GDC: tl.constexpr = False):
    gdc(USE_GDC)
    row = tl.program_id(0)
    c = tl.arange(0, BLOCK_C)
    valid = c < num_chunks
    v = tl.load(val_ptr + row * num_chunks + c, mask=valid, other=float("-inf"))
    i = tl.load(idx_ptr + row * num_chunks + c, mask=valid, other=2147483647)
    best = tl.max(v, 0)
    # Chunks are in column order, so the smallest index among the tied chunks is the first.
    tl.store(out_ptr + row, tl.min(tl.where(v == best, i, 2147483647), 0).to(tl.int64))


def argmax(x: torch.Tensor) -> torch.Tensor:
    """x [..., V] (finite values) -> int64 [...]: the index of the first maximum of each row,
    as torch.argmax(x, -1)."""
    v = x.shape[-1]
    rows = x.reshape(-1, v)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    n = rows.shape[0]
    chunks = triton.cdiv(v, ARGMAX_CHUNK)
    out = torch.empty(n, dtype=torch.int64, device=x.device)
    if n:
        vals = torch.empty(n, chunks, dtype=torch.float32, device=x.device)
        idx = torch.empty(n, chunks, dtype=torch.int32, device=x.device)
        _argmax_chunks_kernel[(n, chunks)](rows, vals, idx, v, rows.stride(0), chunks, BLOCK=ARGMAX_CHUNK,
                                           **pdl_args(rows))
        _argmax_combine_kernel[(n,)](vals, idx, out, chunks, BLOCK_C=triton.next_power_of_2(chunks),
                                     **pdl_args(rows))
    return out.view(x.shape[:-1])
