"""The prefill and decode roles of disaggregated serving (docs/disaggregation.md), as the
Runner's entry points: receive, hold, export, activate, abort's split-role cases.

"both" does everything on one server. "prefill" stops after a request's first token: the
request (max_tokens 1) is *held*, its slots and row kept, until `export_held` has put its state
into the metadata buffer and the transfer is done (`release_held`). "decode" also `receive`s
requests whose prompt KV another server writes into the slots `receive` took; `activate` then
starts them from the metadata buffer's row exactly where a local prefill would have left them.

`SplitRole` is a part of `Runner` (runner.py), over the runner's state: the slot table, the KV
pools, `draft_hidden`, the metadata buffer made by `_init_split_role`, and the request maps
`_held` (prefill role: first token out, state not sent yet) and `_receiving` (decode role:
slots taken, KV arriving).
"""

from __future__ import annotations

import torch

from specdeploy.engine.memory.kv import KVPool, PoolExhausted
from specdeploy.engine.runtime.request import NoCapacity, Request, StepOutput


class SplitRole:
    def _init_split_role(self, plan, dtype: torch.dtype) -> None:
        """The two split roles' metadata buffer, [max_running_requests, H_s] as the plan sizes
        it; the draft's carried state must fit a row exactly (H_s where hidden_size was meant
        would be 4x short for hc_mult 4). In host memory on any device: the transfer engine
        reads and writes it there (a row is copied to or from the device once per request)."""
        self.metadata = None
        if self.role == "both":
            return
        from specdeploy.engine.runtime.transfer import MetadataBuffers

        self.metadata = MetadataBuffers(plan.buffers, dtype, "cpu", pin=self.device.type == "cuda")
        rows, width = plan.buffers.metadata_hidden_states_shape
        carried = self.draft.carried_size if self.draft is not None else width
        if width != carried or rows != self.max_running_requests:
            raise ValueError(f"the plan's metadata buffer is [{rows}, {width}]; this engine "
                             f"needs [{self.max_running_requests}, {carried}] (the draft's carried width)")

    def receive(self, req: Request) -> tuple[int, list[int]]:
        """Decode role: admit a request whose prompt another server prefills; -> (its row, the
        slots its prompt tokens' KV must be written to, position by position). The request
        holds them, and decodes nothing, until `activate` (or `abort`)."""
        if self.role != "decode":
            raise RuntimeError(f"receive() on a {self.role!r} runner")
        seq = self._admit(req, match=False)   # the prefill server sends every prompt position
        n = len(req.prompt_ids)
        try:
            seq.row = self.table.alloc_row()
            self._make_room(n)
            # Committed as they are taken: the positions arrive computed (DeepSeek-V4's pools
            # give them only the rows a committed request keeps).
            slots = self.table.alloc_arrived(seq.row, n)
        except BaseException as e:  # the reservation and the row go back: it holds nothing
            if seq.row >= 0:
                self.table.free_row(seq.row, 0)
            self._reserved -= seq.reserved
            if isinstance(e, PoolExhausted):
                # Slots or pool rows held by running requests: it waits for them, as admission does.
                raise NoCapacity(f"request {req.id}: {e}") from e
            raise
        seq.length = n
        self._receiving[req.id] = seq
        return seq.row, slots.tolist()

    def kv_pools(self) -> list:
        return [p for p in (self.target_kv, self.draft_kv) if p is not None]

    @property
    def slot_row_pools(self) -> bool:
        """Whether every pool has one row per token slot (KVPool: addressable by slot runs, the
        direct transfer path); DeepSeek-V4's pools (V4KV) move only staged."""
        return all(isinstance(p, KVPool) for p in self.kv_pools())

    def kv_signature(self) -> tuple:
        """What a peer's pools must equal for their bytes to mean the same here, per pool
        (protocol.ServerInfo): (layers, bytes per slot) of a KVPool; (name, layers, row bytes,
        ratio, keep) of each of a V4KV's pools."""
        from specdeploy.engine.runtime.transfer import PoolLayout

        def one(pool):
            if isinstance(pool, KVPool):
                return PoolLayout.of(pool).shape()
            return tuple((name, len(spec.layers), pool.data[name][0, 0].numel() * pool.data[name].element_size(),
                          spec.ratio, spec.keep) for name, spec in pool.pools.items())

        return tuple(one(p) for p in self.kv_pools())

    def staged_kv(self, n: int):
        """Where n prompt tokens' rows of every pool lie in a staging region (transfer.StagedKV)."""
        from specdeploy.engine.runtime.transfer import StagedKV

        if self.slot_row_pools:
            return StagedKV.of(self._kv_pairs(), n)
        return StagedKV.of_pieces([piece for p in self.kv_pools() for piece in p.staged_rows(n)])

    def _kv_pairs(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(p.k, p.v) for p in self.kv_pools()]

    def _kv_pieces(self, slots: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(tensor, rows) of every pool for a request whose prompt positions are `slots` (device)."""
        from specdeploy.engine.runtime.transfer import pool_pieces

        if self.slot_row_pools:
            return pool_pieces(self._kv_pairs(), slots)
        return [piece for p in self.kv_pools() for piece in p.staged_pieces(slots, slots.numel())]

    def gather_kv(self, slots: list[int], region: torch.Tensor) -> None:
        """Pack the rows of `slots` (a request's prompt positions, in order) in every pool into a
        staging region (a 1-d uint8 host tensor, pinned on CUDA; layout transfer.StagedKV): for
        slot-row pools row j + 1 of each half is slots[j]. Returns when the bytes are in host memory."""
        from specdeploy.engine.runtime.transfer import gather_pieces

        gather_pieces(self._kv_pieces(torch.tensor(slots, dtype=torch.int64, device=self.device)), region)

    def gather_held(self, req_id: str, region: torch.Tensor) -> None:
        """gather_kv of a held request's prompt slots (prefill role)."""
        self.gather_kv(self.held_slots(req_id), region)

    def _scatter_kv(self, index: torch.Tensor, region: torch.Tensor) -> None:
        """The inverse of gather_kv, into the slots `index`; returns when the region may be reused."""
        from specdeploy.engine.runtime.transfer import scatter_pieces

        scatter_pieces(self._kv_pieces(index), region)

    def activate(self, req_id: str, staged: torch.Tensor | None = None) -> list[StepOutput]:
        """Decode role: the prompt KV has arrived (in the request's slots, or in `staged`, a
        staging region laid out as gather_kv's, which goes to its slots now) and the metadata
        buffer's row holds the first token and the draft's carried state; the request runs from
        here, as after a local prefill. -> the first token's output."""
        seq = self._receiving[req_id]
        md = self.metadata
        cached, first = self.check_arrived(req_id)
        if staged is not None:
            self._scatter_kv(self.table.req_to_slot[seq.row, :seq.length], staged)
        del self._receiving[req_id]
        if self.draft is not None:
            self.draft_hidden[seq.row] = md.hidden[seq.row].to(self.device)
            if self.policy is not None:
                self._catch_up_count[seq.row] = 0
        if seq.generator is not None and seq.req.temperature > 0:
            # The prefill server drew the first token's uniform from a generator with this seed;
            # drawing it here too keeps a seeded request's stream what one server gives it.
            self._uniforms([seq], 1)
        self._running[req_id] = seq
        seq.num_cached_tokens = cached
        outputs = self._emit([seq], [[first]], [0])
        outputs[0].num_cached_tokens = cached
        if req_id in self._running:
            self.rows.start([seq.row], [seq.length], [seq.root])
        return outputs

    def check_arrived(self, req_id: str) -> tuple[int, int]:
        """A received request's metadata row, checked before anything acts on it: -> (cached
        prompt tokens, first token); ValueError for a row no prefill of this prompt could write."""
        seq = self._receiving[req_id]
        md = self.metadata
        cached = int(md.fixed["cached_tokens"][seq.row])
        if not 0 <= cached < seq.length:
            raise ValueError(f"request {req_id}: the prefill server reports {cached} cached prompt "
                             f"tokens of {seq.length}")
        first = int(md.fixed["output_token_id"][seq.row])
        if not 0 <= first < self.target.cfg.vocab_size:
            raise ValueError(f"request {req_id}: first token {first} outside the vocabulary")
        return cached, first

    def held_slots(self, req_id: str) -> list[int]:
        """A held request's prompt slots, position by position (prefill role)."""
        seq = self._held[req_id]
        return self.table.req_to_slot[seq.row, :seq.length].tolist()

    def export_held(self, req_id: str) -> tuple[int, list[int]]:
        """Prefill role: put a held request's first token, its prefix-cache hit and the draft's
        carried state into its metadata row; -> (row, the slots of its prompt tokens, position by
        position). The slots stay the request's until `release_held`."""
        seq = self._held[req_id]
        md = self.metadata
        md.fixed["output_token_id"][seq.row] = seq.root
        md.fixed["cached_tokens"][seq.row] = seq.num_cached_tokens  # its prefix-cache hit
        if self.draft is not None:
            md.hidden[seq.row] = self.draft_hidden[seq.row].cpu()
        return seq.row, self.held_slots(req_id)

    def release_held(self, req_id: str) -> None:
        seq = self._held.pop(req_id)
        self._release_slots(seq)
        self._reserved -= seq.reserved

    def is_held(self, req_id: str) -> bool:
        return req_id in self._held

    def is_receiving(self, req_id: str) -> bool:
        return req_id in self._receiving

    @property
    def num_held(self) -> int:
        return len(self._held)

    @property
    def num_receiving(self) -> int:
        return len(self._receiving)

    def _abort_split_role(self, req_id: str) -> bool:
        """abort() of a held or a receiving request; False if it is neither."""
        if req_id in self._held:
            self.release_held(req_id)
            return True
        seq = self._receiving.pop(req_id, None)
        if seq is None:
            return False
        self._release_slots(seq, keep=False)  # its KV may not have arrived
        self._reserved -= seq.reserved
        return True
