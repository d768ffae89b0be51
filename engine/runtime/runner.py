"""The batched engine loop: prefill, then speculative (or plain) decoding for all running requests.

One `step()`:
  1. prefill waiting requests, one chunk of at most prefill_chunk_tokens padded tokens (long
     prompts take several steps): the target writes their prompt K/V and, where a prompt ends,
     samples the first token; the draft head runs over the same positions (draft extend) with
     the target's features;
  2. for the requests already running, one speculative iteration:
       draft    num_steps x topk candidates (draft pool, scratch slots)
       tree     keep num_draft_tokens nodes (tree.py)
       verify   one target forward over the tree with its ancestor mask (tree slots)
       accept   greedy or rejection sampling (verify.py)
       extend   the draft runs over the accepted tokens with the target's true features, which
                rewrites the draft K/V of those positions and yields the next root's hidden
       commit   the accepted nodes' slots join the request; every other slot is freed.
     Without a draft head, one plain decode step.

Where each part lives: admission and the prefix cache (admission.py), the decode steps in flight,
overlap and launch-ahead (decode.py), adaptive speculation and the draft's catch-up
(adaptive_steps.py), the prefill and decode roles (split_role.py), sampling glue (sampling.py);
what a request is and keeps (request.py). `Runner` is those parts over one set of state, made
by the `_init_*` steps its `__init__` runs in order.

A request's committed tokens own the same slot in the target and the draft pool. State kept per
request between steps: its committed length, the last emitted token (the next tree root, not yet
in the KV) and the draft's hidden state after that token (`draft_hidden`, one row per request).
HTTP, tokenization, stop strings and queueing live elsewhere.

Roles (prefill/decode disaggregation, docs/disaggregation.md): "both" does all of the above;
"prefill" stops after step 1 and holds the request for export, "decode" receives requests
prefilled elsewhere (split_role.py). With the prefix cache on, a prompt's prefill starts after
its longest cached prefix (admission.py).
"""

from __future__ import annotations

import torch

from specdeploy.engine.models.attention import causal_batch
from specdeploy.engine.models.draft import DraftHead
from specdeploy.engine.models.protocol import OWN_POOLS, TargetModel
from specdeploy.engine.planner.plan import NONE, PREFILL_CHUNK_TOKENS, SERVER_ROLES, SpecSettings, SpecShape
from specdeploy.engine.runtime.adaptive_steps import Adaptive
from specdeploy.engine.runtime.admission import Admission
from specdeploy.engine.runtime.calls import ModelCalls
from specdeploy.engine.runtime.decode import Decode
from specdeploy.engine.memory.kv import PAD_SLOT, KVPool, SlotTable
from specdeploy.engine.runtime.prefix_cache import PrefixCache
from specdeploy.engine.runtime.request import NoCapacity, Request, Seq, StepOutput
from specdeploy.engine.runtime.rows import RowState, RowSteps
from specdeploy.engine.runtime.sampling import Sampling
from specdeploy.engine.runtime.split_role import SplitRole
from specdeploy.engine.speculative.logits import top_logprobs

__all__ = ["NoCapacity", "Request", "Runner", "StepOutput"]

_FEATURE_KIND = {"EAGLE": "eagle", "EAGLE3": "eagle3", "MTP": "mtp"}
# Prompt positions whose logits are taken at once for prompt logprobs (x vocabulary x 4 bytes).
_PROMPT_LOGPROBS_ROWS = 256


class Runner(Admission, SplitRole, Decode, Adaptive, Sampling):
    # Rule of this class: __init__ only orchestrates; each `_init_*` step makes one part's state
    # (in this order: later steps read what earlier ones made).
    def __init__(self, target: TargetModel, draft: DraftHead | None = None, spec: SpecSettings | None = None, *,
                 plan=None, max_total_tokens: int | None = None,
                 max_running_requests: int | None = None, context_length: int | None = None,
                 device: torch.device | str = "cpu", seed: int = 0,
                 cuda_graph_batch_sizes: tuple[int, ...] | None = None, graph_mode: str | None = None,
                 prefill_chunk_tokens: int = PREFILL_CHUNK_TOKENS, fused_spec_step: bool = True,
                 role: str = "both", prefix_cache: bool = False, adaptive: bool = False,
                 adaptive_shapes: list[SpecShape] | None = None, step_costs_s: dict | None = None,
                 catch_up_tokens: int = 16, policy_options=None,
                 kv_cache_dtype: torch.dtype | None = None, overlap: bool | None = None,
                 launch_ahead: bool = False, extend_graphs: bool = False):
        """graph_mode: "capture" (CUDA graphs; the default on CUDA when batch sizes are known),
        "padded" (the graphs' static buffers and padding, replayed eagerly: any device),
        "off" (plain eager calls; the default on CPU).
        prefill_chunk_tokens: padded tokens one prefill forward carries (the plan sizes the
        activation workspace for this many); longer prompts are prefilled over several steps.
        fused_spec_step: with graphs, one graph per speculative iteration (the default); False
        graphs each model call alone, with tree building and acceptance eager in between.
        adaptive: choose the shape per step among adaptive_shapes (default: candidate_shapes of
        the configured one); step_costs_s {(shape, bucket): seconds} replaces the start-up
        measurement; catch_up_tokens: plain steps the draft may lag behind; policy_options:
        keyword arguments of AdaptivePolicy.
        role: "both", "prefill" or "decode" (split_role.py); the two split roles need a plan,
        whose metadata buffer shape they allocate.
        prefix_cache: keep finished requests' KV in the slot pool and reuse it for prompts that
        share a prefix (prefix_cache.py); evicted least recently used when slots are needed.
        overlap: stage the next decode step (its slots and packed input) while the current one
        runs on the device (decode.py); default on for CUDA. The tokens are the same
        either way.
        launch_ahead: launch the next decode step before waiting for the current one
        (decode.py): a request rides one discarded step past its end, so each needs one more
        step of context (max_sequence_tokens); not with adaptive speculation.
        extend_graphs: with graphs ("capture" or "padded"), a prefill chunk of one request and at
        most EXTEND_GRAPH_TOKENS[-1] tokens (the question after a prefix-cache hit) replays a
        graph of the target's forward and the draft's extend (extend_graphs.py); any other chunk,
        and every chunk with it off, runs eagerly. Not for a prefill server (it captures no
        graphs), tensor parallelism, or targets with KV pools of their own. `use_extend_graphs`
        switches the replays off and on at run time."""
        _check_role(role, plan, launch_ahead, adaptive)
        self.role, self.launch_ahead = role, launch_ahead
        if plan is not None:  # the plan's limits and shape
            max_total_tokens, max_running_requests, context_length = (
                plan.max_total_tokens, plan.max_running_requests, plan.context_length)
            cuda_graph_batch_sizes = cuda_graph_batch_sizes or tuple(plan.cuda_graph_batch_sizes)
            spec = spec or SpecSettings(plan.algorithm, plan.num_steps, plan.topk, plan.num_draft_tokens)
        if max_total_tokens is None or max_running_requests is None:
            raise ValueError("give a plan or both max_total_tokens and max_running_requests")
        self.device = torch.device(device)
        self.max_running_requests = max_running_requests
        # The speculative shape and, adaptive, every shape a step may run.
        self._init_spec(target, draft, spec, context_length)
        self._init_shapes(adaptive, adaptive_shapes, catch_up_tokens)
        self._init_feature()
        # Slots, KV pools, the draft's carried state, the prefix cache, the split roles' metadata.
        self._init_kv(max_total_tokens, prefill_chunk_tokens, _kv_dtype(kv_cache_dtype, plan), prefix_cache,
                      catch_up_tokens if adaptive else 0)
        self._init_split_role(plan, self._dtype)
        # Model calls and their CUDA graphs, per shape; the decode steps by row.
        graph_mode = self._init_calls(graph_mode, cuda_graph_batch_sizes, fused_spec_step, plan)
        self._init_extend_graphs(extend_graphs, graph_mode)
        self.policy = None
        if adaptive:
            self._init_adaptive(catch_up_tokens, graph_mode, cuda_graph_batch_sizes, fused_spec_step)
        self._init_rows(adaptive, graph_mode, cuda_graph_batch_sizes, fused_spec_step)
        # Overlap and launch-ahead, requests, sampling; then the policy, from steps timed now.
        self._init_decode(overlap, cuda_graph_batch_sizes)
        self._init_requests()
        self._init_sampling(seed)
        if adaptive:
            self._init_policy(graph_mode, cuda_graph_batch_sizes, step_costs_s, policy_options)

    # ---- the steps of __init__ ---------------------------------------------------------------

    def _init_spec(self, target: TargetModel, draft: DraftHead | None, spec: SpecSettings | None,
                   context_length: int | None) -> None:
        """The models, the algorithm they agree on, and the configured shape (checked by
        SpecShape.validate, the plan's and the CRD's bounds)."""
        spec = spec or SpecSettings("NONE")
        algorithm = getattr(spec, "algorithm", "NONE")
        if (draft is None) != (algorithm == "NONE"):
            raise ValueError(f"algorithm {algorithm!r} and draft head {type(draft).__name__} disagree")
        if draft is not None and draft.algorithm != algorithm:
            raise ValueError(f"draft head is {draft.algorithm}, settings say {algorithm}")
        self.target, self.draft, self.spec = target, draft, spec
        self.context_length = context_length or target.cfg.max_position_embeddings
        configured = NONE
        if draft is not None:
            configured = SpecShape(spec.num_steps, spec.topk, spec.num_draft_tokens)
            configured.validate()
        self.num_steps = configured.num_steps
        self.topk, self.num_draft_tokens = configured.topk, configured.num_draft_tokens
        # Under tensor parallelism every rank must decode in the same shape, and each rank's
        # policy times its own steps: `agree_shape(shape) -> shape` makes them agree (rank 0's
        # choice, broadcast; engine/runtime/distributed.py). None: this runner decides alone.
        self.agree_shape = None
        self.spec_shape = configured      # the shape of the last decode step
        self.decoded_shape: SpecShape | None = None   # that of this step's, None if it decoded nothing

    def _init_feature(self) -> None:
        """The target's feature output, what the draft consumes; its width must be the draft's input."""
        target, draft = self.target, self.draft
        if draft is None:
            return
        target.set_feature(_FEATURE_KIND[draft.algorithm], target.aux_layers or None)
        # What this runner's draft consumes; re-applied each step in case another user of
        # the same target (a second runner, a training loop) switched it meanwhile.
        self._feature = (target.feature_kind, target.aux_layers)
        if target.feature_size != draft.input_size:
            raise ValueError(f"target feature width {target.feature_size} != draft input "
                             f"width {draft.input_size}")

    def _init_kv(self, max_total_tokens: int, prefill_chunk_tokens: int, kv_cache_dtype: torch.dtype | None,
                 prefix_cache: bool, lagging_tokens: int) -> None:
        """The slot table, both KV pools (as each family lays its KV out: models/protocol.py),
        the prefix cache and the draft's carried state. lagging_tokens: how far the draft may
        fall behind a request (adaptive plain steps)."""
        target, draft, m = self.target, self.draft, self.max_running_requests
        # The pad slot is extra: max_total_tokens usable slots.
        num_slots = max_total_tokens + 1
        self._dtype = dtype = target.embed_tokens.weight.dtype
        # K/V in the model dtype, or e4m3 codes
        kv_dtype = kv_cache_dtype or dtype
        # Under tensor parallelism each rank's pools hold its KV heads only (target.tp_rank/size).
        tp = (target.tp_rank, target.tp_size)
        if prefill_chunk_tokens < 1:
            raise ValueError(f"prefill_chunk_tokens must be >= 1, got {prefill_chunk_tokens}")
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self.table = SlotTable(num_slots, m, self.context_length, self.device)
        own_pools = target.kv_layout == OWN_POOLS
        if own_pools and kv_dtype != dtype:
            raise ValueError(f"an {kv_dtype} KV cache is not supported for {type(target).__name__} targets yet")
        # Pools of a family's own are sized for the slots one step may hold: a prefill chunk, or
        # every request's tree and scratch.
        in_flight = max(prefill_chunk_tokens, m * self.slots_needed(0, 0))
        if own_pools:
            # DeepSeek-V4 (engine/memory/compressed_kv.py) keeps a request's recent tokens and
            # compressed entries in pools of its own, trimmed as tokens are committed: a finished
            # request's slots cannot be reused by another. (Between servers the kept rows move:
            # staged_kv; a draft that lags behind adaptive plain steps trims as it runs: `lags`.)
            if prefix_cache:
                raise ValueError(f"the prefix cache is not supported for {type(target).__name__} targets yet")
            self.target_kv = target.make_kv(num_slots, max_total_tokens, m, in_flight, dtype, self.device)
            self.table.listeners.append(self.target_kv)
        else:
            tc = target.cfg
            self.target_kv = KVPool(tc.num_layers, num_slots, tc.num_kv_heads, tc.head_dim, kv_dtype, self.device,
                                    *tp)
        # With a draft a slot's draft K/V also depends on the next token: bigram keys.
        self.prefix_cache = (PrefixCache(self.table, lookahead=int(draft is not None))
                             if prefix_cache else None)
        self.draft_kv = None
        if draft is None:
            return
        if draft.kv_layout == OWN_POOLS:
            # Adaptive plain steps leave the draft behind: its rows trim as it catches up, so
            # each request may hold lagging_tokens more of them (rows the plan does not count).
            self.draft_kv = draft.make_kv(num_slots, max_total_tokens, m, in_flight + m * lagging_tokens,
                                          dtype, self.device)
            self.draft_kv.lags = lagging_tokens > 0
            self.table.listeners.append(self.draft_kv)
        else:
            dc = draft.cfg
            self.draft_kv = KVPool(draft.num_kv_layers(), num_slots, dc.num_kv_heads, dc.head_dim,
                                   kv_dtype, self.device, *tp)
        # [max_running_requests + 1, carried width]: the draft state after each request's
        # root (the last row is the padding row's, rows.py).
        self.draft_hidden = torch.zeros(m + 1, draft.carried_size, dtype=dtype, device=self.device)

    def _init_calls(self, graph_mode: str | None, cuda_graph_batch_sizes, fused_spec_step: bool, plan) -> str:
        """The configured shape's model calls, graphed unless graph_mode is "off"; -> graph_mode."""
        self.calls = ModelCalls(self.target, self.draft, self.target_kv, self.draft_kv, self.num_steps,
                                self.topk, self.num_draft_tokens)
        if graph_mode is None:
            graph_mode = "capture" if self.device.type == "cuda" and cuda_graph_batch_sizes else "off"
        if graph_mode not in ("capture", "padded", "off"):
            raise ValueError(f"graph_mode {graph_mode!r}: use 'capture', 'padded' or 'off'")
        if graph_mode != "off":
            if not cuda_graph_batch_sizes:
                raise ValueError(f"graph_mode {graph_mode!r} needs cuda_graph_batch_sizes (or a plan)")
            from specdeploy.engine.runtime.graphs import GraphedCalls
            self.calls = GraphedCalls(self.calls, cuda_graph_batch_sizes, self.context_length,
                                      capture=graph_mode == "capture", fused=fused_spec_step,
                                      step_graphs=False)
            if plan is not None and self.draft is not None:
                _check_buffers_against_plan(self.calls.buffer_shapes(), plan.buffers)
        # The calls of every shape this runner may run, the configured one's being self.calls.
        self._calls = {self.spec_shape: self.calls}
        return graph_mode

    def _init_extend_graphs(self, extend_graphs: bool, graph_mode: str) -> None:
        """Graphs of short one-request prefill chunks (extend_graphs.py), where they apply."""
        self.extend_graphs = None
        self.use_extend_graphs = False
        if not extend_graphs or graph_mode == "off" or self.role == "prefill" or self.target.tp_size > 1:
            return
        if self.target.kv_layout == OWN_POOLS or (self.draft is not None and self.draft.kv_layout == OWN_POOLS):
            return
        from specdeploy.engine.runtime.extend_graphs import ExtendGraphs
        calls = ModelCalls(self.target, self.draft, self.target_kv, self.draft_kv, self.num_steps,
                           self.topk, self.num_draft_tokens)
        self.extend_graphs = ExtendGraphs(calls, self.context_length, capture=graph_mode == "capture")
        self.use_extend_graphs = True

    def _init_rows(self, adaptive: bool, graph_mode: str, cuda_graph_batch_sizes, fused_spec_step: bool) -> None:
        """The decode steps by request row (rows.py), one per shape, their graphs in one pool."""
        self.rows = RowState(self.table, self.draft_hidden if self.draft is not None else None,
                             (self._catch_up_ids, self._catch_up_feature, self._catch_up_count)
                             if adaptive else None)
        self._row_steps: dict[SpecShape, RowSteps] = {}
        pool = None
        for sh, calls in self._calls.items():
            kind = "plain" if self.draft is None else "feature" if sh.is_none else "spec"
            pool = getattr(calls, "pool", None) or pool
            self._row_steps[sh] = steps = RowSteps(
                calls, self.rows, kind, sh, graph_mode, cuda_graph_batch_sizes or (), self.context_length,
                fused_spec_step, pool)
            pool = steps.pool

    # ---- one iteration -----------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> list[StepOutput]:
        if self.draft is not None and (self.target.feature_kind, self.target.aux_layers) != self._feature:
            self.target.set_feature(*self._feature)
        if self._stashed:  # a step collected by a call that then failed: its outputs first
            outs, self._stashed = self._stashed, []
            return outs
        decoding = list(self._running.values())
        outputs: dict[str, StepOutput] = {}
        self.decoded_shape = None
        try:
            if self._pending:
                for out in self._prefill(self._prefill_batch()):
                    outputs[out.req_id] = out
            if decoding:
                if self.policy is not None:
                    outs = self._adaptive_decode(decoding)
                elif self.draft is not None:
                    outs = self._decode(decoding, self.spec_shape)
                else:
                    outs = self._decode(decoding, NONE)
                self.decoded_shape = self.spec_shape
                for out in outs:
                    outputs[out.req_id] = out
        except BaseException:
            # A failed forward (e.g. out of memory) leaves every request as it was before the
            # failed phase: retrying or aborting it is exact and no slot is lost.
            self._undo_step()
            raise
        return list(outputs.values())

    def _take_slots(self, n: int) -> torch.Tensor:
        slots = self._alloc(n)
        self._step_slots.append(slots)
        return slots

    def _commit_step(self) -> None:
        """The phase's slots now belong to requests (or were freed by it): nothing to undo."""
        self._step_slots.clear()
        self._step_entries.clear()
        self._step_rows.clear()

    def _undo_step(self) -> None:
        self._drop_ahead()
        if self._current is not None:  # launched, its output never read: nothing committed
            self.table.free(self._current.slots)
            self._current = None
        for slots in self._step_slots:
            self.table.free(slots)
        for row, start, end in self._step_entries:
            self.table.req_to_slot[row, start:end] = PAD_SLOT
        for seq in self._step_rows:  # no committed tokens yet: the row goes back empty
            self.table.free_row(seq.row, 0)
            seq.row = -1
        self._commit_step()

    # ---- prefill -----------------------------------------------------------------------------

    def _prefill_batch(self) -> list[tuple[Seq, int]]:
        """(request, tokens to prefill now) in arrival order, as many as fit one chunk of
        prefill_chunk_tokens padded tokens (B x longest piece); a longer prompt is cut."""
        budget, chosen, q = self.prefill_chunk_tokens, [], 0
        for seq in self._pending:
            if seq.row < 0:
                self._match_prefix(seq)
                if self._defer_for_cache(seq, chosen):
                    continue
            take = min(len(seq.req.prompt_ids) - seq.length, budget)
            if chosen and (len(chosen) + 1) * max(q, take) > budget:
                break
            chosen.append((seq, take))
            q = max(q, take)
        return chosen

    def _prefill(self, chosen: list[tuple[Seq, int]]) -> list[StepOutput]:
        """One chunk: each chosen request's next `take` prompt tokens, after its earlier chunks
        (the prefix). A request whose prompt ends here samples its first token and starts
        running; the others stay pending with their prefix written."""
        dev = self.device
        b, q = len(chosen), max(take for _, take in chosen)
        tokens = torch.zeros(b, q, dtype=torch.int64, device=dev)
        shifted = torch.zeros(b, q, dtype=torch.int64, device=dev)        # token after each entry
        slots = torch.full((b, q), PAD_SLOT, dtype=torch.int64, device=dev)
        starts = torch.tensor([seq.length for seq, _ in chosen], device=dev)
        takes = torch.tensor([take for _, take in chosen], device=dev)
        for i, (seq, take) in enumerate(chosen):
            if seq.row < 0:
                seq.row = self.table.alloc_row()
                self._step_rows.append(seq)
                seq.num_cached_tokens = seq.length
                if seq.length:  # a prefix cache hit: the tree's slots, locked for this request
                    self.table.req_to_slot[seq.row, :seq.length] = seq.matched_slots
            start, prompt = seq.length, seq.req.prompt_ids
            tokens[i, :take] = torch.tensor(prompt[start:start + take], device=dev)
            # The last prompt entry pairs with the first sampled token, filled in below.
            nxt = prompt[start + 1:start + take + 1]
            shifted[i, :len(nxt)] = torch.tensor(nxt, dtype=torch.int64, device=dev)
            slots[i, :take] = self._take_slots(take)
            self.table.req_to_slot[seq.row, start:start + take] = slots[i, :take]
            self._step_entries.append((seq.row, start, start + take))
        rows = torch.tensor([seq.row for seq, _ in chosen], device=dev)
        prefix = self.table.req_to_slot[rows, :max(seq.length for seq, _ in chosen)]
        positions = starts[:, None] + torch.arange(q, device=dev)
        positions = torch.where(torch.arange(q, device=dev) < takes[:, None], positions, 0)
        done = [i for i, (seq, take) in enumerate(chosen) if seq.length + take == len(seq.req.prompt_ids)]
        graphs = self.extend_graphs if self._graphed_chunk(chosen, q) else None
        if graphs is not None:  # one request, a short chunk: replayed (extend_graphs.py)
            last_logits = graphs.target(tokens, positions, slots, prefix, starts, takes)
        else:
            batch = causal_batch(slots, takes, prefix, starts)
            out = self.target(tokens, positions, batch, self.target_kv)
            self._prompt_logprobs(chosen, out.hidden)
        finished = [chosen[i][0] for i in done]
        first = first_lps = None
        if done:
            idx = torch.tensor(done, device=dev)
            logits = last_logits if graphs is not None else self.target.logits(out.hidden[idx, takes[idx] - 1])
            process = self._step_logits(finished)
            first = self._sample(finished, process.plain(logits) if process else logits)
            if process is not None and process.wants_logprobs:
                first_lps = process.logprobs(logits[:, None], first[:, None])
            shifted[idx, takes[idx] - 1] = first
            if self.role == "prefill":
                lp = torch.log_softmax(logits.float(), -1).gather(1, first[:, None])[:, 0]
                self.metadata.fixed["output_token_logprob"][rows[idx].cpu()] = lp.cpu()
        if self.draft is not None:
            if graphs is not None:
                hidden = graphs.draft(shifted)
            else:
                hidden = self.calls.draft_extend(shifted, out.feature, positions, slots, prefix, starts, takes)
            if done:
                self.draft_hidden[rows[idx]] = hidden[idx]
                if self.policy is not None:
                    self._catch_up_count[rows[idx]] = 0
        for seq, take in chosen:
            self.table.commit(seq.row, seq.length, seq.length + take)
            seq.length += take
        self._commit_step()
        for seq in finished:
            self._pending.remove(seq)
            self._running[seq.req.id] = seq
        outputs = self._emit(finished, [[t] for t in first.tolist()], [0] * len(finished),
                             logprobs=first_lps) if done else []
        for out, seq in zip(outputs, finished):
            out.num_cached_tokens = seq.num_cached_tokens
            out.prompt_logprobs = seq.prompt_lps
        started = [seq for seq in finished if seq.req.id in self._running]
        if started:
            self.rows.start([s.row for s in started], [s.length for s in started], [s.root for s in started])
        if self.prefix_cache is not None:
            for seq, _ in chosen:
                if seq.row >= 0:  # not released (running, pending, or held for export)
                    self._cache_prefix(seq)
        return outputs

    def _graphed_chunk(self, chosen: list[tuple[Seq, int]], q: int) -> bool:
        """Whether this prefill chunk replays the extend graphs: one request, no prompt
        log-probabilities (they read every entry's hidden state), a bucket that holds it."""
        graphs = self.extend_graphs
        return (graphs is not None and self.use_extend_graphs and len(chosen) == 1
                and chosen[0][0].prompt_lps is None and graphs.bucket(q) is not None)

    def _prompt_logprobs(self, chosen: list[tuple[Seq, int]], hidden: torch.Tensor) -> None:
        """Gather the log-probability of each prompt token after the first (from the logits at
        the position before it) for the chunk's requests that asked (echo with logprobs)."""
        for i, (seq, take) in enumerate(chosen):
            if seq.prompt_lps is None:
                continue
            prompt, start = seq.req.prompt_ids, seq.length
            n = min(take, len(prompt) - 1 - start)  # the last prompt position predicts the output
            if n <= 0:
                continue
            nxt = torch.tensor(prompt[start + 1:start + 1 + n], dtype=torch.int64, device=self.device)
            k = seq.req.controls.prompt_logprobs
            # In pieces: a chunk's positions x a large vocabulary of float32 logits at once is GBs.
            for at in range(0, n, _PROMPT_LOGPROBS_ROWS):
                end = min(n, at + _PROMPT_LOGPROBS_ROWS)
                lp, ids, tops = top_logprobs(self.target.logits(hidden[i, at:end]), nxt[at:end], k)
                seq.prompt_lps += [(a, list(zip(b, c))) for a, b, c in zip(lp.tolist(), ids.tolist(), tops.tolist())]


    def _emit(self, seqs, emitted: list[list[int]], accepted: list[int],
              num_draft_tokens: int = 0, logprobs: list | None = None) -> list[StepOutput]:
        outputs = []
        for i, (s, tokens, acc) in enumerate(zip(seqs, emitted, accepted)):
            s.tokens += tokens  # all committed (+ the root), for the prefix cache's keys
            kept, reason = [], None
            for t in tokens:
                kept.append(t)
                s.num_generated += 1
                if t in s.req.stop_token_ids:
                    reason = "stop"
                elif s.num_generated >= s.req.max_tokens:
                    reason = "length"
                if reason:
                    break
            s.root = kept[-1]
            controls = s.req.controls
            if controls is not None and controls.grammar is not None:
                controls.grammar.accept(kept)
            if reason:
                self._release(s, hold=self.role == "prefill")
            lps = logprobs[i] if logprobs is not None else None
            outputs.append(StepOutput(s.req.id, kept, acc, reason is not None, reason,
                                      num_draft_tokens=num_draft_tokens,
                                      logprobs=lps[:len(kept)] if lps is not None else None))
        return outputs


def _check_role(role: str, plan, launch_ahead: bool, adaptive: bool) -> None:
    if role not in SERVER_ROLES:
        raise ValueError(f"role {role!r}: use one of {', '.join(SERVER_ROLES)}")
    if role != "both" and plan is None:
        raise ValueError(f"role {role!r} needs a plan (its disaggregation metadata buffer)")
    if launch_ahead and adaptive:
        raise ValueError("launch_ahead: not with adaptive speculation (its policy sees each step "
                         "before choosing the next)")


def _kv_dtype(kv_cache_dtype: torch.dtype | None, plan) -> torch.dtype | None:
    """kv_cache_dtype, or e4m3 where the plan's is "fp8_e4m3"; None: the model's dtype."""
    if kv_cache_dtype is None and plan is not None and plan.target.kv_cache_dtype == "fp8_e4m3":
        return torch.float8_e4m3fn
    return kv_cache_dtype


def _check_buffers_against_plan(allocated: dict, planned) -> None:
    """The engine allocates the plan's static buffers exactly; any difference is a bug in one of
    them (e.g. a buffer sized with hidden_size where spec_hidden_size is meant)."""
    for name, shape in allocated.items():
        want = tuple(getattr(planned, name))
        if shape != want:
            raise ValueError(f"{name}: allocated {shape}, the plan says {want}")

