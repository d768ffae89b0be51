"""A persistent, block-scaled FP8 GEMM on tensor descriptors (TMA loads and stores on SM90; CUDA
only, checked on CPU through Triton's interpreter).

out [M, N] = (a * a_s) @ (w * w_s)^T (+ bias), DeepSeek-V3's W8A8 numerics as the Triton
W8A8 kernel of engine/kernels/fp8.py computes them: `a` e4m3 [M, K] with one float32 scale per
row and 128-wide K group (`act_quant`), `w` e4m3 [N, K] with one float32 scale per
(SCALE_N x 128) tile. The pattern is Triton's persistent matmul: one program per SM walks the
output tiles (GROUP_M row tiles at a time, so neighbours share weight tiles in L2), A and W
tiles arrive through tensor descriptors made on the device (`tl.make_tensor_descriptor`), and,
as DeepGEMM does, each 128-wide K block's product is scaled by its activation and weight scales
in the main loop and added to a float32 accumulator. The output goes out through a descriptor
too. Out-of-range rows and columns are the descriptors' (zero-filled loads, clipped stores).

Device descriptors live in a scratch buffer Triton asks its allocator for at launch (Triton 3.6
has no default); `ensure_allocator` installs a torch one in the calling thread unless one is set
there (graph-capture safe: torch's allocator serves a capture from the graph's pool, stream-ordered).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

GROUP_K = 128  # the K width of one scale group / tile, as in engine/kernels/fp8.py


# NUM_PROGRAMS (the SM count, or fewer tiles) is not specialized: one compile per config and dtype.
@triton.jit(do_not_specialize=["NUM_PROGRAMS"])
def _fp8_tma_kernel(a_ptr, as_ptr, w_ptr, ws_ptr, bias_ptr, out_ptr, M, N, K,
                    stride_asm, stride_ask, stride_sn, stride_sk,
                    NUM_PROGRAMS, SCALE_N: tl.constexpr, HAS_BIAS: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    GROUP_M: tl.constexpr, NUM_STAGES: tl.constexpr):
    a_desc = tl.make_tensor_descriptor(a_ptr, shape=[M, K], strides=[K, 1], block_shape=[BLOCK_M, BLOCK_K])
    w_desc = tl.make_tensor_descriptor(w_ptr, shape=[N, K], strides=[K, 1], block_shape=[BLOCK_N, BLOCK_K])
    o_desc = tl.make_tensor_descriptor(out_ptr, shape=[M, N], strides=[N, 1], block_shape=[BLOCK_M, BLOCK_N])
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    k_blocks = tl.cdiv(K, BLOCK_K)
    per_group = GROUP_M * tiles_n
    for tile in tl.range(tl.program_id(0), tiles_m * tiles_n, NUM_PROGRAMS):
        first_m = (tile // per_group) * GROUP_M
        group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
        pid_m = first_m + (tile % per_group) % group_rows
        pid_n = (tile % per_group) // group_rows
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        offs_m = off_m + tl.arange(0, BLOCK_M)
        offs_n = off_n + tl.arange(0, BLOCK_N)
        m_ok = offs_m < M
        n_ok = offs_n < N
        as_ptrs = as_ptr + offs_m * stride_asm
        ws_ptrs = ws_ptr + (offs_n // SCALE_N) * stride_sn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kb in tl.range(0, k_blocks, num_stages=NUM_STAGES):
            a = a_desc.load([off_m, kb * BLOCK_K])
            w = w_desc.load([off_n, kb * BLOCK_K])
            a_s = tl.load(as_ptrs + kb * stride_ask, mask=m_ok, other=0.0)
            if SCALE_N % BLOCK_N == 0:  # the tile lies in one scale block: one scale per K block
                w_s = tl.load(ws_ptr + (off_n // SCALE_N) * stride_sn + kb * stride_sk)
                acc += tl.dot(a, w.T) * (a_s * w_s)[:, None]
            else:
                w_s = tl.load(ws_ptrs + kb * stride_sk, mask=n_ok, other=0.0)
                acc += tl.dot(a, w.T) * (a_s[:, None] * w_s[None, :])
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        o_desc.store([off_m, off_n], acc.to(out_ptr.dtype.element_ty))


# Launch configurations, (BLOCK_M, BLOCK_N, GROUP_M, num_warps, num_stages) by name. bench/
# gemm_choice.py times each at the Llama-3.1-8B shapes; TMA_CONFIG_BY_M is where its choice goes.
# Wider tiles than 128 x 128 per 8 warps would hold two float32 tiles of 128+ registers per
# thread (the accumulator and each K block's product before its scales), past the 255 limit.
TMA_CONFIGS = {
    "m64n128": (64, 128, 8, 4, 4),
    "m128n128": (128, 128, 8, 8, 4),
    "m128n128s5": (128, 128, 16, 8, 5),  # 5 x 32 KiB of A and W stages + the 32 KiB output tile
}
# (largest M, config name): the first row whose limit is >= M, None for the rest.
TMA_CONFIG_BY_M = ((256, "m64n128"), (None, "m128n128"))

def _torch_scratch(size: int, alignment: int, stream) -> torch.Tensor:
    """Triton's scratch for device descriptors from torch's caching allocator (256-byte aligned,
    more than the 128 TMA descriptors need), on the current device and stream."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


def ensure_allocator() -> None:
    """Give Triton a global-memory allocator for on-device tensor descriptors where the calling
    thread has none. Triton keeps it in a ContextVar, so each thread starts without one; one set
    by someone else is kept."""
    from triton.runtime import _allocation

    current = getattr(_allocation, "_allocator", None)
    null = getattr(_allocation, "NullAllocator", None)
    if current is None or null is None or isinstance(current.get(), null):
        triton.set_allocator(_torch_scratch)


def config_for(m: int) -> tuple[int, int, int, int, int]:
    """The launch configuration TMA_CONFIG_BY_M names for M rows."""
    name = next(c for limit, c in TMA_CONFIG_BY_M if limit is None or m <= limit)
    return TMA_CONFIGS[name]


def shape_ok(a: torch.Tensor, weight: torch.Tensor, out: torch.Tensor) -> bool:
    """Whether the descriptors can address these operands: contiguous, 16-byte aligned bases and
    16-byte row strides (TMA's rules) for the codes (K bytes) and the output (N elements)."""
    k = a.shape[1]
    n = weight.shape[0]
    return (all(t.is_contiguous() and t.data_ptr() % 16 == 0 for t in (a, weight, out))
            and k % 16 == 0 and (n * out.element_size()) % 16 == 0)


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def program_count(device: torch.device) -> int:
    """One persistent program per SM (a handful on a CPU tensor: interpreter runs)."""
    if device.type != "cuda":
        return 4
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def fp8_tma_gemm(a: torch.Tensor, a_s: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                 scale_n: int, bias: torch.Tensor | None, out: torch.Tensor,
                 config: tuple[int, int, int, int, int] | None = None,
                 programs: int | None = None) -> torch.Tensor:
    """a e4m3 [M, K] with scales a_s [M, ceil(K / 128)] (any strides), weight e4m3 [N, K] with a
    float32 scale grid [ceil(N / scale_n), ceil(K / 128)] (scale_n 128 or 1) -> out [M, N]."""
    m, k = a.shape
    n, k_w = weight.shape
    if k_w != k or out.shape != (m, n):
        raise ValueError(f"fp8_tma_gemm: a {tuple(a.shape)}, weight {tuple(weight.shape)}, out {tuple(out.shape)}")
    if scale.dim() != 2 or scale.shape != (triton.cdiv(n, scale_n), triton.cdiv(k, GROUP_K)):
        raise ValueError(f"fp8_tma_gemm: scale grid {tuple(scale.shape)} for [{n}, {k}] in {scale_n} x 128 tiles")
    if not shape_ok(a, weight, out):
        raise ValueError(f"fp8_tma_gemm: TMA needs contiguous, 16-byte aligned operands, K % 16 == 0 and 16-byte output rows "
                         f"(K {k}, N {n}, {out.dtype})")
    if m == 0:
        return out
    block_m, block_n, group_m, warps, stages = config or config_for(m)
    if programs is None:
        programs = program_count(a.device)
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    programs = max(1, min(programs, tiles))
    ensure_allocator()
    _fp8_tma_kernel[(programs,)](
        a, a_s, weight, scale, bias if bias is not None else out, out, m, n, k,
        a_s.stride(0), a_s.stride(1), scale.stride(0), scale.stride(1),
        programs, SCALE_N=scale_n, HAS_BIAS=bias is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=GROUP_K, GROUP_M=group_m, NUM_STAGES=stages,
        num_warps=warps)
    return out
