"""A dispatch mode that refuses, during the forward it wraps, what a CUDA graph capture refuses:
host syncs, host-to-device copies, tensors made on the host (checked on any device, the meta
device included)."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

aten = torch.ops.aten

# ops whose CUDA kernels read device data on the host (their output's shape depends on it)
SYNCING = {aten._local_scalar_dense, aten.nonzero, aten.masked_select, aten.bincount, aten._unique,
           aten._unique2, aten.unique_dim, aten.unique_consecutive, aten.histc}
INDEXING = {aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_}


class HostSync(RuntimeError):
    pass


class NoHostSync(TorchDispatchMode):
    """Refuses, during the forward it wraps, what a CUDA graph capture refuses."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        packet = func.overloadpacket
        if packet in SYNCING:
            raise HostSync(f"{func}: a host sync")
        if packet is aten.repeat_interleave and func is aten.repeat_interleave.Tensor and "output_size" not in kwargs:
            raise HostSync(f"{func} without output_size: a host sync")
        if kwargs.get("device") is not None and torch.device(kwargs["device"]).type == "cpu":
            raise HostSync(f"{func} to the host")
        leaves = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if packet in INDEXING and any(t.dtype == torch.bool for t in tree_leaves(args[1])
                                      if isinstance(t, torch.Tensor)):
            raise HostSync(f"{func} with a boolean mask: a host sync")
        if packet is aten._grouped_mm and any(t.dtype != torch.bfloat16 for t in leaves[:2]):
            raise HostSync("grouped_mm off its bf16 fast path copies its offsets to the host")
        for t in leaves:
            if t.device.type == "cpu" and t.dim() > 0:
                raise HostSync(f"{func} reads a CPU tensor {tuple(t.shape)} (a host-to-device copy)")
        out = func(*args, **kwargs)
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                raise HostSync(f"{func} made a CPU tensor {tuple(t.shape)}")
        return out
