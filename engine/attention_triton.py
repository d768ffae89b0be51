"""Triton attention over the slot pool (the `fast` backend of attention.py).

One program per (request b, query block, query head). It streams the request's committed prefix
straight from the pool through its slot table, only up to prefix_lens[b] (no gather into a
[B, K] copy, no padded keys), then the in-flight keys under new_mask (causal, tree or ancestor
mask), with an online softmax in float32. GQA: query head h reads kv head h // (Hq / Hkv).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specdeploy.engine.attention import AttnBatch


@triton.jit
def _slot_attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, prefix_slots_ptr, prefix_lens_ptr, new_slots_ptr, new_mask_ptr,
    sm_scale,
    stride_qb, stride_qq, stride_qh,
    stride_ks, stride_kh,
    stride_ob, stride_oq, stride_oh,
    num_queries, prefix_width, num_new, group,
    HEAD_DIM: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
):
    b = tl.program_id(0)
    q_block = tl.program_id(1)
    head = tl.program_id(2)
    kv_head = head // group
    offs_q = q_block * BLOCK_Q + tl.arange(0, BLOCK_Q)
    offs_d = tl.arange(0, HEAD_DIM)
    q_valid = offs_q < num_queries
    q = tl.load(q_ptr + b * stride_qb + offs_q[:, None] * stride_qq + head * stride_qh + offs_d[None, :],
                mask=q_valid[:, None], other=0.0)
    m_i = tl.full([BLOCK_Q], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_Q], dtype=tl.float32)
    acc = tl.zeros([BLOCK_Q, HEAD_DIM], dtype=tl.float32)
    qk_scale = sm_scale * 1.4426950408889634  # exp2

    prefix_len = tl.load(prefix_lens_ptr + b)
    for start in range(0, prefix_len, BLOCK_K):
        offs_k = start + tl.arange(0, BLOCK_K)
        k_valid = offs_k < prefix_len
        slots = tl.load(prefix_slots_ptr + b * prefix_width + offs_k, mask=k_valid, other=0)
        k = tl.load(k_ptr + slots[:, None] * stride_ks + kv_head * stride_kh + offs_d[None, :],
                    mask=k_valid[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        s = tl.where(k_valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        v = tl.load(v_ptr + slots[:, None] * stride_ks + kv_head * stride_kh + offs_d[None, :],
                    mask=k_valid[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new

    for start in range(0, num_new, BLOCK_K):
        offs_k = start + tl.arange(0, BLOCK_K)
        k_valid = offs_k < num_new
        slots = tl.load(new_slots_ptr + b * num_new + offs_k, mask=k_valid, other=0)
        allowed = tl.load(new_mask_ptr + b * num_queries * num_new + offs_q[:, None] * num_new
                          + offs_k[None, :], mask=q_valid[:, None] & k_valid[None, :], other=0) != 0
        k = tl.load(k_ptr + slots[:, None] * stride_ks + kv_head * stride_kh + offs_d[None, :],
                    mask=k_valid[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # Rows with nothing visible yet keep m = -inf; shift by 0 there to avoid inf - inf.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        v = tl.load(v_ptr + slots[:, None] * stride_ks + kv_head * stride_kh + offs_d[None, :],
                    mask=k_valid[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(out_ptr + b * stride_ob + offs_q[:, None] * stride_oq + head * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=q_valid[:, None])


def supported(q: torch.Tensor) -> bool:
    d = q.shape[-1]
    return d >= 16 and d & (d - 1) == 0


def attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: AttnBatch,
           scale: float) -> torch.Tensor:
    """Same contract as attention.reference: q [B, Q, Hq, D] -> [B, Q, Hq, D]."""
    b, num_q, hq, d = q.shape
    hkv = k_cache.shape[1]
    q = q.contiguous()
    out = torch.empty_like(q)
    prefix_slots = batch.prefix_slots.contiguous()
    new_slots = batch.new_slots.contiguous()
    new_mask = batch.new_mask.contiguous()
    block_q = max(16, min(64, triton.next_power_of_2(num_q)))
    grid = (b, triton.cdiv(num_q, block_q), hq)
    _slot_attention_kernel[grid](
        q, k_cache, v_cache, out, prefix_slots, batch.prefix_lens, new_slots, new_mask, scale,
        q.stride(0), q.stride(1), q.stride(2),
        k_cache.stride(0), k_cache.stride(1),
        out.stride(0), out.stride(1), out.stride(2),
        num_q, prefix_slots.shape[1], new_slots.shape[1], hq // hkv,
        HEAD_DIM=d, BLOCK_Q=block_q, BLOCK_K=32,
        # float32 models get float32 products (TF32 would round away the reference's precision).
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )
    return out
