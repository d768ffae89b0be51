"""Admission and slot bookkeeping of the Runner: the limits a request is checked against, its
worst-case reservation, release and abort, and the prefix cache's side of a request.

A request reserves, at admission, the most slots it can hold at its peak (`slots_needed`:
prompt + output + the widest step's scratch); the free slots and the cache's evictable ones must
cover what every admitted request may still take. With the prefix cache on (prefix_cache.py), a
prompt's prefill starts after its longest cached prefix, whose slots the request shares with the
tree; finished requests leave their positions there.

`Admission` is a part of `Runner` (runner.py), over the runner's state: the slot table, the
prefix cache, the request maps (`_pending`, `_running`, `_held`, `_receiving`) and `_reserved`.
"""

from __future__ import annotations

import math

import torch

from specdeploy.engine.runtime.prefix_cache import DEFER_MIN_TOKENS, shared_prefix_len
from specdeploy.engine.runtime.request import NoCapacity, Request, Seq

# A request's top_k goes into an int64 tensor with the batch's: a larger one is refused at admission.
_INT64_MAX = 2**63 - 1


class Admission:
    def _init_requests(self) -> None:
        """The request maps, the slots reserved for them, and the step's undo lists."""
        self._pending: list[Seq] = []
        self._running: dict[str, Seq] = {}
        self._held: dict[str, Seq] = {}        # prefill role: first token out, state not sent yet
        self._receiving: dict[str, Seq] = {}   # decode role: slots taken, KV arriving
        self._reserved = 0
        # What the step in progress took and has not committed yet, given back if it fails:
        # slot tensors, (row, start, end) req_to_slot entries written, requests given a row.
        self._step_slots: list[torch.Tensor] = []
        self._step_entries: list[tuple[int, int, int]] = []
        self._step_rows: list[Seq] = []
        self.num_draft_tokens_proposed = 0
        self.num_draft_tokens_accepted = 0

    def slots_needed(self, prompt_len: int, max_tokens: int) -> int:
        """Slots a request can hold at its peak: prompt + output, plus one iteration's scratch
        (the draft's (num_steps - 1) x topk and the verify tree's num_draft_tokens; 1 without a draft)."""
        scratch = self._max_scratch if self.draft else 1
        return prompt_len + max_tokens + scratch

    @property
    def max_sequence_tokens(self) -> int:
        """The most prompt + max_tokens one request may have: the context minus the positions
        one draft tree looks ahead past the committed tokens."""
        return self.context_length - (self._max_steps + 1) * (2 if self.launch_ahead else 1)

    def max_new_tokens(self, prompt_len: int) -> int:
        """The largest max_tokens a request with this prompt can be admitted with (by context
        and by pool size); 0 or less when the prompt alone does not fit."""
        return min(self.max_sequence_tokens - prompt_len,
                   self.table.capacity - self.slots_needed(prompt_len, 0))

    def add(self, req: Request) -> None:
        self._pending.append(self._admit(req))

    def _admit(self, req: Request, match: bool = True) -> Seq:
        """Check a request and reserve its worst case; -> its (unscheduled) sequence, started
        at its cached prefix if `match`."""
        if not req.prompt_ids:
            raise ValueError(f"request {req.id}: empty prompt")
        if req.max_tokens < 1:
            raise ValueError(f"request {req.id}: max_tokens must be >= 1, got {req.max_tokens}")
        if self.role == "prefill" and req.max_tokens != 1:
            raise ValueError(f"request {req.id}: a prefill server computes the first token only "
                             f"(max_tokens 1, got {req.max_tokens})")
        if (req.id in self._running or req.id in self._held or req.id in self._receiving
                or any(s.req.id == req.id for s in self._pending)):
            raise ValueError(f"request {req.id}: id already in use")
        vocab = self.target.cfg.vocab_size
        if min(req.prompt_ids) < 0 or max(req.prompt_ids) >= vocab:
            raise ValueError(f"request {req.id}: prompt token id outside [0, {vocab})")
        if not (0 <= req.temperature < math.inf and 0 < req.top_p <= 1 and 0 <= req.top_k <= _INT64_MAX):
            raise ValueError(f"request {req.id}: bad sampling parameters (temperature >= 0, "
                             f"0 < top_p <= 1, 0 <= top_k < 2**63)")
        if req.seed is not None and not -2**63 <= req.seed < 2**64:
            raise ValueError(f"request {req.id}: seed {req.seed} is outside [-2**63, 2**64)")
        if len(req.prompt_ids) + req.max_tokens > self.max_sequence_tokens:
            raise ValueError(f"request {req.id}: prompt ({len(req.prompt_ids)}) + max_tokens "
                             f"({req.max_tokens}) exceeds the context length {self.context_length}")
        need = self.slots_needed(len(req.prompt_ids), req.max_tokens)
        if need > self.table.capacity:
            raise ValueError(f"request {req.id}: needs {need} KV slots, the pool has "
                             f"{self.table.capacity} (max_total_tokens)")
        if self.num_running >= self.max_running_requests:
            raise NoCapacity(f"request {req.id}: no room now ({self.num_running} running)")
        seq = Seq(req, row=-1, length=0, reserved=need)
        if req.controls is not None and req.controls.prompt_logprobs is not None:
            seq.prompt_lps = []
        if req.seed is not None:  # before anything is taken: nothing to give back if it fails
            seq.generator = torch.Generator(device=self.device).manual_seed(req.seed)
        # From here seq owns what it takes (a cache lock): any failure gives it back.
        try:
            if match:
                self._match_prefix(seq)
            # Every admitted request may still take (reserved - length) slots; free and evictable
            # slots must cover all of that (without a cache: total reserved <= capacity).
            outstanding = self._reserved - sum(s.length for s in self._all_seqs())
            if outstanding + need - seq.length > self.num_free_slots:
                raise NoCapacity(f"request {req.id}: no room now ({self.num_running} running)")
        except BaseException:
            self._release_slots(seq)
            raise
        self._reserved += need
        return seq

    def abort(self, req_id: str) -> None:
        self._stashed = [o for o in self._stashed if o.req_id != req_id]
        for i, seq in enumerate(self._pending):
            if seq.req.id == req_id:
                self._pending.pop(i)
                self._reserved -= seq.reserved
                self._release_slots(seq)  # it may be partly prefilled, or hold a cache hit
                return
        if self._abort_split_role(req_id):  # held or receiving (split_role.py)
            return
        seq = self._running.get(req_id)
        if seq is None:
            raise KeyError(f"no request {req_id!r}")
        self._release(seq)

    def _release(self, seq: Seq, hold: bool = False) -> None:
        del self._running[seq.req.id]
        self._drop_ahead()  # it was staged for a batch with this request in it
        if not self._running:
            self._drop_in_flight()
        if hold:  # prefill role: its state has yet to reach a decode server
            self._held[seq.req.id] = seq
            return
        self._release_slots(seq)
        self._reserved -= seq.reserved

    def _all_seqs(self) -> list[Seq]:
        """Every request holding a reservation."""
        return [*self._pending, *self._running.values(), *self._held.values(), *self._receiving.values()]

    @property
    def num_free_slots(self) -> int:
        """Slots a request can get now: free ones and unlocked cached ones (evicted on demand)."""
        cache = self.prefix_cache
        # The staged next step's slots count as free: they are the running requests' scratch,
        # which their reservations already hold, and are given back whenever slots run short.
        ahead = self._ahead.slots.numel() if self._ahead is not None else 0
        return self.table.num_free + ahead + (cache.evictable_slots if cache is not None else 0)

    # ---- prefix cache (prefix_cache.py) --------------------------------------------------------

    def _match_prefix(self, seq: Seq) -> None:
        """Start seq at its longest cached prefix (at most all but the last prompt token, whose
        logits give the first output token), locked until it is released. Called at admission
        and again before its first prefill chunk, when more may be cached."""
        cache = self.prefix_cache
        if cache is None:
            return
        if seq.cache_node is not None and seq.match_version == cache.num_inserted:
            return  # nothing was cached since its last match
        seq.match_version = cache.num_inserted
        # Prompt log-probabilities want every prompt position computed: no reuse (it still caches).
        longest = 0 if seq.prompt_lps is not None else len(seq.req.prompt_ids) - 1
        match = cache.match(self._seq_keys(seq), longest)
        if seq.cache_node is not None and match.length <= seq.length:
            return
        cache.lock(match.node)
        if seq.cache_node is not None:
            cache.unlock(seq.cache_node)
        seq.cache_node, seq.matched_slots = match.node, match.slots
        seq.length = seq.cached = match.length

    def _cache_prefix(self, seq: Seq) -> None:
        """After a prefill chunk: cache the positions seq has written (others with the same
        prompt can match them while it runs) and point its row at the tree's slots."""
        cache, n = self.prefix_cache, seq.length
        keys = self._seq_keys(seq)[:n]
        if len(keys) < n or n <= seq.cached:
            return
        row = self.table.req_to_slot[seq.row]
        existed, match = cache.insert(keys, row[:n])
        if existed > seq.cached:  # written twice (another request cached them meanwhile): keep the tree's
            self.table.free(row[seq.cached:existed].clone())
            row[seq.cached:existed] = match.slots[seq.cached:existed]
        cache.lock(match.node)
        cache.unlock(seq.cache_node)
        seq.cache_node, seq.cached = match.node, n

    def _defer_for_cache(self, seq: Seq, chosen: list[tuple[Seq, int]]) -> bool:
        """Whether seq (not started) should wait a step because a request chosen for this chunk
        writes at least DEFER_MIN_TOKENS more of seq's prompt than the cache holds now: next step
        it matches them instead of computing them twice (requests sent together with one system
        prompt). The first request of a chunk is never deferred, so every step makes progress."""
        if self.prefix_cache is None:
            return False
        prompt, la = seq.req.prompt_ids, self.prefix_cache.lookahead
        for other, take in chosen:
            shared = shared_prefix_len(prompt, other.req.prompt_ids)
            if min(shared - la, other.length + take, len(prompt) - 1) - seq.length >= DEFER_MIN_TOKENS:
                return True
        return False

    def _seq_keys(self, seq: Seq) -> list[int]:
        """The cache keys of every position of seq whose key its known tokens determine (the
        prompt's computed once)."""
        cache, prompt = self.prefix_cache, seq.req.prompt_ids
        if seq.prompt_keys is None:
            seq.prompt_keys = cache.keys(prompt)
        if not seq.tokens:
            return seq.prompt_keys
        return seq.prompt_keys + cache.keys(prompt[len(prompt) - cache.lookahead:] + seq.tokens)

    def _release_slots(self, seq: Seq, keep: bool = True) -> None:
        """Give back seq's row and slots; with a cache and `keep`, its positions go into the
        tree (copies of positions already there are freed) and its lock is dropped."""
        cache = self.prefix_cache
        if cache is None:
            if seq.row >= 0:
                self.table.free_row(seq.row, seq.length, lag=seq.pending)
            seq.row = -1
            return
        if seq.row >= 0:
            row = self.table.req_to_slot[seq.row]
            keys = self._seq_keys(seq) if keep else []
            # Positions whose key is known (all, once the first token is out) and whose draft
            # K/V is written (not the `pending` ones of adaptive plain steps); none unless keep.
            n = min(seq.length - seq.pending, len(keys)) if keep else seq.cached
            existed = cache.insert(keys[:n], row[:n])[0] if n > seq.cached else n
            if existed > seq.cached:
                self.table.free(row[seq.cached:existed].clone())
            if seq.length > max(n, seq.cached):
                self.table.free(row[max(n, seq.cached):seq.length].clone())
            self.table.free_row(seq.row, 0)
        seq.row = -1
        if seq.cache_node is not None:
            cache.unlock(seq.cache_node)
            seq.cache_node = None

    @property
    def num_running(self) -> int:
        """Requests holding a row: pending, running, held and receiving."""
        return len(self._running) + len(self._pending) + len(self._held) + len(self._receiving)

    @property
    def num_prefilling(self) -> int:
        """Requests whose prompt is not wholly prefilled yet (a step prefills at most
        prefill_chunk_tokens of them)."""
        return len(self._pending)

    @property
    def has_work(self) -> bool:
        """Whether step() would compute anything (or has outputs to give)."""
        return bool(self._running or self._pending or self._stashed)

    def _alloc(self, n: int, host: bool = False) -> torch.Tensor:
        """n slots, on the device (host: a host tensor)."""
        self._make_room(n)
        return self.table.alloc_host(n) if host else self.table.alloc(n)

    def _make_room(self, n: int) -> None:
        """Where fewer than n slots are free: give back the staged next step, then evict from the
        prefix cache."""
        if self.table.num_free < n:
            self._drop_ahead()
        if self.prefix_cache is not None and self.table.num_free < n:
            self.prefix_cache.evict(n - self.table.num_free)
