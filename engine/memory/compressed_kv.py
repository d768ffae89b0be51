"""DeepSeek-V4's KV memory: per-kind pools addressed through the token slots of the shared table.

A V4 model stores three kinds of rows (engine/planner/deepseek_v4.py says what and why; the pool
list and every pool's row count come from there, so the engine allocates the plan's terms):

    entries   one compressed entry per window of r tokens (CSA: the head_dim entry and the
              indexer key side by side; HCA: the entry), kept while the request lives
    recent    the window's K (every layer) and the compressors' raw kv / gate projections of
              the last few tokens (CSA 2r - 1, HCA r - 1), trimmed as tokens leave them

Rows are addressed through the token slots the runner already manages (SlotTable): every pool
has a map `slot -> row` ([num_slots] int64; row 0 is the padding row the pad slot writes to), and
`slot_pos [num_slots]` holds each slot's position. A slot taken for a step (a prefill chunk's
tokens, a tree node, draft scratch) gets a row in every pool, so a forward writes first and
reads back through the maps whatever it needs (its own tokens included), with fixed shapes that
CUDA graphs capture. Different tree nodes at one position therefore never collide, and a rejected
node's rows go back with its slot. When tokens are committed the rows they no longer need go
back: a recent row once its token is `keep` positions behind the end, an entry row unless its
token closes a window ((position + 1) % r == 0). A request holds at most `keep` recent rows per
pool and one entry row per closed window; a step's slots hold one row each.

The table tells this class about its slots through three calls (`SlotTable.listeners`):
`taken(slots)`, `released(slots)` (in-flight slots: each holds a row in every pool) and
`committed(req_to_slot_row, old_len, new_len)` / `finished(req_to_slot_row, length)` for a
request's committed positions, whose rows are known from their positions alone (no device sync).
An MTP draft's pools under adaptive speculation (`lags`) hear of the positions the draft has run
over instead: after plain steps it catches up over positions whose rows were kept for it.
"""

from __future__ import annotations

import torch

from specdeploy.engine.planner.deepseek_v4 import PoolSpec, V4Config, v4_kept_positions, v4_pool_rows, v4_pools
from specdeploy.engine.memory.kv import PoolExhausted

PAD_ROW = 0


class _RowStack:
    """Free rows of one pool on the device, like SlotTable's slot stack: the top `num_free`
    entries are free; row 0 (padding) is never handed out."""

    def __init__(self, rows: int, device):
        self.capacity = rows - 1
        self._stack = torch.arange(rows - 1, 0, -1, dtype=torch.int64, device=device)
        self.num_free = rows - 1

    def pop(self, n: int) -> torch.Tensor:
        if n > self.num_free:
            raise PoolExhausted(f"DeepSeek-V4 pool exhausted: asked for {n} rows, {self.num_free} free")
        self.num_free -= n
        return self._stack[self.num_free:self.num_free + n].clone()

    def push(self, rows: torch.Tensor) -> None:
        n = rows.numel()
        if self.num_free + n > self.capacity:
            raise RuntimeError("DeepSeek-V4 pool: freeing more rows than were taken")
        self._stack[self.num_free:self.num_free + n] = rows.reshape(-1)
        self.num_free += n


class V4KV:
    """The pools of one V4 model (target or MTP draft). `data[name]` is [layers of the pool, rows,
    width]; `layer_slot[name][layer]` is a model layer's index into it."""

    def __init__(self, v4: V4Config, role: str, num_slots: int, max_total_tokens: int,
                 max_running_requests: int, in_flight_rows: int, dtype: torch.dtype, device):
        self.v4, self.role = v4, role
        # A draft's pools under adaptive speculation trim as the draft runs, not as tokens are
        # committed (SlotTable.commit's lag): set by the runner.
        self.lags = False
        self.pools: dict[str, PoolSpec] = {p.name: p for p in v4_pools(v4, role)}
        self.data: dict[str, torch.Tensor] = {}
        self.maps: dict[str, torch.Tensor] = {}
        self.layer_slot: dict[str, dict[int, int]] = {}
        self._free: dict[str, _RowStack] = {}
        # Zeros: padded rows are read with zero weight, so every row must hold finite numbers.
        for name, p in self.pools.items():
            rows = v4_pool_rows(p, max_total_tokens, max_running_requests, in_flight_rows)
            self.data[name] = torch.zeros(len(p.layers), rows, p.width, dtype=dtype, device=device)
            self.maps[name] = torch.zeros(num_slots, dtype=torch.int64, device=device)
            self.layer_slot[name] = {layer: i for i, layer in enumerate(p.layers)}
            self._free[name] = _RowStack(rows, device)
        self.slot_pos = torch.zeros(num_slots, dtype=torch.int64, device=device)

    # ---- what the model reads ------------------------------------------------------------------

    def pool_for(self, layer: int, kind: str) -> str | None:
        """The name of the pool of `kind` ("window", "entries", "state") holding `layer`."""
        for name, p in self.pools.items():
            if layer in p.layers and (name == "window" if kind == "window" else name.endswith("_" + kind)):
                return name
        return None

    def tensor(self, name: str, layer: int) -> torch.Tensor:
        """[rows, width] of `layer` in pool `name`."""
        return self.data[name][self.layer_slot[name][layer]]

    @property
    def nbytes(self) -> int:
        """Bytes of every pool and slot map (what the plan's per-token and per-request terms count)."""
        pools = sum(t.numel() * t.element_size() for t in self.data.values())
        maps = sum(t.numel() * t.element_size() for t in self.maps.values())
        return pools + maps + self.slot_pos.numel() * self.slot_pos.element_size()

    def free_rows(self, name: str) -> int:
        return self._free[name].num_free

    # ---- the slot table's calls --------------------------------------------------------------

    def taken(self, slots: torch.Tensor) -> None:
        """Slots handed out for a step: each gets a row in every pool (or, where a pool is short,
        none anywhere: PoolExhausted)."""
        slots = slots.reshape(-1)
        if not slots.numel():
            return
        self._check_free({name: slots.numel() for name in self._free})
        for name, stack in self._free.items():
            self.maps[name][slots] = stack.pop(slots.numel())

    def _check_free(self, wanted: dict[str, int]) -> None:
        short = [name for name, k in wanted.items() if k > self._free[name].num_free]
        if short:
            raise PoolExhausted(f"DeepSeek-V4 pool {short[0]} exhausted: {wanted[short[0]]} rows wanted, "
                                f"{self._free[short[0]].num_free} free")

    def released(self, slots: torch.Tensor) -> None:
        """In-flight slots given back (rejected nodes, scratch, an undone step)."""
        slots = slots.reshape(-1)
        if not slots.numel():
            return
        for name, stack in self._free.items():
            stack.push(self.maps[name][slots])
            self.maps[name][slots] = PAD_ROW

    def committed(self, row_slots: torch.Tensor, old_len: int, new_len: int) -> None:
        """A request's positions old_len .. new_len - 1 are now committed (row_slots: its row of
        req_to_slot). Recent rows of tokens `keep` behind the new end and entry rows of tokens
        that close no window go back."""
        if new_len <= old_len:
            return
        for name, p in self.pools.items():
            if p.kind == "recent":
                start, stop = max(0, old_len - p.keep), max(0, new_len - p.keep)
                if stop > start:
                    self._give_back(name, row_slots[start:stop])
            else:
                # The positions that close no window, as slices of the row (views: no device
                # sync in the step's commit); a long prefill chunk as one index tensor instead.
                r = p.ratio
                if new_len - old_len <= 2 * r:
                    parts, start = [], old_len
                    for pos in range(old_len, new_len):
                        if (pos + 1) % r == 0:
                            if pos > start:
                                parts.append(row_slots[start:pos])
                            start = pos + 1
                    if new_len > start:
                        parts.append(row_slots[start:new_len])
                    slots = torch.cat(parts) if len(parts) > 1 else (parts[0] if parts else None)
                else:
                    index = [pos for pos in range(old_len, new_len) if (pos + 1) % r]
                    slots = row_slots[torch.tensor(index, dtype=torch.int64).to(row_slots.device, non_blocking=True)]
                if slots is not None and slots.numel():
                    self._give_back(name, slots)

    def finished(self, row_slots: torch.Tensor, length: int, processed: int | None = None) -> None:
        """A request leaves with `length` committed tokens: every row its slots still hold. For
        a lagging draft's pools (`lags`), `processed` of them trimmed as the draft ran: the rows
        those keep, and every row of the positions after them (taken, never trimmed)."""
        processed = length if processed is None else processed
        for name, p in self.pools.items():
            kept = _positions(row_slots, v4_kept_positions(p, processed))
            if processed < length:
                kept = torch.cat([kept, row_slots[processed:length]])
            if kept.numel():
                self._give_back(name, kept)

    # ---- moving a request between servers (prefill/decode disaggregation) ---------------------

    def staged_pieces(self, row_slots: torch.Tensor, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(pool tensor [layers, rows, width], rows) per pool: the rows an n-token committed
        request holds (deepseek_v4.v4_kept_positions), in position order; what a staging region
        carries (transfer.StagedKV.of_pieces)."""
        return [(self.data[name], self.maps[name][_positions(row_slots, v4_kept_positions(p, n))])
                for name, p in self.pools.items()]

    def staged_rows(self, n: int) -> list[tuple[torch.Tensor, int]]:
        """(pool tensor, number of rows) per pool for n tokens: staged_pieces' shape, from n alone."""
        return [(self.data[name], len(v4_kept_positions(p, n))) for name, p in self.pools.items()]

    def arrived(self, row_slots: torch.Tensor, n: int) -> None:
        """A request's n positions were computed by another server (row_slots: its row of
        req_to_slot, whose first n slots the table took without `taken`): give the positions the
        rows they keep once committed, nothing more (a prompt need not fit in the rows one step
        may hold), and set the slots' positions. Raises, taking nothing, where a pool is short."""
        self._check_free({name: len(v4_kept_positions(p, n)) for name, p in self.pools.items()})
        for name, p in self.pools.items():
            slots = _positions(row_slots, v4_kept_positions(p, n))
            self.maps[name][slots] = self._free[name].pop(slots.numel())
        self.slot_pos[row_slots[:n]] = torch.arange(n, dtype=torch.int64, device=row_slots.device)

    def _give_back(self, name: str, slots: torch.Tensor) -> None:
        self._free[name].push(self.maps[name][slots])
        self.maps[name][slots] = PAD_ROW


def _positions(row_slots: torch.Tensor, positions: range) -> torch.Tensor:
    """The slots of `positions` (a range with a step) in a request's row: a view, no device sync."""
    return row_slots[positions.start:positions.stop:positions.step]
