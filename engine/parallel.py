"""Tensor parallelism's groups and collectives: what a sharded layer calls, below the models.

One process per GPU; every rank holds a shard of each model (engine/runtime/distributed.py runs
the ranks in lockstep). Two groups: the device group (NCCL on CUDA, gloo on CPU) carries the
models' collectives; a gloo group on the host carries the control broadcasts, so an idle
server's waiting ranks occupy no GPU stream and no NCCL timeout.

After every all-reduce and all-gather each rank holds the same bits (NCCL and gloo both reduce
each element once and hand the result to every rank), so what follows a collective is replicated
work on identical inputs.

Collectives (`all_reduce`, `all_gather`) are plain synchronous calls on the current stream, so a
CUDA graph captures them. `all_reduce` has two backends: NCCL (the default) and PyTorch's
symmetric-memory one-shot all-reduce for small messages (each rank reads every peer's buffer
over NVLink and sums: one kernel, no ring), which falls back to NCCL above
SYMM_MEM_MAX_BYTES. NVLink multicast (NCCL's NVLS, symmetric memory's multimem) stays off.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

# What the device notes require on every rank: NVLink multicast off in NCCL, PyTorch's symmetric
# memory and NVSHMEM (a program using it can take a shared host's GPUs out of service).
MULTICAST_OFF_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                     "NVSHMEM_DISABLE_NVLS": "1"}

ALL_REDUCE_BACKENDS = ("nccl", "symm-mem")

# The largest message the one-shot all-reduce takes; above it every rank would read N - 1 peers'
# whole buffers, and NCCL's ring (each byte crosses NVLink twice, not N - 1 times) wins. Decode
# all-reduces are [B * Q, H] bf16: 64 x 8192 x 2 B = 1 MiB at batch 64 on the 70B shape.
SYMM_MEM_MAX_BYTES = 1 << 20

# Model collectives: a rank that waits this long for its peers is wedged (each collective takes
# micro- to milliseconds; loading skew is absorbed by a barrier on the control group first).
DEVICE_TIMEOUT = timedelta(minutes=10)
# Control broadcasts: an idle server's ranks wait here for the next request, for as long as it
# takes; a dead peer is noticed by the process watchdogs, not by this timeout.
CONTROL_TIMEOUT = timedelta(days=365)


@dataclass
class TPGroup:
    rank: int
    size: int
    device: torch.device
    device_group: dist.ProcessGroup
    control_group: dist.ProcessGroup
    all_reduce_backend: str = "nccl"
    _symm_buffer: torch.Tensor | None = None
    _symm_group_name: str = ""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of x over the ranks, the same bits on every rank; x [...] contiguous (reduced in
        place on the NCCL/gloo path; the one-shot path returns a new tensor)."""
        if self._symm_buffer is not None and x.is_cuda and x.numel() * x.element_size() <= SYMM_MEM_MAX_BYTES:
            symm = self._symm_buffer.view(x.dtype)[:x.numel()].view(x.shape)
            return torch.ops.symm_mem.one_shot_all_reduce_copy(symm, x, "sum", self._symm_group_name)
        dist.all_reduce(x, group=self.device_group)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """[..., D] on each rank -> [..., size * D], rank r's part at columns r*D..(r+1)*D."""
        x = x.contiguous()
        if x.is_cuda:
            out = torch.empty((self.size, *x.shape), dtype=x.dtype, device=x.device)
            dist.all_gather_into_tensor(out, x, group=self.device_group)
            parts = out.unbind(0)
        else:  # gloo has no all_gather_into_tensor
            parts = [torch.empty_like(x) for _ in range(self.size)]
            dist.all_gather(parts, x, group=self.device_group)
        return torch.cat(parts, dim=-1)

    def broadcast(self, obj=None):
        """Rank 0's `obj` on every rank (a pickle over the control group)."""
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.control_group)
        return box[0]

    def min_over_ranks(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.control_group)
        return int(t.item())

    def barrier(self) -> None:
        dist.barrier(group=self.control_group)

    def enable_symm_mem(self) -> None:
        """Switch small all-reduces to the one-shot symmetric-memory kernel (CUDA only)."""
        import torch.distributed._symmetric_memory as symm_mem

        if self.device.type != "cuda":
            raise ValueError("the symm-mem all-reduce needs CUDA GPUs")
        self._symm_group_name = self.device_group.group_name
        if hasattr(symm_mem, "enable_symm_mem_for_group"):  # required before rendezvous up to torch 2.7
            symm_mem.enable_symm_mem_for_group(self._symm_group_name)
        buf = symm_mem.empty(SYMM_MEM_MAX_BYTES, dtype=torch.uint8, device=self.device)
        symm_mem.rendezvous(buf, self._symm_group_name)
        self._symm_buffer = buf
        self.all_reduce_backend = "symm-mem"


_GROUP: TPGroup | None = None


def group() -> TPGroup:
    if _GROUP is None:
        raise RuntimeError("a layer built with tp_size > 1 ran outside a tensor-parallel group "
                           "(engine.parallel.init_tp)")
    return _GROUP


def current() -> TPGroup | None:
    return _GROUP


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    return group().all_reduce(x)


def all_gather(x: torch.Tensor) -> torch.Tensor:
    return group().all_gather(x)


def init_tp(rank: int, size: int, init_method: str, device: torch.device | str,
            all_reduce_backend: str = "nccl", timeout_s: float | None = None) -> TPGroup:
    """Join the TP group (every rank calls this with the same init_method) and make it current.
    timeout_s: how long the device group's rendezvous and collectives may wait (DEVICE_TIMEOUT)."""
    global _GROUP
    if all_reduce_backend not in ALL_REDUCE_BACKENDS:
        raise ValueError(f"all-reduce backend {all_reduce_backend!r}: use one of {ALL_REDUCE_BACKENDS}")
    for key, value in MULTICAST_OFF_ENV.items():
        os.environ[key] = value
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    timeout = DEVICE_TIMEOUT if timeout_s is None else timedelta(seconds=timeout_s)
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size,
                            timeout=timeout, **kwargs)
    control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    _GROUP = TPGroup(rank, size, device, dist.group.WORLD, control)
    if all_reduce_backend == "symm-mem":
        _GROUP.enable_symm_mem()
    return _GROUP


def destroy_tp() -> None:
    global _GROUP
    if _GROUP is not None:
        _GROUP = None
        dist.destroy_process_group()
