"""Small-M weight-streaming linear: y [M, N] = x [M, K] @ W^T (+ bias) for M <= GEMV_MAX_M
(decode, small verify batches), W either e4m3 codes with scales (the grids of
engine/kernels/fp8.py) or plain bf16/fp16/fp32 weights.

At these M a linear is a read of W: the kernel's only job is to keep HBM busy. A 4096-wide
layer cut into 32-64-row slabs makes 64-128 programs on 132 SMs, one per SM with ~16 KB in
flight, which is latency-bound; so the output is cut into narrow slabs (BLOCK_N 4-128) and K
into SPLIT_K ranges, >= ~4 programs per SM, each streaming [BLOCK_N, BLOCK_K] tiles (BLOCK_K up
to 512, K contiguous, 16-byte loads) through a num_stages-deep pipeline.

Split-K is finished inside the same kernel (no reduce launch, no memset): with SPLIT_K > 1 each
program stores its float32 partial [M, BLOCK_N] to a workspace [SPLIT_K, M, N], a barrier and one
acq_rel atomic increment of the tile's counter follow, and the program that sees SPLIT_K - 1 reads
every partial back through L2 (`.cg`: L1 is not coherent across SMs), adds them and the bias,
writes y and resets the counter to 0 (atomic_xchg), so each CUDA-graph replay starts from zeros.
Workspaces and counters are allocated once per (device, N) on the first eager call at that N
(whatever its split) and kept for the process (graphs hold their pointers; the planner counts them: plan.py gemv_workspace_bytes).
Calls that share an N share them, so calls must be issued on one stream at a time (the engine
runs a model on one stream). A capture that meets an N with no workspace yet runs SPLIT_K = 1
instead of allocating inside the graph.

Three inner loops (the launch's variant):
- "fma" (M 1..4, any BLOCK_N >= 4): W tiles widened to float32 times the x row(s), accumulated
  element-wise in [BLOCK_M, BLOCK_N, 128] registers and summed once at the end;
- "dot" (M 5..16): tl.dot with BLOCK_M = 16 (its smallest), float32 accumulation;
- "dot8" / "wg8" (FP8 weights, any M): each 128-wide group of x quantized to e4m3 in registers exactly
  as act_quant does it for the W8A8 prefill path (DeepSeek's per-token-group scales), then an
  e4m3 x e4m3 tl.dot: the weight codes go to the tensor cores as loaded. Widening e4m3 costs
  ALU work per weight byte that a 4 TB/s stream cannot afford on every SM; this has none, and
  its numerics are the prefill kernel's (activations rounded to e4m3, as the checkpoint's
  producers define FP8 inference), where fma/dot keep activations unquantized. dot8 pads x to
  16 rows (Triton's mma.sync path, which widens both operands to f16 on sm_90); wg8 pads to 64
  rows, where Triton emits Hopper's native e4m3 wgmma (m64nNk32) and the codes stay 8-bit;
- "sw8" (FP8 weights, any M): dot8's numerics with the product swapped, W [BLOCK_N, K] @ xq^T:
  the weight tile is the wgmma's 64-row e4m3 operand, taken from shared memory as loaded, and x
  (16 padded rows) its N, so nothing is widened and x is not padded to 64 rows as in wg8;
- "dot16" / "wg16" (FP8 weights, bf16/fp16 x): the weight-only product on the f16 tensor cores
  (16 / 64 padded rows). e4m3 -> f16 is a single cvt per two codes; x is scaled per row and
  128-wide group by a power of two into f16 exactly (unquantized, unlike dot8), the scale
  multiplied back onto the group's partial dot. float32 x runs the plain dot instead. With one
  row (batch-1 decode) x is scaled and converted as a 1-D row, one element a thread, and put in
  row 0 of the operand (ONE_ROW), so the padding rows cost no ALU work; with 2-8 rows (X_ROWS)
  the same on [next_pow2(M), 128], repeated down the operand and zeroed past the real rows.
Scales (SCALE_MODE, chosen on the host): 0 none (plain weights); 1 one value per 128-wide k group
for the whole tile (block scales with BLOCK_N inside one 128-row scale block): folded into x (fma)
or into the tile's dot (dot), never applied per element; 2 one value per output row for all of
K (per channel; per tensor has a zero stride): applied to the sums at the end; 3 one value per
(row, k group) (rows layouts of fused parts, or BLOCK_N wider than a scale block).
Accumulation is float32 and the output is written in x's dtype. The kernel takes part in
programmatic dependent launch like the others (engine/kernels/launch.py); with PDL it can
prefetch the first launch.prefetch_bytes() of each weight row into L2 before its wait (off by
default: measured no faster, docs/engine.md).

FP8 weights with 1-8 rows of bf16/f16 x have a fourth loop outside this kernel: "mma", the CUDA
kernel of engine/kernels/fp8_mma.py (the codes widened in registers straight into mma.sync
fragments, x the mma's N), which `launch` hands such a launch to where it is usable, else the
launch the table gives the Triton kernel.

Launch parameters come from GEMV_TABLE, keyed by (weight kind, N, K, M bucket), where
bench/gemv_sweep.py puts what it measures (`install_table` puts a just-measured table in place
in-process); shapes not in it get `heuristic_config`. For plain weights an entry may say
"cublas": the caller then runs F.linear (`plain_linear` returns None). The kind "mma" keys the
FP8 launches of the CUDA kernel, taken before the kind "fp8" (the Triton kernel's) wherever
that kernel is usable and measured faster.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from specdeploy.engine.kernels import fp8_mma
from specdeploy.engine.kernels.launch import after_library_gemm, gdc, pdl_args, prefetch_bytes
from specdeploy.engine.planner.plan import GEMV_MAX_M, GEMV_MAX_SPLIT_K, GEMV_MIN_BLOCK_N, GEMV_SPLIT_MAX_N

GROUP_K = 128  # scale tile width along K; also the inner step of the k loop
M_BUCKETS = (1, 4, 8, 16)  # a call with M rows uses the first bucket >= M
TRITON_VARIANTS = ("fma", "dot", "dot16", "wg16", "dot8", "wg8", "sw8")  # the loops of _gemv_kernel
VARIANTS = (*TRITON_VARIANTS, "mma", "cublas")  # "mma": engine/kernels/fp8_mma.py's CUDA kernel
QUANTIZING_VARIANTS = ("dot8", "wg8", "sw8")  # activations rounded to e4m3 in the kernel
MIN_BLOCK_N = GEMV_MIN_BLOCK_N
MIN_K_BLOCKS_PER_SPLIT = 4  # the heuristic keeps each split's k range this many BLOCK_Ks long
CTAS_PER_SM = 4  # the heuristic's target occupancy: programs per SM
PREFETCH_SECTOR = 32  # bytes one L2 prefetch asks for (a sector)


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, s_ptr, bias_ptr, out_ptr, ws_ptr, cnt_ptr,
                 M, N, K, K_SPLIT, stride_xm, stride_wn, stride_om, stride_sn, stride_sk,
                 SCALE_MODE: tl.constexpr, SCALE_N: tl.constexpr, HAS_BIAS: tl.constexpr,
                 USE_DOT: tl.constexpr, PRECISION: tl.constexpr, EVEN_K: tl.constexpr,
                 SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, SUB_K: tl.constexpr, STAGES: tl.constexpr, USE_GDC: tl.constexpr,
                 QUANT_X: tl.constexpr = False, ROUND_SCALE: tl.constexpr = False, X_F16: tl.constexpr = False,
                 ONE_ROW: tl.constexpr = False, X_ROWS: tl.constexpr = 0, PF_COLS: tl.constexpr = 0,
                 PF_STEP: tl.constexpr = 32, SWAP: tl.constexpr = False):
    if PF_COLS > 0:
        # The weights are no kernel's output, so they need not wait: launched early by PDL, the
        # program pulls the first PF_COLS columns of its rows into L2 (one 32-byte sector, PF_STEP
        # elements, a prefetch) while the previous kernel drains, and its stream below starts there.
        pf_rows = tl.minimum(tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N), N - 1)
        pf_cols = tl.minimum(tl.program_id(1) * K_SPLIT + tl.arange(0, PF_COLS // PF_STEP) * PF_STEP, K - 1)
        tl.inline_asm_elementwise("prefetch.global.L2 [$1]; // $0", "=r,l",
                                  [w_ptr + pf_rows[:, None] * stride_wn + pf_cols[None, :]],
                                  dtype=tl.int32, is_pure=False, pack=1)
    gdc(USE_GDC)  # nothing else is read or written before the previous kernel is done (launch.py)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_s = tl.arange(0, SUB_K)
    # Weight rows past N read the last real row instead of masking (the loads stay unmasked and
    # vectorized); x rows past M are masked (zeros, no memory traffic: a one-row call padded to
    # 16 or 64 rows would otherwise stage the same row that many times); the stores are masked.
    m_ok = offs_m < M
    rows_n = tl.minimum(offs_n, N - 1)
    k_lo = pid_k * K_SPLIT
    k_hi = tl.minimum(k_lo + K_SPLIT, K)
    x_base = x_ptr + offs_m[:, None] * stride_xm                        # [BLOCK_M, 1]
    w_base = w_ptr + rows_n[:, None] * stride_wn                        # [BLOCK_N, 1]
    s_rows = s_ptr + (rows_n // SCALE_N) * stride_sn                    # [BLOCK_N]
    s_tile = s_ptr + (pid_n * BLOCK_N // SCALE_N) * stride_sn           # scalar (SCALE_MODE 1)
    if SWAP:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    elif USE_DOT:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    elif BLOCK_M == 1:
        acc = tl.zeros((BLOCK_N, SUB_K), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N, SUB_K), dtype=tl.float32)
    # tl.range's num_stages: without it Triton pipelines only loads that feed a tl.dot, so the
    # fma loop would keep one tile in flight.
    for k0 in tl.range(k_lo, k_hi, BLOCK_K, num_stages=STAGES):
        for g in tl.static_range(BLOCK_K // SUB_K):
            k = k0 + g * SUB_K + offs_s                                  # [SUB_K]
            if ONE_ROW or (BLOCK_M == 1 and not USE_DOT):
                # one x row: a 1-D load, broadcast over the tile's rows as a slice of its layout
                if EVEN_K:
                    xv = tl.load(x_ptr + k)
                else:
                    xv = tl.load(x_ptr + k, mask=k < k_hi, other=0.0)
            elif X_ROWS > 0:
                # the real rows only (a power of two >= M), [X_ROWS, SUB_K]
                offs_xr = tl.arange(0, X_ROWS)
                xr_ptrs = x_ptr + offs_xr[:, None] * stride_xm + k[None, :]
                if EVEN_K:
                    xv = tl.load(xr_ptrs, mask=(offs_xr < M)[:, None], other=0.0)
                else:
                    xv = tl.load(xr_ptrs, mask=(offs_xr < M)[:, None] & (k < k_hi)[None, :], other=0.0)
            elif EVEN_K:
                xv = tl.load(x_base + k[None, :], mask=m_ok[:, None], other=0.0)
            else:
                xv = tl.load(x_base + k[None, :], mask=m_ok[:, None] & (k < k_hi)[None, :], other=0.0)
            if EVEN_K:
                wv = tl.load(w_base + k[None, :])
            else:
                wv = tl.load(w_base + k[None, :], mask=(k < k_hi)[None, :], other=0.0)
            # the 128-wide k group (a group wholly past K reads the last one, times zeros)
            kg = tl.minimum((k0 + g * SUB_K) // SUB_K, (K - 1) // SUB_K)
            if SWAP:
                # "sw8": x quantized as dot8 does it, then the product transposed, W [BLOCK_N,
                # SUB_K] @ xq^T [SUB_K, BLOCK_M]: the weight codes are the wide operand, so
                # Hopper's e4m3 wgmma takes them from shared memory as loaded and x is padded to
                # BLOCK_M = 16 columns (its N), not 64 rows
                xf = xv.to(tl.float32)
                sx = tl.maximum(tl.max(tl.abs(xf), axis=1), 1e-4) / 448.0          # [BLOCK_M]
                if ROUND_SCALE:
                    sx = tl.exp2(tl.ceil(tl.log2(sx)))
                part = tl.dot(wv, tl.trans((xf / sx[:, None]).to(tl.float8e4nv))) * sx[None, :]
                if SCALE_MODE == 1:
                    part = part * tl.load(s_tile + kg * stride_sk)
                elif SCALE_MODE == 3:
                    part = part * tl.load(s_rows + kg * stride_sk)[:, None]
                acc += part                                                         # [BLOCK_N, BLOCK_M]
            elif USE_DOT and QUANT_X:
                # "dot8": x quantized per row and 128-wide group as act_quant does it (DeepSeek's
                # s = max(|x|, 1e-4) / 448, ue8m0 checkpoints round s up to a power of two), then
                # e4m3 x e4m3 on the tensor cores: the weight codes are never widened.
                xf = xv.to(tl.float32)
                sx = tl.maximum(tl.max(tl.abs(xf), axis=1), 1e-4) / 448.0          # [BLOCK_M]
                if ROUND_SCALE:
                    sx = tl.exp2(tl.ceil(tl.log2(sx)))
                part = tl.dot((xf / sx[:, None]).to(tl.float8e4nv), tl.trans(wv)) * sx[:, None]
                if SCALE_MODE == 1:
                    part = part * tl.load(s_tile + kg * stride_sk)
                elif SCALE_MODE == 3:
                    part = part * tl.load(s_rows + kg * stride_sk)[None, :]
                acc += part
            elif USE_DOT and X_F16 and ONE_ROW:
                # dot16 with one row (batch-1 decode): x's scaling and conversion on the 1-D row
                # (one element a thread, not 16 or 64 padded rows' worth), then placed in row 0 of
                # the MMA operand, zeros below
                xf = xv.to(tl.float32)                                              # [SUB_K]
                e_bits = tl.maximum(tl.max(tl.abs(xf), axis=0), 1e-30).to(tl.int32, bitcast=True) & 0x7F800000
                inv = (0x7F000000 - e_bits).to(tl.float32, bitcast=True)
                xh = tl.where(offs_m[:, None] == 0, (xf * inv)[None, :], 0.0).to(tl.float16)
                part = tl.dot(xh, tl.trans(wv.to(tl.float16))) * e_bits.to(tl.float32, bitcast=True)
                if SCALE_MODE == 1:
                    part = part * tl.load(s_tile + kg * stride_sk)
                elif SCALE_MODE == 3:
                    part = part * tl.load(s_rows + kg * stride_sk)[None, :]
                acc += part
            elif USE_DOT and X_F16 and X_ROWS > 0:
                # dot16 with 2-8 rows: x scaled and converted as [X_ROWS, SUB_K], then repeated
                # down the operand's BLOCK_M rows and zeroed past X_ROWS
                xf = xv.to(tl.float32)
                e_bits = tl.maximum(tl.max(tl.abs(xf), axis=1), 1e-30).to(tl.int32, bitcast=True) & 0x7F800000
                inv = (0x7F000000 - e_bits).to(tl.float32, bitcast=True)
                xh = (xf * inv[:, None]).to(tl.float16)                             # [X_ROWS, SUB_K]
                xh = tl.reshape(tl.broadcast_to(xh[None, :, :], (BLOCK_M // X_ROWS, X_ROWS, SUB_K)), (BLOCK_M, SUB_K))
                xh = tl.where(offs_m[:, None] < X_ROWS, xh, 0.0).to(tl.float16)
                sx = tl.reshape(tl.broadcast_to(e_bits.to(tl.float32, bitcast=True)[None, :], (BLOCK_M // X_ROWS, X_ROWS)),
                                (BLOCK_M,))
                part = tl.dot(xh, tl.trans(wv.to(tl.float16))) * sx[:, None]
                if SCALE_MODE == 1:
                    part = part * tl.load(s_tile + kg * stride_sk)
                elif SCALE_MODE == 3:
                    part = part * tl.load(s_rows + kg * stride_sk)[None, :]
                acc += part
            elif USE_DOT and X_F16:
                # "dot16": f16 tensor cores, e4m3 -> f16 is one cvt per two codes (-> bf16 is
                # two more per code). x rides along scaled by a power of two per row and 128-wide
                # group, 2^floor(log2 max|x|) from the exponent bits: x / s is exact and < 2 (a
                # bf16 value's 8 bits fit f16's 11; only parts below 2^-14 of the group's largest
                # round, by at most 2^-25 of it), so this is the weight-only product, unquantized.
                xf = xv.to(tl.float32)
                amax = tl.maximum(tl.max(tl.abs(xf), axis=1), 1e-30)               # [BLOCK_M]
                e_bits = amax.to(tl.int32, bitcast=True) & 0x7F800000
                sx = e_bits.to(tl.float32, bitcast=True)                           # 2^floor(log2 amax)
                inv = (0x7F000000 - e_bits).to(tl.float32, bitcast=True)           # 1 / sx, exactly
                part = tl.dot((xf * inv[:, None]).to(tl.float16), tl.trans(wv.to(tl.float16))) * sx[:, None]
                if SCALE_MODE == 1:
                    part = part * tl.load(s_tile + kg * stride_sk)
                elif SCALE_MODE == 3:
                    part = part * tl.load(s_rows + kg * stride_sk)[None, :]
                acc += part
            elif USE_DOT:
                part = tl.dot(xv, tl.trans(wv.to(xv.dtype)), input_precision=PRECISION)
                if SCALE_MODE == 1:
                    part = part * tl.load(s_tile + kg * stride_sk)
                elif SCALE_MODE == 3:
                    part = part * tl.load(s_rows + kg * stride_sk)[None, :]
                acc += part
            else:
                xf = xv.to(tl.float32)
                wf = wv.to(tl.float32)
                if SCALE_MODE == 1:
                    xf = xf * tl.load(s_tile + kg * stride_sk)
                elif SCALE_MODE == 3:
                    wf = wf * tl.load(s_rows + kg * stride_sk)[:, None]
                if BLOCK_M == 1:
                    acc += wf * xf[None, :]                              # [BLOCK_N, SUB_K]
                else:
                    acc += xf[:, None, :] * wf[None, :, :]               # [BLOCK_M, BLOCK_N, SUB_K]
    if SWAP:
        y = tl.trans(acc)
    elif USE_DOT:
        y = acc
    elif BLOCK_M == 1:
        y = tl.sum(acc, axis=1)[None, :]
    else:
        y = tl.sum(acc, axis=2)
    if SCALE_MODE == 2:
        y = y * tl.load(s_rows)[None, :]
    out_mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            y += tl.load(bias_ptr + rows_n).to(tl.float32)[None, :]
        tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], y.to(out_ptr.dtype.element_ty),
                 mask=out_mask)
    else:
        part_ptrs = ws_ptr + offs_m[:, None] * N + offs_n[None, :]      # [BLOCK_M, BLOCK_N] of split 0
        tl.store(part_ptrs + pid_k * M * N, y, mask=out_mask)
        tl.debug_barrier()  # every thread's partial is stored before the release below
        done = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel")
        if done == SPLIT_K - 1:
            total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for s in range(SPLIT_K):
                total += tl.load(part_ptrs + s * M * N, mask=out_mask, other=0.0, cache_modifier=".cg")
            if HAS_BIAS:
                total += tl.load(bias_ptr + rows_n).to(tl.float32)[None, :]
            tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :],
                     total.to(out_ptr.dtype.element_ty), mask=out_mask)
            tl.atomic_xchg(cnt_ptr + pid_n, 0)


# --------------------------------------------------------------------------------------------
# launch configurations


def m_bucket(m: int) -> int:
    return next(b for b in M_BUCKETS if m <= b)


# (kind, N, K, M bucket) -> (variant, BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages); kind
# "fp8" (e4m3 codes, any scale layout), "plain" (bf16/fp16/fp32 weights) or "mma" (e4m3 codes on
# engine/kernels/fp8_mma.py's CUDA kernel, taken first where it is usable). bench/gemv_sweep.py
# prints a measured table in this format; paste it here. Measured with `python3
# bench/gemv_sweep.py --out DIR` (the Llama-3.1-8B shapes, bf16 activations, graphs of back-to-back
# launches): the plain rows on an H200 2026-12-01 12:22 UTC, the fp8 rows on an H200 2026-12-02
# 20:19 UTC (commit 48cc106, docs/benchmarks/runs/2026-12-02-48cc106/gemv_sweep.json, M 8 timed),
# the mma rows on an H100 2026-12-06 11:14 UTC (`--weights fp8 --m 1,4,8`,
# docs/benchmarks/runs/2026-12-06-mma/gemv_sweep.json: an mma row where the kernel beat that run's
# best Triton launch); other GPUs run these launches too, only perhaps not the fastest ones.
GEMV_TABLE: dict[tuple[str, int, int, int], tuple[str, int, int, int, int, int]] = {
    ('fp8', 4096, 4096, 1): ('fma', 8, 512, 1, 2, 3),
    ('fp8', 4096, 4096, 4): ('dot8', 64, 256, 8, 4, 3),
    ('fp8', 4096, 4096, 8): ('sw8', 64, 128, 8, 4, 3),
    ('fp8', 4096, 4096, 16): ('dot16', 64, 128, 8, 4, 5),
    ('fp8', 4096, 14336, 1): ('fma', 16, 512, 2, 2, 3),
    ('fp8', 4096, 14336, 4): ('dot8', 64, 256, 8, 4, 3),
    ('fp8', 4096, 14336, 8): ('dot8', 64, 256, 8, 4, 3),
    ('fp8', 4096, 14336, 16): ('dot16', 64, 256, 8, 4, 3),
    ('fp8', 6144, 4096, 1): ('fma', 16, 512, 1, 2, 3),
    ('fp8', 6144, 4096, 4): ('sw8', 64, 128, 4, 4, 3),
    ('fp8', 6144, 4096, 8): ('sw8', 64, 128, 4, 4, 3),
    ('fp8', 6144, 4096, 16): ('sw8', 64, 128, 4, 4, 3),
    ('fp8', 28672, 4096, 1): ('fma', 16, 512, 1, 2, 3),
    ('fp8', 28672, 4096, 4): ('sw8', 64, 128, 2, 4, 3),
    ('fp8', 28672, 4096, 8): ('dot8', 64, 256, 2, 4, 3),
    ('fp8', 28672, 4096, 16): ('dot16', 64, 256, 1, 4, 3),
    ('plain', 4096, 4096, 1): ('fma', 8, 512, 1, 2, 3),
    ('plain', 4096, 4096, 4): ('cublas', 0, 0, 1, 0, 0),
    ('plain', 4096, 4096, 8): ('dot', 32, 128, 4, 4, 3),
    ('plain', 4096, 4096, 16): ('dot', 32, 128, 4, 4, 3),
    ('plain', 4096, 14336, 1): ('fma', 8, 512, 1, 2, 3),
    ('plain', 4096, 14336, 4): ('cublas', 0, 0, 1, 0, 0),
    ('plain', 4096, 14336, 8): ('dot', 32, 128, 4, 4, 3),
    ('plain', 4096, 14336, 16): ('dot', 32, 128, 4, 4, 3),
    ('plain', 6144, 4096, 1): ('fma', 8, 512, 1, 2, 3),
    ('plain', 6144, 4096, 4): ('cublas', 0, 0, 1, 0, 0),
    ('plain', 6144, 4096, 8): ('cublas', 0, 0, 1, 0, 0),
    ('plain', 6144, 4096, 16): ('cublas', 0, 0, 1, 0, 0),
    ('plain', 28672, 4096, 1): ('fma', 8, 512, 1, 2, 3),
    ('plain', 28672, 4096, 4): ('cublas', 0, 0, 1, 0, 0),
    ('plain', 28672, 4096, 8): ('cublas', 0, 0, 1, 0, 0),
    ('plain', 28672, 4096, 16): ('cublas', 0, 0, 1, 0, 0),
    ('plain', 128256, 4096, 1): ('fma', 8, 512, 1, 2, 3),
    ('plain', 128256, 4096, 4): ('dot', 64, 128, 1, 4, 4),
    ('plain', 128256, 4096, 8): ('dot', 64, 128, 1, 4, 3),
    ('plain', 128256, 4096, 16): ('dot', 64, 128, 1, 4, 3),
    # the CUDA mma kernel (engine/kernels/fp8_mma.py), where it beat the Triton launches above
    ('mma', 4096, 4096, 1): ('mma', 16, 512, 1, 8, 1),
    ('mma', 4096, 4096, 4): ('mma', 16, 256, 1, 8, 1),
    ('mma', 4096, 4096, 8): ('mma', 32, 256, 2, 8, 1),
    ('mma', 4096, 14336, 1): ('mma', 16, 256, 1, 8, 2),
    ('mma', 4096, 14336, 4): ('mma', 32, 256, 4, 4, 1),
    ('mma', 6144, 4096, 1): ('mma', 16, 256, 1, 8, 1),
    ('mma', 6144, 4096, 4): ('mma', 32, 256, 1, 8, 1),
    ('mma', 28672, 4096, 1): ('mma', 16, 256, 1, 8, 1),
    ('mma', 28672, 4096, 4): ('mma', 32, 256, 1, 4, 1),
}


def install_table(table: dict) -> None:
    """Put measured entries in place in this process (bench/gemv_sweep.py after a sweep)."""
    for key, cfg in table.items():
        kind, n, k, mb = key
        if (kind not in ("fp8", "plain", "mma") or mb not in M_BUCKETS or cfg[0] not in VARIANTS or len(cfg) != 6
                or (kind == "mma") != (cfg[0] == "mma") or (kind == "mma" and mb > fp8_mma.MAX_M)
                or (kind == "fp8" and cfg[0] == "cublas")
                or (kind == "plain" and cfg[0] in ("dot16", "wg16", *QUANTIZING_VARIANTS))):
            raise ValueError(f"gemv table entry {key}: {cfg} is not a launch configuration")
        GEMV_TABLE[(kind, int(n), int(k), int(mb))] = tuple(cfg)


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def heuristic_config(kind: str, n: int, k: int, m: int, num_sms: int, mma: bool = False) -> tuple[str, int, int, int, int, int]:
    """A launch for shapes not in GEMV_TABLE. FP8 weights at up to 8 rows where the CUDA kernel is
    usable (`mma`): "mma" with CTAs of 8 warps stepping 256 k, 16 rows and two weight buffers
    up to 2 rows of x, 32 rows and one buffer above (what the 8B shapes' sweep chose at 1 and at
    4-8 rows, docs/engine.md), split along K while fewer than two CTAs per SM remain.
    Otherwise "dot16" at every M (counted in PTX: one cvt per two codes, where fma spends ~2.5
    instructions per code and the bf16 dot ~1.5), BLOCK_K 256. Each program converts and scales
    its [16, BLOCK_K] x tile whatever BLOCK_N is, so BLOCK_N starts at 64 (x's work under ~2.5x
    the codes') and widens to 128 while >= CTAS_PER_SM programs per SM remain; split-K makes up
    the rest, keeping >= MIN_K_BLOCKS_PER_SPLIT k blocks per split. Plain weights default to
    cuBLAS (the sweep decides where the kernel beats it)."""
    if kind == "plain":
        return ("cublas", 0, 0, 1, 0, 0)
    if mma and m <= fp8_mma.MAX_M:
        block_n, buffers = (fp8_mma.TILE_N, 2) if m <= 2 else (2 * fp8_mma.TILE_N, 1)
        tiles = triton.cdiv(n, block_n)
        split = max(1, min(triton.cdiv(2 * num_sms, tiles), k // (2 * 256), GEMV_MAX_SPLIT_K))
        return ("mma", block_n, 256, split, 8, buffers)
    block_k = 256
    target = CTAS_PER_SM * num_sms
    block_n = 64
    if triton.cdiv(n, 128) >= target:
        block_n = 128
    tiles = triton.cdiv(n, block_n)
    k_blocks = triton.cdiv(k, block_k)
    split = max(1, min(-(-target // tiles), k_blocks // MIN_K_BLOCKS_PER_SPLIT, GEMV_MAX_SPLIT_K))
    return ("dot16", block_n, block_k, split, 4, 3)


def _sms(device: torch.device) -> int:
    # CPU (the interpreter) plans for an H200's 132 SMs.
    return _num_sms(device.index or 0) if device.type == "cuda" else 132


def _mma_usable(device: torch.device) -> bool:
    return device.type == "cuda" and fp8_mma.available(device)


def config_for(kind: str, n: int, k: int, m: int, device: torch.device, mma: bool | None = None) -> tuple:
    """The launch for this shape: for FP8 weights at up to 8 rows the CUDA kernel's ("mma" entries,
    else its heuristic) where it is usable on `device` (mma=None: probe it) and the table has no
    faster Triton launch; otherwise the Triton kernel's entry, else its heuristic."""
    use_mma = kind == "fp8" and m <= fp8_mma.MAX_M and (_mma_usable(device) if mma is None else mma)
    mb = m_bucket(m)
    # with mma: its entry, else a measured Triton launch (no mma launch beat it), else its heuristic
    cfg = (use_mma and GEMV_TABLE.get(("mma", n, k, mb))) or GEMV_TABLE.get((kind, n, k, mb))
    return cfg or heuristic_config(kind, n, k, m, _sms(device), mma=use_mma)


# --------------------------------------------------------------------------------------------
# split-K workspaces


_WORKSPACES: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]] = {}


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def workspace(device: torch.device, n: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(float32 partials [GEMV_MAX_SPLIT_K * GEMV_MAX_M * N], int32 counters [ceil(N / 4)],
    zeros) for outputs N wide on `device`; made on first use, kept for the process. None when
    none exists yet and the stream is capturing a graph (never allocate zeroed counters there)."""
    key = (str(device), n)
    found = _WORKSPACES.get(key)
    if found is None:
        if _capturing(device):
            return None
        found = (torch.empty(GEMV_MAX_SPLIT_K * GEMV_MAX_M * n, dtype=torch.float32, device=device),
                 torch.zeros(triton.cdiv(n, MIN_BLOCK_N), dtype=torch.int32, device=device))
        _WORKSPACES[key] = found
    return found


def workspace_bytes() -> int:
    """Bytes this process's split-K workspaces and counters hold (for memory accounting)."""
    return sum(p.numel() * 4 + c.numel() * 4 for p, c in _WORKSPACES.values())


# --------------------------------------------------------------------------------------------
# host entry points


def _scale_layout(scale: torch.Tensor, scale_n: int, block_n: int) -> tuple[int, int, int, int]:
    """(SCALE_MODE, SCALE_N, stride along scale rows, stride along 128-wide k groups)."""
    if scale.numel() == 1:
        return 2, 1, 0, 0                        # per tensor: one value, applied at the end
    if scale.dim() == 1 or scale.shape[1] == 1:
        return 2, scale_n, scale.stride(0), 0    # per row (or per scale_n rows), all of K
    sn, sk = scale.stride(0), scale.stride(1)
    if scale_n % block_n == 0:
        return 1, scale_n, sn, sk                # the tile sits inside one scale row
    return 3, scale_n, sn, sk


def launch(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, scale_n: int,
           bias: torch.Tensor | None, out: torch.Tensor, variant: str, block_n: int, block_k: int,
           split_k: int, num_warps: int, num_stages: int, round_scale: bool = False) -> None:
    """One launch into `out` [M, N] with explicit parameters. x [M, K] (unit stride along K),
    weight [N, K] (unit stride along K), scale as engine/kernels/fp8.py (None: plain weights).
    round_scale: "dot8" activation scales rounded up to powers of two (ue8m0 checkpoints)."""
    m, k = x.shape
    n = weight.shape[0]
    if scale is not None and weight.dtype != torch.float8_e4m3fn:
        raise ValueError("gemv: scales come with e4m3 codes")
    if variant == "mma":
        if scale is None:
            raise ValueError("gemv: the mma launch multiplies e4m3 codes (FP8 weights only)")
        if _mma_usable(x.device) and fp8_mma.supports(x, weight, scale, scale_n, out, bias):
            ws = workspace(x.device, n) if n <= GEMV_SPLIT_MAX_N else None
            split, k_split = k_splits(k, fp8_mma.GROUP_K, split_k, ws is not None)
            fp8_mma.launch(x, weight, scale, scale_n, bias, out, block_n, block_k, split, k_split, num_warps,
                           num_stages, ws, bool(pdl_args(out)["USE_GDC"]))
            return
        # not a call that kernel computes (float32 x, more than 8 rows, a scale layout it does not
        # read) or no NVRTC here: the Triton kernel's launch for the shape
        variant, block_n, block_k, split_k, num_warps, num_stages = config_for("fp8", n, k, m, x.device, mma=False)
    mode, s_n, sn, sk = (0, 1, 0, 0) if scale is None else _scale_layout(scale, scale_n, block_n)
    ws = workspace(x.device, n) if n <= GEMV_SPLIT_MAX_N else None  # any eager call at a width makes it
    pdl = pdl_args(out)
    grid, constexprs = launch_constexprs("plain" if scale is None else "fp8", x.dtype, m, n, k, mode, s_n,
                                         bias is not None, ws is not None, variant, block_n, block_k, split_k,
                                         num_stages, round_scale, prefetch_bytes() if pdl["USE_GDC"] else 0,
                                         weight.element_size())
    if constexprs["SPLIT_K"] == 1:
        ws = (out, out)
    _gemv_kernel[grid](
        x, weight, scale if scale is not None else out, bias if bias is not None else out, out, ws[0], ws[1],
        m, n, k, constexprs.pop("K_SPLIT"), x.stride(0), weight.stride(0), out.stride(0), sn, sk,
        **constexprs, num_warps=num_warps, num_stages=num_stages, **pdl)


def k_splits(k: int, unit: int, split_k: int, may_split: bool) -> tuple[int, int]:
    """(splits, k range of one split) of a launch asking for `split_k` ranges of K in whole
    `unit`s: at most GEMV_MAX_SPLIT_K (the workspace's depth), none without a workspace
    (may_split False), no empty split."""
    k_units = triton.cdiv(k, unit)
    split = max(1, min(split_k, k_units, GEMV_MAX_SPLIT_K)) if may_split else 1
    k_split = triton.cdiv(k_units, split) * unit
    return triton.cdiv(k, k_split), k_split


def launch_constexprs(weight_kind: str, x_dtype: torch.dtype, m: int, n: int, k: int, mode: int, scale_n: int,
                      has_bias: bool, has_workspace: bool, variant: str, block_n: int, block_k: int, split_k: int,
                      num_stages: int, round_scale: bool = False, prefetch: int = 0,
                      weight_bytes: int = 1) -> tuple[tuple[int, int], dict]:
    """(grid, the kernel's constexprs plus K_SPLIT) of one launch: pure, so that a CPU test can
    put every launch the table and the heuristic make through the whole compiler. prefetch:
    bytes of each weight row (weight_bytes an element) pulled into L2 before the kernel's PDL
    wait (launch.prefetch_bytes), rounded down to a power of two of 32-byte sectors within
    the program's k range; 0 none."""
    if not 0 < m <= GEMV_MAX_M:
        raise ValueError(f"gemv: {m} rows (1..{GEMV_MAX_M})")
    if variant not in TRITON_VARIANTS or block_k % GROUP_K or block_n < MIN_BLOCK_N:
        raise ValueError(f"gemv: launch {variant, block_n, block_k} is not a kernel configuration")
    swap = variant == "sw8"
    quant_x = variant in ("dot8", "wg8")
    x_f16 = variant in ("dot16", "wg16")
    if (quant_x or x_f16 or swap) and weight_kind != "fp8":
        raise ValueError(f"gemv: the {variant} variant multiplies e4m3 codes (FP8 weights only)")
    if x_f16 and x_dtype == torch.float32:
        x_f16 = False  # float32 activations keep the exact (ieee) dot; f16 would round them
    use_dot = variant != "fma"
    block_m = 64 if variant in ("wg8", "wg16") else 16 if use_dot else triton.next_power_of_2(m)
    if use_dot and block_n < 16:
        raise ValueError("gemv: the dot variant needs BLOCK_N >= 16")
    split_k, k_split = k_splits(k, block_k, split_k, n <= GEMV_SPLIT_MAX_N and has_workspace)
    grid = (triton.cdiv(n, block_n), split_k)
    step = max(1, PREFETCH_SECTOR // weight_bytes)
    sectors = min(prefetch // weight_bytes, k_split) // step
    pf_cols = (1 << (sectors.bit_length() - 1)) * step if sectors > 0 else 0
    return grid, dict(
        K_SPLIT=k_split, SCALE_MODE=mode, SCALE_N=scale_n, HAS_BIAS=has_bias, USE_DOT=use_dot,
        QUANT_X=quant_x, ROUND_SCALE=round_scale, X_F16=x_f16, ONE_ROW=x_f16 and m == 1,
        X_ROWS=triton.next_power_of_2(m) if x_f16 and 1 < m and triton.next_power_of_2(m) < block_m else 0,
        PRECISION="ieee" if x_dtype == torch.float32 else "tf32", EVEN_K=k % block_k == 0,
        SPLIT_K=split_k, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SUB_K=GROUP_K, STAGES=num_stages,
        PF_COLS=pf_cols, PF_STEP=step, SWAP=swap)


def _rows(x: torch.Tensor) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, scale_n: int,
               bias: torch.Tensor | None = None, config: tuple | None = None,
               round_scale: bool = False) -> torch.Tensor:
    """x [..., K] @ (weight * scale)^T + bias for at most GEMV_MAX_M rows; weight e4m3 [N, K],
    scale a float32 grid [ceil(N / scale_n), ceil(K / 128)], per row [N] / [N, 1], or one value.
    round_scale: the checkpoint's activation scales are powers of two (dot8 launches)."""
    rows = _rows(x)
    n = weight.shape[0]
    out = torch.empty((rows.shape[0], n), dtype=x.dtype, device=x.device)
    cfg = config or config_for("fp8", n, rows.shape[1], rows.shape[0], x.device)
    if cfg[0] == "cublas":  # not a choice for codes; the heuristic decides instead
        cfg = heuristic_config("fp8", n, rows.shape[1], rows.shape[0], _sms(x.device))
    launch(rows, weight, scale, scale_n, bias, out, *cfg, round_scale=round_scale)
    return out.view(*x.shape[:-1], n)


def plain_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 config: tuple | None = None) -> torch.Tensor | None:
    """F.linear(x, weight, bias) through the kernel when x has at most GEMV_MAX_M rows, weight
    is [N, K] in x's dtype with unit stride along K, and the table does not say cuBLAS; None
    otherwise (the caller runs F.linear)."""
    k = x.shape[-1]
    m = x.numel() // k if k else 0
    if not 0 < m <= GEMV_MAX_M or weight.dtype != x.dtype or weight.stride(-1) != 1:
        return None
    n = weight.shape[0]
    cfg = config or config_for("plain", n, k, m, x.device)
    if cfg[0] == "cublas":
        return None
    rows = _rows(x)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    launch(rows, weight, None, 1, bias, out, *cfg)
    return out.view(*x.shape[:-1], n)


def library_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear through cuBLAS, the kernel launched after it without PDL (launch.py)."""
    y = torch.nn.functional.linear(x, weight, bias)
    after_library_gemm(y)
    return y
