"""Triton attention over the slot pool (the `fast` backend of attention.py).

Split-KV ("flash-decoding") layout, built for small batches, where one program per
(request, query head) leaves most of the GPU idle while it walks a long prefix alone:

- one program per (request b, kv head, block of query rows, key split). Its rows are every
  (query token, query head) pair of that kv head's GQA group, so K/V are loaded once per group
  instead of once per query head: row r is query token r // G of query head kv_head * G + r % G
  (G = Hq / Hkv).
- the committed prefix `prefix_slots[b, :prefix_lens[b]]` is cut into `num_splits` equal chunks
  (sized in the kernel from the request's own length, so a short request still spreads over all
  splits); each program streams its chunk straight from the pool through the slot table, and the
  last split also reads the in-flight keys under `new_mask` (causal, tree or ancestor mask).
- each program keeps an online softmax in float32 and writes its unnormalised partial
  (running max m, sum l, accumulator acc); `_combine_kernel` rescales and adds the partials.
  With one split the first kernel normalises and writes the output itself.

CUDA graphs: the split count and the partials' shapes depend only on tensor shapes (batch,
queries, heads, prefix width: the graph's static buffers), never on the lengths inside them, so a
captured graph replays for any lengths. Nothing is read back to the host.
"""

from __future__ import annotations

import functools
from typing import Protocol

import torch
import triton
import triton.language as tl

from specdeploy.engine.kernels.launch import gdc, pdl_args


class SlotBatch(Protocol):
    """What the kernel reads of a forward's slot addressing; models/attention.py's AttnBatch is
    one (the kernels sit below the models and name no type of theirs)."""

    prefix_slots: torch.Tensor  # [B, Kp] int64
    prefix_lens: torch.Tensor   # [B] int64
    new_slots: torch.Tensor     # [B, Kn] int64
    new_mask: torch.Tensor      # [B, Q, Kn] bool


MAX_SPLITS = 32             # bounds the partials buffer and the combine's width
PROGRAMS_PER_SM = 2         # enough resident programs to keep the loads in flight

# The launch choices below are what docs/benchmarks/runs/2026-12-02-kernels/decode_kernels.json
# measured (H200, Llama-3.1-8B shapes: 32 q / 8 kv heads, D 128, a 1024-key prefix; µs a launch
# in a CUDA graph of back-to-back layers, PDL). Shapes it did not measure keep the earlier choice.
# Both choices apply to row blocks of at most MEASURED_BLOCK_M rows, the measured decode launch
# (one query token x a GQA group of 4); prefill and verify rows in wider blocks keep the rest.
MEASURED_BLOCK_M = 16
BLOCK_K = 32                # keys per inner step of a split launch (batch 1: kept, see below)
# One split (decode at batch 64): BLOCK_K 64 74.12 µs vs 32 77.49 (BLOCK_K 64 with 2 stages
# 75.56; BLOCK_K 32 with 4 stages 78.42).
SINGLE_SPLIT_BLOCK_K = 64
MIN_KEYS_PER_SPLIT = 64     # a split shorter than this costs more in the combine than it saves
# ... except over a prefix table at least 1024 keys wide: batch 1, 1024 keys, 8 kv head
# programs: 32 splits (32 keys each) 8.60 µs, 16 splits 9.48, 8 splits 10.78 (split kernel +
# combine kernel). Narrower tables were not measured and keep MIN_KEYS_PER_SPLIT.
WIDE_PREFIX = 1024
WIDE_MIN_KEYS_PER_SPLIT = 32


@triton.jit
def _split_attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, part_acc_ptr, part_m_ptr, part_l_ptr,
    prefix_slots_ptr, prefix_lens_ptr, new_slots_ptr, new_mask_ptr,
    sm_scale,
    stride_qb, stride_qq, stride_qh,
    stride_ks, stride_kh,
    stride_ob, stride_oq, stride_oh,
    num_queries, num_heads, prefix_width, num_new, group, num_row_blocks,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    NUM_SPLITS: tl.constexpr, PRECISION: tl.constexpr, USE_GDC: tl.constexpr = False,
):
    gdc(USE_GDC)
    b = tl.program_id(0)
    kv_head = tl.program_id(1) // num_row_blocks
    row_block = tl.program_id(1) % num_row_blocks
    split = tl.program_id(2)
    rows = row_block * BLOCK_M + tl.arange(0, BLOCK_M)
    q_idx = rows // group                                   # [BLOCK_M] query token
    head = kv_head * group + rows % group                   # [BLOCK_M] query head
    row_valid = q_idx < num_queries
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + b * stride_qb + q_idx[:, None] * stride_qq + head[:, None] * stride_qh
                + offs_d[None, :], mask=row_valid[:, None], other=0.0)      # [BLOCK_M, D]
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    qk_scale = sm_scale * 1.4426950408889634  # exp2
    kv_off = kv_head * stride_kh

    # This split's share of the prefix: [lo, hi), a whole number of BLOCK_K steps.
    prefix_len = tl.load(prefix_lens_ptr + b)
    chunk = tl.cdiv(tl.cdiv(prefix_len, NUM_SPLITS), BLOCK_K) * BLOCK_K
    lo = split * chunk
    hi = tl.minimum(lo + chunk, prefix_len)
    for start in range(lo, hi, BLOCK_K):
        offs_k = start + tl.arange(0, BLOCK_K)
        k_valid = offs_k < hi
        slots = tl.load(prefix_slots_ptr + b * prefix_width + offs_k, mask=k_valid, other=0)
        k = tl.load(k_ptr + slots[:, None] * stride_ks + kv_off + offs_d[None, :],
                    mask=k_valid[:, None], other=0.0).to(q_ptr.dtype.element_ty)   # [BLOCK_K, D]
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        s = tl.where(k_valid[None, :], s, float("-inf"))                # [BLOCK_M, BLOCK_K]
        m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: every step has a valid key
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        v = tl.load(v_ptr + slots[:, None] * stride_ks + kv_off + offs_d[None, :],
                    mask=k_valid[:, None], other=0.0).to(q_ptr.dtype.element_ty)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new

    # The in-flight keys belong to the last split (a loop bound, not a branch).
    new_end = tl.where(split == NUM_SPLITS - 1, num_new, 0)
    for start in range(0, new_end, BLOCK_K):
        offs_k = start + tl.arange(0, BLOCK_K)
        k_valid = offs_k < num_new
        slots = tl.load(new_slots_ptr + b * num_new + offs_k, mask=k_valid, other=0)
        allowed = tl.load(new_mask_ptr + b * num_queries * num_new + q_idx[:, None] * num_new
                          + offs_k[None, :], mask=row_valid[:, None] & k_valid[None, :],
                          other=0) != 0                                 # [BLOCK_M, BLOCK_K]
        k = tl.load(k_ptr + slots[:, None] * stride_ks + kv_off + offs_d[None, :],
                    mask=k_valid[:, None], other=0.0).to(q_ptr.dtype.element_ty)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # Rows with nothing visible yet keep m = -inf; shift by 0 there to avoid inf - inf.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        v = tl.load(v_ptr + slots[:, None] * stride_ks + kv_off + offs_d[None, :],
                    mask=k_valid[:, None], other=0.0).to(q_ptr.dtype.element_ty)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new

    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(out_ptr + b * stride_ob + q_idx[:, None] * stride_oq + head[:, None] * stride_oh
                 + offs_d[None, :], out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None])
    else:
        # Partials [B, NUM_SPLITS, Q, Hq] (m, l) and [B, NUM_SPLITS, Q, Hq, D] (acc), float32.
        part = ((b * NUM_SPLITS + split) * num_queries + q_idx) * num_heads + head   # [BLOCK_M]
        tl.store(part_m_ptr + part, m_i, mask=row_valid)
        tl.store(part_l_ptr + part, l_i, mask=row_valid)
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], acc,
                 mask=row_valid[:, None])


@triton.jit
def _combine_kernel(
    part_acc_ptr, part_m_ptr, part_l_ptr, out_ptr,
    stride_ob, stride_oq, stride_oh,
    num_queries, num_heads,
    HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr, USE_GDC: tl.constexpr = False,
):
    """One program per (request, query token x query head): out = sum_s w_s acc_s / sum_s w_s l_s
    with w_s = 2^(m_s - max_s m_s); splits that saw no key have m_s = -inf, so w_s = 0."""
    gdc(USE_GDC)
    b = tl.program_id(0)
    qh = tl.program_id(1)                                   # query token * Hq + query head
    offs_s = tl.arange(0, NUM_SPLITS)
    offs_d = tl.arange(0, HEAD_DIM)
    part = (b * NUM_SPLITS + offs_s) * num_queries * num_heads + qh   # [S]
    m = tl.load(part_m_ptr + part)
    l_s = tl.load(part_l_ptr + part)
    acc = tl.load(part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :])   # [S, D]
    m_max = tl.max(m, 0)
    w = tl.exp2(m - tl.where(m_max == float("-inf"), 0.0, m_max))
    den = tl.sum(l_s * w, 0)
    out = tl.sum(acc * w[:, None], 0) / tl.where(den == 0.0, 1.0, den)
    q_idx = qh // num_heads
    head = qh % num_heads
    tl.store(out_ptr + b * stride_ob + q_idx * stride_oq + head * stride_oh + offs_d,
             out.to(out_ptr.dtype.element_ty))


def supported(q: torch.Tensor) -> bool:
    d = q.shape[-1]
    return d >= 16 and d & (d - 1) == 0


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # Triton's CPU interpreter (tests): small, so that small prefixes split too


def num_kv_splits(programs: int, prefix_width: int, sm_count: int, block_m: int) -> int:
    """Splits of the prefix per (request, kv head, row block): enough programs to occupy every
    SM about PROGRAMS_PER_SM times, none shorter than MIN_KEYS_PER_SPLIT keys of the prefix
    table's width (WIDE_MIN_KEYS_PER_SPLIT from WIDE_PREFIX keys up in row blocks of at most
    MEASURED_BLOCK_M rows: measured), at most MAX_SPLITS. A power of two (few kernel variants
    across widths). Depends on shapes only, so a CUDA graph captures one value."""
    wide = prefix_width >= WIDE_PREFIX and block_m <= MEASURED_BLOCK_M
    min_keys = WIDE_MIN_KEYS_PER_SPLIT if wide else MIN_KEYS_PER_SPLIT
    want = min(MAX_SPLITS, triton.cdiv(PROGRAMS_PER_SM * sm_count, programs),
               triton.cdiv(prefix_width, min_keys))
    return 1 << (max(want, 1).bit_length() - 1)


def row_blocking(rows: int) -> tuple[int, int]:
    """(BLOCK_M, row blocks) for one kv head's rows (query tokens x GQA group)."""
    block_m = max(16, min(64, triton.next_power_of_2(rows)))
    return block_m, triton.cdiv(rows, block_m)


def chosen_launch(b: int, num_q: int, hq: int, hkv: int, prefix_width: int,
                  device: torch.device) -> tuple[int, int]:
    """(splits, BLOCK_K) that `attend` launches at these shapes without overrides."""
    block_m, row_blocks = row_blocking(num_q * (hq // hkv))
    splits = num_kv_splits(b * hkv * row_blocks, prefix_width, _sm_count(device), block_m)
    return splits, launch_block_k(splits, block_m)


def launch_block_k(num_splits: int, block_m: int) -> int:
    """Keys per inner step: SINGLE_SPLIT_BLOCK_K for one split over at most
    MEASURED_BLOCK_M rows (the measured decode launch), BLOCK_K otherwise."""
    if num_splits == 1 and block_m <= MEASURED_BLOCK_M:
        return SINGLE_SPLIT_BLOCK_K
    return BLOCK_K


def attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: SlotBatch,
           scale: float, num_splits: int | None = None,
           kv_scales: tuple[float, float] | None = None, block_k: int | None = None,
           num_stages: int | None = None) -> torch.Tensor:
    """Same contract as attention.reference: q [B, Q, Hq, D] -> [B, Q, Hq, D].
    num_splits (a power of two) overrides the choice of `num_kv_splits` (tests).
    block_k (keys per inner step, a power of two >= 16) overrides `launch_block_k`'s choice and
    num_stages (Triton's software pipelining depth; None: its default) is passed to the launch:
    the options bench/decode_kernels.py sweeps.
    An e4m3 pool's codes are widened to q's dtype as they are loaded; its k_scale folds into
    the softmax scale and its v_scale multiplies the output."""
    b, num_q, hq, d = q.shape
    hkv = k_cache.shape[1]
    group = hq // hkv
    fp8_kv = k_cache.dtype == torch.float8_e4m3fn
    k_scale, v_scale = kv_scales or (1.0, 1.0)
    if fp8_kv:
        scale = scale * k_scale
    elif q.dtype != k_cache.dtype:
        # Autocast inference over a float32 pool hands bf16 queries: the kernel's dots need one
        # dtype, and the pool's is the wider one here.
        return attend(q.to(k_cache.dtype), k_cache, v_cache, batch, scale, num_splits,
                      block_k=block_k, num_stages=num_stages).to(q.dtype)
    if q.stride(-1) != 1:
        q = q.contiguous()
    # q may be a view of the fused q/k projection (heads strided past k's): the kernel takes its
    # strides; the output is dense.
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    prefix_slots = batch.prefix_slots.contiguous()
    new_slots = batch.new_slots.contiguous()
    new_mask = batch.new_mask.contiguous()
    block_m, row_blocks = row_blocking(num_q * group)
    if num_splits is None:
        num_splits = num_kv_splits(b * hkv * row_blocks, prefix_slots.shape[1], _sm_count(q.device),
                                   block_m)
    if num_splits < 1 or num_splits & (num_splits - 1):
        raise ValueError(f"num_splits={num_splits} is not a power of two")
    if block_k is None:
        block_k = launch_block_k(num_splits, block_m)
    if block_k < 16 or block_k & (block_k - 1):
        raise ValueError(f"block_k={block_k} is not a power of two >= 16")
    if num_splits > 1:
        part_m = torch.empty(b, num_splits, num_q, hq, dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty(b, num_splits, num_q, hq, d, dtype=torch.float32, device=q.device)
    else:
        part_m = part_l = part_acc = out  # not touched by the kernel
    _split_attention_kernel[(b, hkv * row_blocks, num_splits)](
        q, k_cache, v_cache, out, part_acc, part_m, part_l,
        prefix_slots, batch.prefix_lens, new_slots, new_mask, scale,
        q.stride(0), q.stride(1), q.stride(2),
        k_cache.stride(0), k_cache.stride(1),
        out.stride(0), out.stride(1), out.stride(2),
        num_q, hq, prefix_slots.shape[1], new_slots.shape[1], group, row_blocks,
        HEAD_DIM=d, BLOCK_M=block_m, BLOCK_K=block_k, NUM_SPLITS=num_splits,
        # float32 models get float32 products (TF32 would round away the reference's precision).
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", **pdl_args(q),
        **({} if num_stages is None else {"num_stages": num_stages}),
    )
    if num_splits > 1:
        _combine_kernel[(b, num_q * hq)](
            part_acc, part_m, part_l, out, out.stride(0), out.stride(1), out.stride(2),
            num_q, hq, HEAD_DIM=d, NUM_SPLITS=num_splits, **pdl_args(q))
    return out * v_scale if fp8_kv and v_scale != 1.0 else out
