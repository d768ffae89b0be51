"""The small-M FP8 weight-only linear on the f16 tensor cores, in CUDA C++ (fp8_mma_gemv.cu).

At 1 to 8 rows an FP8 linear is a read of its e4m3 codes, and the Triton loops
(engine/kernels/gemv.py) spend instructions on every code: the "fma" loop widens each code to
float32 and multiplies it (about three instructions a code, which keeps the 8B shapes at 54-81%
of the copy bandwidth at batch 1), and the tensor-core loops stage the codes through shared
memory and pad x to 16 or 64 rows. Here a warp's mma.sync.m16n8k16 takes the codes straight from
the registers they were loaded into: a lane's 16-byte load of a weight row is four mmas' A
fragments after one cvt.rn.f16x2.e4m3x2 per two codes, in a k order the B fragment (x, up to 8
rows: the mma's N) shares, so nothing is shuffled, padded or staged but x, and 1 to 8 rows cost
the same. Triton has no way to say which lane holds which fragment element, hence CUDA C++,
compiled at run time by NVRTC (engine/kernels/nvrtc.py).

Numerics: the weight-only product. x is scaled per row and 128-wide group by a power of two into
f16 (exact down to 2^-14 of the group's largest), products and sums are float32 in the tensor
cores, each group's sums are scaled by its weight block's scale (SCALE_MODE 1: 128 x 128 or any
block grid whose rows are a multiple of 16) or, at the end, by the row's scale (SCALE_MODE 2: per
channel or per tensor). x and the output are bf16 or f16; float32 activations keep the Triton
kernels (the exact checks run there).

A launch is the GEMV_TABLE tuple of gemv.py with the variant "mma": (variant, BLOCK_N = 16 x
TILES rows a CTA, BLOCK_K = 64 x CHUNKS k a warp's step, SPLIT_K CTAs along K meeting in gemv's
split-K workspace, num_warps sharing the CTA's k range, num_stages = weight buffers: 2 loads the
next step while this one computes). Where NVRTC, the driver or the compile is missing or fails,
`available` says so in one warning line and the Triton launches serve instead.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from pathlib import Path

import torch

from specdeploy.engine.kernels import nvrtc

log = logging.getLogger("specdeploy.engine.kernels.fp8_mma")

KERNEL = "fp8_mma_gemv"
SOURCE_FILE = Path(__file__).with_name("fp8_mma_gemv.cu")
MAX_M = 8  # x rows: the mma's N
CHUNK_K = 64  # k a lane's 16-byte load covers across the 4 lanes of a row
GROUP_K = 128  # the scale group along K
TILE_N = 16  # weight rows of one mma
EARLY_LOADS = True  # the first weight loads before griddepcontrol.wait (weights are no kernel's output)
MIN_CAPABILITY = (8, 9)  # cvt.rn.f16x2.e4m3x2
SWITCH_ENV = "SPECDEPLOY_FP8_MMA"  # "0": the Triton launches serve every FP8 linear (for comparisons)


@functools.cache
def source() -> str:
    return SOURCE_FILE.read_text()


def defines(block_n: int, block_k: int, split_k: int, num_warps: int, num_stages: int, scale_mode: int,
            x_f16: bool, has_bias: bool, use_gdc: bool) -> tuple[tuple[str, int], ...]:
    """The kernel's macros for one launch configuration (sorted, hashable: the compile cache's key)."""
    if block_n not in (16, 32) or block_k % (2 * CHUNK_K) or not 0 < block_k <= 512 or num_warps not in (1, 2, 4, 8, 16) \
            or num_stages not in (1, 2) or scale_mode not in (1, 2) or split_k < 1:
        raise ValueError(f"fp8_mma: {('mma', block_n, block_k, split_k, num_warps, num_stages)} is not a launch configuration")
    return tuple(sorted({
        "TILES": block_n // TILE_N, "WARPS": num_warps, "CHUNKS": block_k // CHUNK_K, "SPLIT": min(split_k, 2),  # the kernel asks only 1 or more
        "SCALE_MODE": scale_mode, "X_F16": int(x_f16), "HAS_BIAS": int(has_bias), "USE_GDC": int(use_gdc),
        "EARLY": int(EARLY_LOADS and use_gdc), "PIPE": int(num_stages == 2)}.items()))


def cubin(arch: str, defs: tuple[tuple[str, int], ...]) -> bytes:
    return nvrtc.compile_cubin(source(), KERNEL, arch, defs)


def shared_bytes(m: int, block_n: int, block_k: int, num_warps: int) -> int:
    """Dynamic shared memory of a launch: each warp's staged x rows (f16, 16 bytes of padding a
    row) and group exponents, or the warps' partial sums at the end, whichever is larger."""
    stage = (m * (block_k + 8) * 2 + m * (block_k // GROUP_K) * 4 + 15) // 16 * 16
    return max(num_warps * stage, num_warps * block_n * 8 * 4)


_KERNELS: dict[tuple[int, tuple], nvrtc.Kernel] = {}


def _kernel(device: torch.device, defs: tuple) -> nvrtc.Kernel:
    index = device.index if device.index is not None else torch.cuda.current_device()
    found = _KERNELS.get((index, defs))
    if found is None:
        found = nvrtc.Kernel(cubin(nvrtc.device_arch(device), defs), KERNEL, torch.device("cuda", index))
        _KERNELS[(index, defs)] = found
    return found


@functools.cache
def _available(index: int) -> bool:
    device = torch.device("cuda", index)
    if torch.cuda.get_device_capability(device) < MIN_CAPABILITY:
        return False  # older GPUs have no e4m3 conversion: the Triton launches serve, as they always did there
    try:
        _kernel(device, defines(16, 256, 1, 4, 1, 1, False, False, False))
    except (nvrtc.NvrtcError, OSError) as exc:
        log.warning("the FP8 small-M tensor-core kernel is not usable on %s (%s); the Triton launches serve its linears",
                    device, exc)
        return False
    return True


@functools.cache
def enabled() -> bool:
    """SPECDEPLOY_FP8_MMA, read once (reset() reads it again): unless "0", the kernel serves where
    it is available."""
    value = os.environ.get(SWITCH_ENV, "1").strip()
    if value not in ("0", "1"):
        raise ValueError(f"{SWITCH_ENV}={value!r}: 1 (the default) or 0")
    return value == "1"


def reset() -> None:
    """Read SPECDEPLOY_FP8_MMA again (benchmarks that compare the kernels)."""
    enabled.cache_clear()


def available(device: torch.device) -> bool:
    """Whether the kernel serves on `device`: switched on, and it compiles and loads there (probed
    once per device; one warning line names the reason where it does not)."""
    return (device.type == "cuda" and enabled()
            and _available(device.index if device.index is not None else torch.cuda.current_device()))


def scale_mode(scale: torch.Tensor, scale_n: int) -> tuple[int, int, int] | None:
    """(SCALE_MODE, stride along scale rows, stride along 128-wide k groups) of a scale layout the
    kernel reads, or None: a grid whose row blocks are a multiple of 16 rows (mode 1), per row
    or per tensor (mode 2)."""
    if scale.dtype != torch.float32:
        return None
    if scale.numel() == 1:
        return 2, 0, 0
    if scale.dim() == 1 or scale.shape[1] == 1:
        return 2, scale.stride(0), 0
    if scale_n % TILE_N == 0:
        return 1, scale.stride(0), scale.stride(1)
    return None


def supports(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, scale_n: int, out: torch.Tensor,
             bias: torch.Tensor | None = None) -> bool:
    """Whether a launch of the kernel computes this call: CUDA, 1-8 rows of bf16/f16 x with unit
    stride along K, e4m3 weights [N, K] with 16-byte aligned rows, K a multiple of 128, a scale
    layout of `scale_mode`, a bias (if any) of x's dtype with unit stride."""
    m, k = x.shape
    if bias is not None and (bias.dtype != x.dtype or bias.stride(-1) != 1):
        return False
    return (x.is_cuda and 0 < m <= MAX_M and x.dtype in (torch.bfloat16, torch.float16) and out.dtype == x.dtype
            and weight.dtype == torch.float8_e4m3fn and k % GROUP_K == 0 and x.stride(1) == 1 and weight.stride(1) == 1
            and (x.stride(0) * 2) % 16 == 0 and x.data_ptr() % 16 == 0 and weight.stride(0) % 16 == 0
            and weight.data_ptr() % 16 == 0 and out.stride(1) == 1 and scale_mode(scale, scale_n) is not None)


def launch(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, scale_n: int, bias: torch.Tensor | None,
           out: torch.Tensor, block_n: int, block_k: int, split: int, k_split: int, num_warps: int, num_stages: int,
           workspace: tuple[torch.Tensor, torch.Tensor] | None, pdl: bool) -> None:
    """One launch into out [M, N] (`supports` holds): `split` CTAs along K, each `k_split` wide (a
    multiple of GROUP_K: gemv.k_splits). split > 1 needs gemv's workspace for N (float32 partials,
    int32 counters at zero)."""
    m, k = x.shape
    n = weight.shape[0]
    mode, stride_sn, stride_sk = scale_mode(scale, scale_n)
    defs = defines(block_n, block_k, split, num_warps, num_stages, mode, x.dtype == torch.float16, bias is not None, pdl)
    kern = _kernel(x.device, defs)
    ws, cnt = workspace if split > 1 else (out, out)
    c = ctypes
    args = [c.c_void_p(x.data_ptr()), c.c_void_p(weight.data_ptr()), c.c_void_p(scale.data_ptr()),
            c.c_void_p(bias.data_ptr() if bias is not None else 0), c.c_void_p(out.data_ptr()),
            c.c_void_p(ws.data_ptr()), c.c_void_p(cnt.data_ptr()),
            c.c_int(m), c.c_int(n), c.c_int(k), c.c_int(k_split),
            c.c_longlong(x.stride(0)), c.c_longlong(weight.stride(0)), c.c_longlong(out.stride(0)),
            c.c_longlong(stride_sn), c.c_longlong(stride_sk), c.c_int(scale_n)]
    kern.launch((-(-n // block_n), split, 1), 32 * num_warps, shared_bytes(m, block_n, block_k, num_warps), args, pdl)
