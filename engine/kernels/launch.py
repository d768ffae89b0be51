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

`pdl_args(t)` gives the two launch arguments for a kernel whose tensors live where `t` does:
on for a CUDA device of compute capability 9.0 or later unless SPECDEPLOY_PDL=0 (measured on an
H200, Llama-3.1-8B shape, batch 1, graphed decode call: bf16 226.8 -> 234.6 tok/s, FP8 298.2 ->
319.9 tok/s; docs/benchmarks.md); off on CPU, under Triton's interpreter and on older GPUs. Every kernel that takes them declares
`USE_GDC: tl.constexpr` and calls `gdc()` first.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

PDL_ENV = "SPECDEPLOY_PDL"


@functools.cache
def _pdl_on(device_index: int) -> bool:
    if os.environ.get("TRITON_INTERPRET") == "1" or os.environ.get(PDL_ENV, "1") == "0":
        return False
    return torch.cuda.get_device_capability(device_index) >= (9, 0)


def pdl_args(t: torch.Tensor) -> dict:
    """Launch keyword arguments: {"USE_GDC": True, "launch_pdl": True} or {"USE_GDC": False}."""
    if t.is_cuda and _pdl_on(t.device.index if t.device.index is not None else torch.cuda.current_device()):
        return {"USE_GDC": True, "launch_pdl": True}
    return {"USE_GDC": False}


@triton.jit
def gdc(USE_GDC: tl.constexpr):
    """First statement of a kernel launched with `pdl_args`: wait for the previous kernel, then
    let the next one launch."""
    if USE_GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
