"""Triton kernels for linear layers whose weights are FP8 e4m3 with scales (CUDA only; the layer
in engine/models/fp8.py dequantizes and runs F.linear elsewhere).

A weight W [N, K] is stored as e4m3 codes Wq and float32 scales S with W = Wq * S, one scale per
(SCALE_N x 128) tile: SCALE_N = 128 for DeepSeek-style block checkpoints (`weight_scale_inv`
[ceil(N/128), ceil(K/128)]), 1 for per-output-channel scales or for block scales that fused
parts (q/k/v) forced to one row each, and a zero stride for a per-tensor scale. The paths:

- decode (M <= DECODE_MAX_M rows): weight-only. Up to GEMV_MAX_M (16) rows the small-M
  weight-streaming kernel of engine/kernels/gemv.py (narrow slabs, split-K finished in-kernel);
  above, `_w8a16_kernel`. Each program streams a
  [BLOCK_N, K] slab of codes once, widens them to the activation dtype in registers (e4m3 is
  exactly representable in bf16), multiplies on the tensor cores in float32 and applies the
  scale per 128-wide k block. At batch 1 the layer reads N*K bytes instead of 2*N*K: the whole
  point of FP8 decode. Activations stay unquantized, so it is also the more accurate path.
- prefill (more rows): W8A8 as DeepSeek-V3 defines it. `act_quant` quantizes activations
  dynamically per token and per 128-wide group (s = max(|x|, 1e-4) / 448, optionally rounded up
  to a power of two for ue8m0 checkpoints; x / s to e4m3), then `_w8a8_kernel` multiplies e4m3
  by e4m3 on the tensor cores, a float32 accumulator per 128-wide k block scaled by the
  activation group's scale times the weight tile's.
- block weights above GEMV_MAX_M rows where DeepGEMM (below) is not installed and torch has it (SM90, torch with
  `torch.nn.functional.scaled_mm` block scaling): the same W8A8 numerics through cuBLASLt's
  block-scaled FP8 GEMM (activation scales 1x128, weight scales 128x128). Measured side by side
  on the H200 (bench/fp8_crossover.py, docs/engine.md): it beats bf16 from 17 rows up, where the
  Triton kernels above fall behind it (weight-only 0.76x bf16 at 64 rows). Whether it runs is
  probed once per device and output dtype on a small problem outside graph capture; where it
  does not (older torch, another GPU, float32 outputs cuBLASLt refuses), one log line says so
  and the Triton kernels serve.

- block weights above four rows where DeepGEMM is installed (`deep_gemm`, an optional
  dependency: DeepSeek's Hopper FP8 GEMMs, JIT-compiled with the machine's nvcc at first use of
  each kernel configuration, cached on disk under DG_JIT_CACHE_DIR): the same W8A8 numerics
  through `deep_gemm.fp8_gemm_nt`, WGMMA with the block scales applied in the main loop. Measured
  side by side (bench/gemm_choice.py, docs/engine.md) it beats cuBLASLt's block GEMM at every
  M (1.60x bf16 against 1.11x at 64 rows) and the small-M kernel at 8 and 16 rows (5-7 not
  timed; the small-M kernel's 5-8 row launches measured 0.90x bf16). Probed like
  torch's; where it is not installed or does not run, one log line says so and the route
  without it serves (the small-M kernel to 16 rows, torch's block GEMM above).

Which of these a block-scaled linear takes by M is one table, BLOCK_ROUTE (below).

Both take a bias and write the activation dtype.
"""

from __future__ import annotations

import logging
import time

import torch
import triton
import triton.language as tl

from specdeploy.engine.kernels import gemv, launch

GROUP_K = 128  # activation group width and weight scale tile width along K
DECODE_MAX_M = 64

log = logging.getLogger("specdeploy.engine.kernels.fp8")


@triton.jit
def _act_quant_kernel(x_ptr, y_ptr, s_ptr, n_rows, n_cols, stride_x, stride_s, stride_sg,
                      GROUP: tl.constexpr, GROUPS: tl.constexpr, ROWS: tl.constexpr, ROUND_SCALE: tl.constexpr,
                      USE_GDC: tl.constexpr):
    """ROWS rows x GROUPS groups of GROUP columns: y = e4m3(x / s), s = max|x| / 448 per group."""
    launch.gdc(USE_GDC)
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)                     # [ROWS]
    groups = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)                # [GROUPS]
    cols = groups[:, None] * GROUP + tl.arange(0, GROUP)[None, :]            # [GROUPS, GROUP]
    valid = (rows < n_rows)[:, None, None] & (cols < n_cols)[None, :, :]
    x = tl.load(x_ptr + rows[:, None, None] * stride_x + cols[None, :, :], mask=valid, other=0.0).to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(x), axis=2), 1e-4)                        # [ROWS, GROUPS]
    s = amax / 448.0
    if ROUND_SCALE:
        s = tl.exp2(tl.ceil(tl.log2(s)))
    y = x / s[:, :, None]
    tl.store(y_ptr + rows[:, None, None] * n_cols + cols[None, :, :], y.to(y_ptr.dtype.element_ty), mask=valid)
    tl.store(s_ptr + rows[:, None] * stride_s + groups[None, :] * stride_sg, s,
             mask=(rows < n_rows)[:, None] & (groups * GROUP < n_cols)[None, :])


# (rows, 128-wide groups) a program of act_quant quantizes. One row of 4 groups made a program of
# 512 elements (4 a thread) and, with M-fastest scales, four 4-byte stores M apart; the tile
# below has 16 rows' scales side by side (docs/engine.md, "act_quant": the measured choice).
ACT_QUANT_TILE = (16, 2)


def act_quant(x: torch.Tensor, round_scale: bool = False, column_major: bool = False,
              pad_rows_to: int = 1, fill_padding: bool = True,
              tile: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M, K], float32 scales [M, ceil(K / 128)]), x ~ y * s per group.
    column_major: the scales laid out M-fastest (strides (1, M)), as cuBLASLt's 1x128 block
    scaling reads them. pad_rows_to: both outputs get rows up to a multiple of it, codes 0 and
    scales 1 there (a GEMM's padded rows are its own, sliced off after); fill_padding False
    leaves them unwritten, for a consumer that reads only the first M rows (DeepGEMM: the padding
    only aligns the scale columns), two launches fewer. tile: (rows, groups) a program, powers
    of two (ACT_QUANT_TILE unless given: for benchmarks that compare)."""
    m, k = x.shape
    groups = triton.cdiv(k, GROUP_K)
    rows = triton.cdiv(m, pad_rows_to) * pad_rows_to
    y = torch.empty((rows, k), dtype=torch.float8_e4m3fn, device=x.device)
    if column_major:
        s = torch.empty((groups, rows), dtype=torch.float32, device=x.device).t()
    else:
        s = torch.empty((rows, groups), dtype=torch.float32, device=x.device)
    if rows > m and fill_padding:
        y[m:].zero_()
        s[m:].fill_(1.0)
    tile_rows, tile_groups = tile or ACT_QUANT_TILE
    if m:
        _act_quant_kernel[(triton.cdiv(m, tile_rows), triton.cdiv(groups, tile_groups))](
            x, y, s, m, k, x.stride(0), s.stride(0), s.stride(1),
            GROUP=GROUP_K, GROUPS=tile_groups, ROWS=tile_rows, ROUND_SCALE=round_scale, **launch.pdl_args(x))
    return y, s


@triton.jit
def _w8a16_kernel(x_ptr, w_ptr, ws_ptr, bias_ptr, out_ptr, M, N, K,
                  stride_xm, stride_wn, stride_om, stride_sn, stride_sk,
                  SCALE_N: tl.constexpr, HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
    w_ptrs = w_ptr + offs_n[None, :] * stride_wn + offs_k[:, None]             # [BLOCK_K, BLOCK_N]
    s_ptrs = ws_ptr + (offs_n // SCALE_N) * stride_sn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(tl.cdiv(K, BLOCK_K)):
        k_ok = offs_k < K - kb * BLOCK_K
        x = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        s = tl.load(s_ptrs + kb * stride_sk, mask=n_ok, other=0.0)
        acc += tl.dot(x, w.to(x.dtype), input_precision=PRECISION) * s[None, :]
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _w8a8_kernel(a_ptr, as_ptr, w_ptr, ws_ptr, bias_ptr, out_ptr, M, N, K,
                 stride_am, stride_asm, stride_wn, stride_om, stride_sn, stride_sk,
                 SCALE_N: tl.constexpr, HAS_BIAS: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 GROUP_M: tl.constexpr):
    # Programs walk the output in groups of GROUP_M row tiles so neighbours share weight tiles in L2.
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :]
    w_ptrs = w_ptr + offs_n[None, :] * stride_wn + offs_k[:, None]             # [BLOCK_K, BLOCK_N]
    as_ptrs = as_ptr + offs_m * stride_asm
    ws_ptrs = ws_ptr + (offs_n // SCALE_N) * stride_sn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(tl.cdiv(K, BLOCK_K)):
        k_ok = offs_k < K - kb * BLOCK_K
        a = tl.load(a_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        a_s = tl.load(as_ptrs + kb, mask=m_ok, other=0.0)
        w_s = tl.load(ws_ptrs + kb * stride_sk, mask=n_ok, other=0.0)
        acc += tl.dot(a, w) * a_s[:, None] * w_s[None, :]
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def _scale_strides(scale: torch.Tensor, scale_n: int) -> tuple[int, int]:
    """(stride along N tiles, stride along K tiles) of a scale grid; a scalar scale has none."""
    if scale.dim() == 0 or scale.numel() == 1:
        return 0, 0
    if scale.dim() == 1 or scale.shape[1] == 1:  # one scale per output row, all of K
        return scale.stride(0), 0
    return scale.stride(0), scale.stride(1)


# Launch parameters of the weight-only kernel, (BLOCK_N, num_warps, num_stages) by output width:
# narrow column slabs so that a 4096-wide layer still spreads over every SM at batch 1, and deep
# pipelines so that each SM keeps enough weight bytes in flight. bench/fp8_bench.py --sweep times
# the alternatives on the device; DECODE_TILES is where its best choice goes.
DECODE_TILES = ((8192, (32, 4, 4)), (None, (64, 4, 4)))


def _decode_tiles(m: int, n: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for the weight-only kernel: the fewest rows
    tl.dot allows (16) up to M, then DECODE_TILES by N."""
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    block_n, warps, stages = next(t for limit, t in DECODE_TILES if limit is None or n <= limit)
    return block_m, block_n, warps, stages


def w8a16(rows: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, scale_n: int, bias: torch.Tensor | None,
          out: torch.Tensor, block_m: int, block_n: int, num_warps: int, num_stages: int) -> None:
    """One launch of the weight-only kernel into `out` [M, N] with explicit launch parameters."""
    m, k = rows.shape
    n = weight.shape[0]
    stride_sn, stride_sk = _scale_strides(scale, scale_n)
    grid = (triton.cdiv(n, block_n), triton.cdiv(m, block_m))
    _w8a16_kernel[grid](
        rows, weight, scale, bias if bias is not None else out, out, m, n, k,
        rows.stride(0), weight.stride(0), out.stride(0), stride_sn, stride_sk,
        SCALE_N=scale_n, HAS_BIAS=bias is not None,
        PRECISION="ieee" if rows.dtype == torch.float32 else "tf32",
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=GROUP_K, num_warps=num_warps, num_stages=num_stages)


# The block-scaled FP8 GEMM libraries the route may take (BLOCK_ROUTE), by (option, device index,
# output dtype): True where the probe ran it and it agreed with the Triton W8A8 kernel, False
# where it did not (logged once). "torch_block": cuBLASLt through torch; "deep_gemm": DeepGEMM.
_LIBRARY_OK: dict[tuple[str, int, torch.dtype], bool] = {}
_PROBE_SHAPE = (17, 256, 512)  # (M, N, K): small; M unaligned, so the row padding is probed too
# cuBLASLt refuses 1x128 activation scales whose column (M floats) is not 16-byte aligned
# (CUBLAS_STATUS_NOT_SUPPORTED at 65 rows on the H200, 2026-12-01): rows are padded to this.
TORCH_BLOCK_ROW_ALIGN = 16
# DeepGEMM reads the activation scales through TMA: each column of M floats 16-byte aligned.
DEEP_GEMM_ROW_ALIGN = 4
_PROBE_TOLERANCE = 2**-6  # relative Frobenius gap to the Triton kernel; a wrong layout is ~1
# Where a library falls back to when it is not available here (the Triton kernels always are).
LIBRARY_FALLBACK = {"deep_gemm": "torch_block", "torch_block": "triton"}
_LIBRARY_NAMES = {"torch_block": "torch's block-scaled scaled_mm", "deep_gemm": "DeepGEMM (deep_gemm)"}
# What serves a library's linears where it is not usable (block_route's fallback), for its log line
_FALLBACK_SERVES = {
    "deep_gemm": (f"the route without it serves them (the small-M kernel up to {gemv.GEMV_MAX_M} rows, "
                  "above them torch's block-scaled scaled_mm where that is usable, else the Triton kernels)"),
    "torch_block": "the Triton kernels serve them"}
# The activation dtypes each library's GEMM writes (DeepGEMM's fp8_gemm_nt: bf16 or float32 D;
# float32 activations keep the Triton and small-M kernels, below)
_LIBRARY_DTYPES = {"deep_gemm": (torch.bfloat16,), "torch_block": (torch.bfloat16, torch.float16)}


def _torch_block_call(a: torch.Tensor, a_s: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                      out_dtype: torch.dtype) -> torch.Tensor:
    """a e4m3 [M, K] with column-major 1x128 scales [M, K/128], weight e4m3 [N, K] with 128x128
    scales [N/128, K/128] -> a @ W^T in out_dtype; operands and scales passed as views."""
    F = torch.nn.functional
    if hasattr(F, "scaled_mm") and hasattr(F, "ScalingType"):
        kinds = F.ScalingType
        return F.scaled_mm(a, weight.t(), a_s, kinds.BlockWise1x128, scale.t(), kinds.BlockWise128x128,
                           output_dtype=out_dtype)
    return torch._scaled_mm(a, weight.t(), a_s, scale.t(), out_dtype=out_dtype)


def torch_block_shape_ok(weight: torch.Tensor, scale: torch.Tensor, scale_n: int) -> bool:
    """Whether a block-scaled weight has the layout the library GEMMs read in place (cuBLASLt's
    128x128 scaling, DeepGEMM's 1d2d kernel): row-major codes with K a multiple of 512 (each
    N-tile's scale row then 16-byte aligned) and N of 128, and a row-major float32 grid of one
    scale per 128 x 128 tile."""
    n, k = weight.shape
    return (scale_n == 128 and scale.dim() == 2 and k % (4 * GROUP_K) == 0 and n % 128 == 0
            and tuple(scale.shape) == (n // 128, k // GROUP_K) and scale.stride() == (k // GROUP_K, 1)
            and weight.stride() == (k, 1))


def _deep_gemm():
    """The deep_gemm module (imported on first use: it loads its extension and CUDA libraries)."""
    import deep_gemm  # noqa: PLC0415 - optional dependency, imported only where the route asks for it
    return deep_gemm


def _library_linear(option: str, rows: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                    round_scale: bool) -> torch.Tensor:
    """rows [M, K] @ (weight * scale)^T through a library's block-scaled GEMM, activations
    quantized by `act_quant` (DeepSeek's numerics, as on the Triton W8A8 path)."""
    m = rows.shape[0]
    if option == "deep_gemm":
        a, a_s = act_quant(rows, round_scale, column_major=True, pad_rows_to=DEEP_GEMM_ROW_ALIGN,
                           fill_padding=False)
        out = torch.empty((m, weight.shape[0]), dtype=rows.dtype, device=rows.device)
        _deep_gemm().fp8_gemm_nt((a[:m], a_s[:m]), (weight, scale), out)
        return out
    a, a_s = act_quant(rows, round_scale, column_major=True, pad_rows_to=TORCH_BLOCK_ROW_ALIGN)
    return _torch_block_call(a, a_s, weight, scale, rows.dtype)[:m]


def _failure(e: Exception) -> str:
    """An exception as one short reason for a log line."""
    return f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"


def _device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def _probe_library(option: str, device: torch.device, out_dtype: torch.dtype) -> str | None:
    """None where the library's block-scaled GEMM runs here and matches the Triton W8A8 kernel;
    else why not."""
    if out_dtype not in _LIBRARY_DTYPES[option]:
        # float32 activations (the lossless checks) keep the project's kernels at every M, whose
        # launches for a given M are the same in a verify and in target-only decoding.
        return f"{out_dtype} activations: it serves {', '.join(str(d).removeprefix('torch.') for d in _LIBRARY_DTYPES[option])}"
    capability = torch.cuda.get_device_capability(device)
    if capability != (9, 0):
        return f"compute capability {capability[0]}.{capability[1]}; the block-scaled kernels here are SM90's"
    m, n, k = _PROBE_SHAPE
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(m, k, device=device, generator=g).to(out_dtype)
    weight = (torch.randn(n, k, device=device, generator=g) * 16).to(torch.float8_e4m3fn)
    scale = torch.rand(n // 128, k // GROUP_K, device=device, generator=g) * 1e-3 + 1e-4
    try:
        got = _library_linear(option, x, weight, scale, False).float()
    except Exception as e:  # noqa: BLE001 - whatever the library refuses with, the fallback serves
        return _failure(e)
    want = _w8a8(x, weight, scale, 128, None, torch.empty(m, n, dtype=out_dtype, device=device), False).float()
    gap = ((got - want).norm() / want.norm()).item()
    return None if gap < _PROBE_TOLERANCE else f"its result is {gap:.3g} (relative) away from the Triton kernel's"


def library_available(option: str, device: torch.device, out_dtype: torch.dtype) -> bool:
    """Whether block-scaled linears the route gives to `option` ("torch_block", "deep_gemm") run
    through it on `device` for outputs of `out_dtype`. Probed once, outside graph capture (a
    capture that asks before the probe ran gets the fallback for that call); where the probe
    fails, one log line says why and what serves instead."""
    index = _device_index(device)
    ok = _LIBRARY_OK.get((option, index, out_dtype))
    if ok is None:
        if torch.cuda.is_current_stream_capturing():
            return False
        why = _probe_library(option, device, out_dtype)
        if why is not None:
            _refuse(option, index, out_dtype, why, expected=out_dtype not in _LIBRARY_DTYPES[option])
        ok = _LIBRARY_OK[(option, index, out_dtype)] = why is None
    return ok


def _refuse(option: str, index: int, out_dtype: torch.dtype, why: str, expected: bool = False) -> None:
    """Marks a library unusable for (device, dtype), with one log line (info where the dtype is one
    it does not serve by design, a warning otherwise)."""
    _LIBRARY_OK[(option, index, out_dtype)] = False
    (log.info if expected else log.warning)(
        "FP8 block linears on cuda:%d with %s outputs: %s is not usable here (%s); %s",
        index, out_dtype, _LIBRARY_NAMES[option], why, _FALLBACK_SERVES[option])


def torch_block_mm_available(device: torch.device, out_dtype: torch.dtype) -> bool:
    """library_available for torch's cuBLASLt block GEMM."""
    return library_available("torch_block", device, out_dtype)


def _w8a8(rows, weight, scale, scale_n, bias, out, round_scale) -> torch.Tensor:
    """The Triton W8A8 path into `out` [M, N]."""
    m, k = rows.shape
    n = weight.shape[0]
    stride_sn, stride_sk = _scale_strides(scale, scale_n)
    a, a_s = act_quant(rows, round_scale)
    grid = (triton.cdiv(m, 128) * triton.cdiv(n, 128),)
    _w8a8_kernel[grid](
        a, a_s, weight, scale, bias if bias is not None else out, out, m, n, k,
        a.stride(0), a_s.stride(0), weight.stride(0), out.stride(0), stride_sn, stride_sk,
        SCALE_N=scale_n, HAS_BIAS=bias is not None,
        BLOCK_M=128, BLOCK_N=128, BLOCK_K=GROUP_K, GROUP_M=8, num_warps=8, num_stages=3)
    return out


def block_library_linear(option: str, rows: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                         bias: torch.Tensor | None = None, round_scale: bool = False) -> torch.Tensor:
    """rows [M, K] @ (weight * scale)^T (+ bias) through a library's block-scaled GEMM
    ("torch_block": cuBLASLt through torch; "deep_gemm": DeepGEMM)."""
    out = _library_linear(option, rows, weight, scale, round_scale)
    launch.after_library_gemm(out)  # the next kernel waits for the GEMM in full (launch.py)
    if bias is not None:  # a second rounding to the output dtype: within one ulp, not half
        out += bias
    return out


def torch_block_linear(rows: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                       bias: torch.Tensor | None = None, round_scale: bool = False) -> torch.Tensor:
    """block_library_linear through torch's cuBLASLt block GEMM."""
    return block_library_linear("torch_block", rows, weight, scale, bias, round_scale)


# The route of a linear whose weight has a 128 x 128 block grid, by rows: (largest M, option),
# the first row whose limit is >= M. One home for the decision; bench/gemm_choice.py times every
# option per M at the Llama-3.1-8B shapes and prints the table its winners imply, ready to paste.
# The numbers behind it (docs/engine.md, "Choosing the FP8 GEMM"; H200, 2026-12-02,
# docs/benchmarks/runs/2026-12-02-{71b629b,1a689c2,40e26f9}/gemm_choice.json, a step's linears,
# bf16 / option): gemv 1.82-1.92x at M 1 (DeepGEMM 1.30-1.33x), 1.30x at 2 and 1.32x at 4
# (DeepGEMM 1.22x and 1.30x), but 0.90x at M 8 (every layer) where DeepGEMM is 1.46-1.50x;
# DeepGEMM 1.48-1.52x at 16 (gemv 1.40-1.44x), 1.60x at 64 (torch block 1.11x), 1.43x at 256,
# 1.46-1.72x at 2048-8192 (torch block 1.38-1.54x). With gemv's sw8 table and act_quant's tile
# (9989012, 4108e42): gemv 1.90-1.93x at M 1, 1.37-1.39x at 2-8 (DeepGEMM 1.30x at 2-4, 1.44-1.46x
# at 8), DeepGEMM 1.46-1.47x at 16, 1.61x at 64, 1.46-1.48x at 256, 1.55-1.70x at 2048-8192.
# Options: "gemv" (engine/kernels/gemv.py), "deep_gemm" (DeepGEMM, where installed), "torch_block"
# (cuBLASLt through torch), "triton" (the weight-only kernel up to DECODE_MAX_M rows, W8A8 above).
# A library option that is not available here falls back: to gemv up to GEMV_MAX_M rows (the
# route before DeepGEMM), else along LIBRARY_FALLBACK.
BLOCK_ROUTE: tuple[tuple[int | None, str], ...] = ((4, "gemv"), (None, "deep_gemm"))
BLOCK_OPTIONS = ("gemv", "deep_gemm", "torch_block", "triton")


def block_route(m: int, available, table: tuple[tuple[int | None, str], ...] = BLOCK_ROUTE) -> str:
    """The option a block-scaled linear of M rows takes: the table's, or where that is a library
    `available(option)` says is not usable here, its fallback: the small-M kernel up to
    GEMV_MAX_M rows, above them LIBRARY_FALLBACK (DeepGEMM, then torch's block GEMM, then the
    Triton kernels; gemv and triton are always available)."""
    if m < 0:
        raise ValueError(f"block_route: M must be >= 0, got {m}")
    choice = next(option for limit, option in table if limit is None or m <= limit)
    if choice not in BLOCK_OPTIONS:
        raise ValueError(f"block_route: unknown option {choice!r} (one of {BLOCK_OPTIONS})")
    if choice == "gemv" and m > gemv.GEMV_MAX_M:
        raise ValueError(f"block_route: gemv serves at most {gemv.GEMV_MAX_M} rows, the table gives it {m}")
    while choice in LIBRARY_FALLBACK and not available(choice):
        choice = "gemv" if m <= gemv.GEMV_MAX_M else LIBRARY_FALLBACK[choice]
    return choice


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, scale_n: int,
               bias: torch.Tensor | None = None, round_scale: bool = False) -> torch.Tensor:
    """x [..., K] @ (weight * scale)^T + bias -> [..., N] in x's dtype.

    weight: e4m3 [N, K] (row-major); scale: float32 grid [ceil(N / scale_n), ceil(K / 128)],
    or [N] / [N, 1] per row (scale_n 1), or a single value. round_scale: activation scales
    rounded up to powers of two (checkpoints with scale_fmt ue8m0), prefill only.
    """
    k = x.shape[-1]
    n = weight.shape[0]
    rows = x.reshape(-1, k)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    m = rows.shape[0]
    if m > 1 and x.device.type == "cuda" and torch_block_shape_ok(weight, scale, scale_n):
        option = block_route(m, lambda o: library_available(o, x.device, x.dtype))
        if option in LIBRARY_FALLBACK:
            try:
                return block_library_linear(option, rows, weight, scale, bias, round_scale).view(*x.shape[:-1], n)
            except Exception as e:  # noqa: BLE001 - e.g. DeepGEMM's JIT compile of a new configuration
                if torch.cuda.is_current_stream_capturing():
                    raise
                # The probe passed on one configuration; this one failed: the route without the
                # library serves from now on (one warning line), this call included.
                _refuse(option, _device_index(x.device), x.dtype, f"at {m} x {n} x {k}, {_failure(e)}")
                return fp8_linear(x, weight, scale, scale_n, bias, round_scale)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out.view(*x.shape[:-1], n)
    if m <= gemv.GEMV_MAX_M:
        gemv.launch(rows, weight, scale, scale_n, bias, out, *gemv.config_for("fp8", n, k, m, x.device),
                    round_scale=round_scale)
    elif m <= DECODE_MAX_M:
        w8a16(rows, weight, scale, scale_n, bias, out, *_decode_tiles(m, n))
    else:
        _w8a8(rows, weight, scale, scale_n, bias, out, round_scale)
    return out.view(*x.shape[:-1], n)


# The library options that compile a kernel configuration at its first call (warm_library_gemms).
JIT_LIBRARIES = ("deep_gemm",)
# A warm-up pass's progress line at most this often (seconds).
WARM_LOG_INTERVAL_S = 10.0
# A first call slower than this compiled a kernel configuration (DeepGEMM's JIT: 2-5 s each on an
# H200; a call of a compiled one is well under a millisecond at these shapes).
COMPILE_CALL_S = 0.25


def warm_library_gemms(linears, max_m: int, dtype: torch.dtype = torch.bfloat16) -> dict:
    """Run each distinct block-scaled linear of `linears` ((weight, scale, scale_n, round_scale)
    on one CUDA device) once at every M up to max_m that its route gives a library that compiles
    at first use (JIT_LIBRARIES; torch's block GEMM has nothing to compile), so that
    DeepGEMM compiles its kernel configurations (chosen per N, K and M; 2-5 s each) before the
    server takes traffic rather than on a user's prefill; compiled kernels are loaded from
    DG_JIT_CACHE_DIR afterwards. Logs a progress line at most every WARM_LOG_INTERVAL_S and one at
    the end; returns {"shapes", "calls", "compiles", "seconds"}."""
    seen, shapes = set(), []
    for weight, scale, scale_n, round_scale in linears:
        key = (tuple(weight.shape), round_scale, weight.device)
        if key not in seen and weight.is_cuda and torch_block_shape_ok(weight, scale, scale_n):
            seen.add(key)
            shapes.append((weight, scale, round_scale))
    stats = {"shapes": 0, "calls": 0, "compiles": 0, "seconds": 0.0}
    if not shapes or max_m < 1:
        return stats
    device = shapes[0][0].device
    sizes = [m for m in range(2, max_m + 1)
             if block_route(m, lambda o: library_available(o, device, dtype)) in JIT_LIBRARIES]
    if not sizes:
        return stats
    start = last = time.monotonic()
    log.info("library GEMM warm-up: %d block-scaled linear shapes at M %d..%d (%s)", len(shapes), sizes[0], sizes[-1],
             ", ".join(f"{w.shape[0]}x{w.shape[1]}" for w, _, _ in shapes))
    for i, (weight, scale, round_scale) in enumerate(shapes):
        x = torch.randn(sizes[-1], weight.shape[1], device=device).to(dtype)
        for j, m in enumerate(sizes):
            t0 = time.monotonic()
            fp8_linear(x[:m], weight, scale, 128, None, round_scale)  # a compile blocks the host call itself
            if j % 32 == 31:
                torch.cuda.synchronize(device)  # the queue stays short
            now = time.monotonic()
            stats["calls"] += 1
            stats["compiles"] += now - t0 > COMPILE_CALL_S
            if now - last >= WARM_LOG_INTERVAL_S:
                last = now
                log.info("library GEMM warm-up: shape %d of %d (%dx%d) at M %d of %d, %d kernel compiles, %.0f s",
                         i + 1, len(shapes), weight.shape[0], weight.shape[1], m, sizes[-1], stats["compiles"],
                         now - start)
        torch.cuda.synchronize(device)
        stats["shapes"] += 1
        del x
    stats["seconds"] = time.monotonic() - start
    log.info("library GEMM warm-up done: %d shapes, %d calls, %d kernel compiles, %.1f s", stats["shapes"],
             stats["calls"], stats["compiles"], stats["seconds"])
    return stats
