"""KV memory: one preallocated pool per model and a slot table shared by target and draft.

A *slot* is one token's worth of K/V in every layer of a pool. The target pool and the draft
pool have the same number of slots and a committed token owns the same slot in both, so one
allocator and one request->slots table serve both models. Slot 0 is never handed out: padded
query rows write their K/V there, which keeps every batch a dense rectangle.
"""

from __future__ import annotations

import torch

from specdeploy.engine.planner.shapes import kv_heads_per_gpu

PAD_SLOT = 0


class KVPool:
    """K and V, each [num_layers, num_slots, kv heads of this rank, head_dim]: num_kv_heads /
    tp_size, or one head when there are fewer heads than ranks (replicated, as the plan counts)."""

    def __init__(self, num_layers: int, num_slots: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str, tp_rank: int = 0, tp_size: int = 1):
        if num_kv_heads % tp_size and tp_size % num_kv_heads:
            raise ValueError(f"num_kv_heads={num_kv_heads} neither divides nor is divisible by "
                             f"tp_size={tp_size}")
        local_heads = kv_heads_per_gpu(num_kv_heads, tp_size)
        # Zeros, not empty: padded rows read slot 0 and masked-out keys are multiplied by zero
        # weights, so every slot must hold finite numbers from the start.
        self.k = torch.zeros(num_layers, num_slots, local_heads, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()


class PoolExhausted(RuntimeError):
    """A pool (the token slots, or a DeepSeek-V4 pool's rows) has fewer free entries than asked."""


class SlotTable:
    """Free-slot stack plus `req_to_slot` [max_running_requests + 1, max_context_len]: row r holds
    the committed slots of the request in row r, position by position; the last row
    (`pad_row`) is never handed out: padded rows of a decode graph read and write it.

    The stack lives in host memory whatever the device: taking and giving back slots is host
    bookkeeping that never launches a kernel or waits for the device (a decode step packs the
    slots it took into its one host-to-device copy)."""

    def __init__(self, num_slots: int, max_running_requests: int, max_context_len: int,
                 device: torch.device | str):
        if num_slots < 2:
            raise ValueError(f"num_slots={num_slots}: need at least one slot beyond the padding slot")
        self.num_slots = num_slots
        self.max_context_len = max_context_len
        # The stack holds every usable slot; the top `num_free` entries are free.
        self._stack = torch.arange(num_slots - 1, 0, -1, dtype=torch.int64)
        self.num_free = num_slots - 1
        self.device = torch.device(device)
        self.pad_row = max_running_requests
        self.req_to_slot = torch.zeros(max_running_requests + 1, max_context_len, dtype=torch.int64,
                                       device=device)
        self._free_rows = list(range(max_running_requests - 1, -1, -1))
        self.listeners: list = []

    @property
    def capacity(self) -> int:
        return self.num_slots - 1

    def alloc(self, n: int) -> torch.Tensor:
        """n free slots [n] on the table's device (a fresh tensor)."""
        return self.alloc_host(n).to(self.device)

    def alloc_host(self, n: int) -> torch.Tensor:
        """n free slots [n], a fresh host tensor (later frees overwrite the stack region)."""
        if n > self.num_free:
            raise PoolExhausted(f"KV pool exhausted: asked for {n} slots, {self.num_free} free")
        slots = self._stack[self.num_free - n:self.num_free].clone()
        if self.listeners and n:
            on_device = slots.to(self.device)
            for i, listener in enumerate(self.listeners):
                try:
                    listener.taken(on_device)
                except BaseException:  # takes nothing: the listeners before it give theirs back
                    for done in self.listeners[:i]:
                        done.released(on_device)
                    raise
        self.num_free -= n
        return slots

    def alloc_arrived(self, row: int, n: int) -> torch.Tensor:
        """n slots for positions 0 .. n - 1 of the request in `row`, computed by another server
        (prefill/decode disaggregation): written into req_to_slot and committed at once, so a
        listener (DeepSeek-V4's pools) gives them only the rows a committed request keeps
        (`arrived`), never a row per slot. -> the slots (device). Takes nothing where it raises."""
        if n > self.num_free:
            raise PoolExhausted(f"KV pool exhausted: asked for {n} slots, {self.num_free} free")
        slots = self._stack[self.num_free - n:self.num_free].clone().to(self.device)
        self.req_to_slot[row, :n] = slots
        for i, listener in enumerate(self.listeners):
            try:
                listener.arrived(self.req_to_slot[row], n)
            except BaseException:
                for done in self.listeners[:i]:
                    done.finished(self.req_to_slot[row], n)
                self.req_to_slot[row, :n] = PAD_SLOT
                raise
        self.num_free -= n
        return slots

    def free(self, slots: torch.Tensor) -> None:
        """Give back in-flight slots (a step's, never committed; host or device tensor)."""
        if self.listeners and slots.numel():
            on_device = slots.to(self.device)
            for listener in self.listeners:
                listener.released(on_device)
        self._push(slots)

    def _push(self, slots: torch.Tensor) -> None:
        n = slots.numel()
        if self.num_free + n > self.capacity:
            raise RuntimeError("freeing more slots than were allocated")
        self._stack[self.num_free:self.num_free + n] = slots.reshape(-1).cpu()
        self.num_free += n

    def commit(self, row: int, old_len: int, new_len: int, lag: tuple[int, int] = (0, 0)) -> None:
        """Positions old_len .. new_len - 1 of the request in `row` are committed in req_to_slot.
        lag: how many of the committed positions, before and after, the draft has not run over
        (adaptive plain steps); a listener whose rows follow the draft (`lags`) is told the
        draft's positions instead."""
        for listener in self.listeners:
            if getattr(listener, "lags", False):
                listener.committed(self.req_to_slot[row], old_len - lag[0], new_len - lag[1])
            else:
                listener.committed(self.req_to_slot[row], old_len, new_len)

    def caught_up(self, row: int, old_len: int, new_len: int) -> None:
        """The draft has run over positions old_len .. new_len - 1 (already committed)."""
        for listener in self.listeners:
            if getattr(listener, "lags", False):
                listener.committed(self.req_to_slot[row], old_len, new_len)

    def alloc_row(self) -> int:
        if not self._free_rows:
            raise RuntimeError("no free request row: max_running_requests reached")
        return self._free_rows.pop()

    def free_row(self, row: int, length: int, lag: int = 0) -> None:
        """Return a request's committed slots and its row (lag: the last positions the draft has
        not run over, see commit)."""
        if length:
            for listener in self.listeners:
                if lag and getattr(listener, "lags", False):
                    listener.finished(self.req_to_slot[row], length, processed=length - lag)
                else:
                    listener.finished(self.req_to_slot[row], length)
            self._push(self.req_to_slot[row, :length])
        self._free_rows.append(row)
