"""Launch options the kernels share: programmatic dependent launch (PDL, Hopper onwards).

In a CUDA graph of a decode step the kernels run back to back, each a few microseconds, and
every boundary costs the next kernel's launch and prologue while the previous one drains its
last wave. With PDL a kernel is launched while its predecessor still runs: each of our kernels
begins with `griddepcontrol.wait` (`tl.extra.cuda.gdc_wait`: it returns once every program of
the previous kernel has finished and its writes are visible) and then lets its own dependents
launch (`gdc_launch_dependents`). A kernel that reads or writes nothing before that wait is
exactly as ordered as without PDL, whatever ran before it (a kernel that does not take part is
waited for in full, as usual). Launched in a stream that is being captured, the dependency
becomes a programmatic edge of the graph.

A library GEMM is the exception: the kernel after it measured slower steps with PDL than
without (the likely cause: cuBLAS lets its dependents launch early, and our kernel's programs,
parked in that wait on the SMs, hold resources the GEMM's own programs need; not profiled) (H200,
Llama-3.1-8B shape, decode call, bench/fp8_bench.py at 2544c14: FP8 block linears through
cuBLASLt at batch 64 / 256 7.008 / 14.647 ms with no PDL right after them, 7.097 / 14.868 with
it; bf16 through cuBLAS 7.396 / 16.327 with PDL everywhere, 7.317 / 16.076 without any). So
the kernel launched right after such a GEMM takes no PDL: the GEMM's call site says so with
`after_library_gemm(t)` (engine/kernels/fp8.py's block path, gemv.library_linear), and the next
`pdl_args` on that device returns a plain launch's arguments. SPECDEPLOY_PDL=all keeps PDL
there too, for benchmarks that compare.

`pdl_args(t)` gives the two launch arguments for a kernel whose tensors live where `t` does:
on for a CUDA device of compute capability 9.0 or later unless SPECDEPLOY_PDL=0 (measured on an
H200, Llama-3.1-8B shape, batch 1, graphed decode call: bf16 226.8 -> 234.6 tok/s, FP8 298.2 ->
319.9 tok/s; docs/benchmarks.md); off on CPU, under Triton's interpreter and on older GPUs. Every kernel that takes them declares
`USE_GDC: tl.constexpr` and calls `gdc()` first.

SPECDEPLOY_PREFETCH (bytes, default PREFETCH_BYTES = 0): how much of each weight row the small-M
linear pulls into L2 before its wait, while the previous kernel drains (bench/prefetch_sweep.py
measures it; on an H200 no size made the decode step faster, docs/engine.md).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

PDL_ENV = "SPECDEPLOY_PDL"
PREFETCH_ENV = "SPECDEPLOY_PREFETCH"
PREFETCH_BYTES = 0  # a weight-streaming program's L2 prefetch before its wait, bytes per weight row (measured: no gain on an H200, docs/engine.md)


@functools.cache
def _pdl_on(device_index: int) -> bool:
    if os.environ.get("TRITON_INTERPRET") == "1" or os.environ.get(PDL_ENV, "1") == "0":
        return False
    return torch.cuda.get_device_capability(device_index) >= (9, 0)


# Device indices whose next kernel launch follows a library GEMM (after_library_gemm).
_AFTER_LIBRARY: set[int] = set()


def _index(t: torch.Tensor) -> int:
    return t.device.index if t.device.index is not None else torch.cuda.current_device()


@functools.cache
def pdl_after_library() -> bool:
    """Whether kernels right after a library GEMM take PDL too (SPECDEPLOY_PDL=all); read once,
    as _pdl_on (it is asked at every linear of an eager forward)."""
    return os.environ.get(PDL_ENV, "1") == "all"


@functools.cache
def prefetch_bytes() -> int:
    """How much of each weight row a weight-streaming kernel launched with PDL pulls into L2
    before its griddepcontrol.wait (gemv.py): SPECDEPLOY_PREFETCH bytes, PREFETCH_BYTES unless
    set, 0 for none; read once."""
    value = os.environ.get(PREFETCH_ENV, "").strip()
    if not value:
        return PREFETCH_BYTES
    if not value.isdigit():
        raise ValueError(f"{PREFETCH_ENV}={value!r}: a number of bytes (0 for none)")
    return int(value)


def reset() -> None:
    """Forget the cached PDL settings (SPECDEPLOY_PDL and SPECDEPLOY_PREFETCH are read again)
    and any pending after_library_gemm flag: for tests and benchmarks that change the mode."""
    _pdl_on.cache_clear()
    pdl_after_library.cache_clear()
    prefetch_bytes.cache_clear()
    _AFTER_LIBRARY.clear()


def after_library_gemm(t: torch.Tensor) -> None:
    """A library GEMM writing `t` was just launched: the next pdl_args on its device is a plain
    launch (module docstring). Kernels launch in the order their calls are made, so the flag
    names the launch that follows the GEMM on the stream (or the next of ours, if a torch op
    came between: it then merely loses its overlap). Nothing to flag where PDL is off."""
    if t.is_cuda and not pdl_after_library() and _pdl_on(index := _index(t)):
        _AFTER_LIBRARY.add(index)


def pdl_args(t: torch.Tensor) -> dict:
    """Launch keyword arguments: {"USE_GDC": True, "launch_pdl": True} or {"USE_GDC": False}."""
    if t.is_cuda and _pdl_on(index := _index(t)):
        if index in _AFTER_LIBRARY:
            _AFTER_LIBRARY.discard(index)
            return {"USE_GDC": False}
        return {"USE_GDC": True, "launch_pdl": True}
    return {"USE_GDC": False}


@triton.jit
def gdc(USE_GDC: tl.constexpr):
    """First statement of a kernel launched with `pdl_args`: wait for the previous kernel, then
    let the next one launch."""
    if USE_GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
