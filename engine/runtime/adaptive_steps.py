"""The Runner's side of adaptive speculation (`adaptive=True`): one set of model calls (and CUDA
graphs, in one shared pool) per candidate shape of speculative/adaptive.py, the policy asked each
step which one to run for the current batch size, from the step costs measured here at start-up
and the acceptance the steps report back, and the draft's catch-up.

The NONE shape is a plain target decode that also returns the target's feature: the draft is not
run, the (next token, feature) entry it would have consumed is kept in a per-request buffer of
`catch_up_tokens` entries, and the draft runs over them all at once when the buffer is full or
before the request's next speculative step ("catch-up": one draft forward per catch_up_tokens
plain steps instead of one each). After a catch-up the draft's KV and carried hidden state are
exactly what a draft extend after every token would have left, so a request may change shape on
any step.

`Adaptive` is a part of `Runner` (runner.py), over the runner's state: the model calls per shape
(`_calls`, `_row_steps`), the slot table, `draft_hidden` and the running requests' `pending`.
"""

from __future__ import annotations

import time

import torch

from specdeploy.engine.planner.plan import PlanError, SpecShape
from specdeploy.engine.runtime.calls import ModelCalls
from specdeploy.engine.memory.kv import PAD_SLOT
from specdeploy.engine.runtime.request import Seq, StepOutput
from specdeploy.engine.speculative.adaptive import NONE, AdaptivePolicy, candidate_shapes


class Adaptive:
    def _init_shapes(self, adaptive: bool, adaptive_shapes: list[SpecShape] | None,
                     catch_up_tokens: int) -> None:
        """The shapes a decode step may run: the configured one, or (adaptive) the candidates
        with NONE among them, each checked; and the most any looks ahead and takes as scratch
        (admission reserves for it)."""
        self.shapes = [self.spec_shape]
        if adaptive:
            if self.draft is None:
                raise ValueError("adaptive speculation needs a draft head")
            self.shapes = sorted(set(adaptive_shapes or candidate_shapes(
                self.num_steps, self.topk, self.num_draft_tokens)))
            if NONE not in self.shapes:
                self.shapes.insert(0, NONE)
            for sh in self.shapes:
                if not sh.is_none:
                    try:
                        sh.validate()
                    except PlanError as e:
                        raise ValueError(f"adaptive shape {sh.label}: not a valid (steps, topk, draft "
                                         f"tokens): {e}") from None
            if catch_up_tokens < 1:
                raise ValueError(f"catch_up_tokens must be >= 1, got {catch_up_tokens}")
        self._max_steps = max(sh.num_steps for sh in self.shapes)
        self._max_scratch = max(max(sh.num_steps - 1, 0) * sh.topk + sh.num_draft_tokens
                                for sh in self.shapes)

    def _init_adaptive(self, catch_up_tokens: int, graph_mode: str, cuda_graph_batch_sizes,
                       fused_spec_step: bool) -> None:
        """The model calls of every other candidate shape (their graphs in the configured
        calls' pool), eager calls for catch-ups, and the catch-up buffers."""
        from specdeploy.engine.runtime.graphs import GraphedCalls

        target, draft, m = self.target, self.draft, self.max_running_requests
        self._eager_calls = ModelCalls(target, draft, self.target_kv, self.draft_kv, 0, 1, 1)
        pool = getattr(self.calls, "pool", None)
        for sh in self.shapes:
            if sh in self._calls:
                continue
            calls = ModelCalls(target, draft, self.target_kv, self.draft_kv, *_fields(sh))
            if graph_mode != "off":
                calls = GraphedCalls(calls, cuda_graph_batch_sizes, self.context_length,
                                     capture=graph_mode == "capture", fused=fused_spec_step, pool=pool,
                                     step_graphs=False)
                pool = calls.pool
            self._calls[sh] = calls
        self.catch_up_tokens = catch_up_tokens
        dtype = self.draft_hidden.dtype
        # [max_running_requests + 1, catch_up_tokens(, Hin)]: per row the (next token, target
        # feature) entries of its plain steps since the draft last ran, and how many.
        self._catch_up_ids = torch.zeros(m + 1, catch_up_tokens, dtype=torch.int64, device=self.device)
        self._catch_up_feature = torch.zeros(m + 1, catch_up_tokens, target.feature_size, dtype=dtype,
                                             device=self.device)
        self._catch_up_count = torch.zeros(m + 1, dtype=torch.int64, device=self.device)

    def _init_policy(self, graph_mode: str, cuda_graph_batch_sizes, step_costs_s: dict | None,
                     policy_options: dict | None) -> None:
        """The policy, from step costs given or measured now (every call and graph is ready)."""
        buckets = sorted(cuda_graph_batch_sizes) if graph_mode != "off" \
            else _default_buckets(self.max_running_requests)
        costs = step_costs_s if step_costs_s is not None else self.measure_step_costs(buckets)
        self.policy = AdaptivePolicy(self.shapes, costs, **(policy_options or {}))

    def _adaptive_decode(self, seqs: list[Seq]) -> list[StepOutput]:
        """One decode step in the shape the policy chooses for this batch size; what it took
        and accepted goes back to the policy."""
        shape = self.policy.choose(len(seqs))
        if self.agree_shape is not None:
            shape = self.agree_shape(shape)
        t0 = time.perf_counter()
        if shape.is_none:
            self._catch_up([s for s in seqs if s.pending >= self.catch_up_tokens])
            outs = self._decode(seqs, shape)
        else:
            self._catch_up([s for s in seqs if s.pending])
            outs = self._decode(seqs, shape)
        self.policy.observe_time(shape, len(seqs), time.perf_counter() - t0)
        self.policy.observe(shape, [o.num_accepted_drafts for o in outs])
        self.spec_shape = shape
        return outs

    def _catch_up(self, seqs: list[Seq]) -> None:
        """The draft runs over the entries its requests' plain steps left (one draft extend of
        catch_up_tokens columns, each row its own count): afterwards its KV and carried hidden
        state are as if it had run after every token. Changes nothing a retry would not redo."""
        if not seqs:
            return
        dev, d = self.device, self.catch_up_tokens
        meta = torch.tensor([[s.row for s in seqs], [s.pending for s in seqs],
                             [s.length - s.pending for s in seqs]], dtype=torch.int64).to(dev)
        rows, count, start = meta[0], meta[1], meta[2]
        cols = torch.arange(d, device=dev)
        valid = cols < count[:, None]                                        # [b, D]
        at = (start[:, None] + cols).clamp(max=self.table.req_to_slot.shape[1] - 1)
        out_slots = torch.where(valid, self.table.req_to_slot[rows[:, None], at], PAD_SLOT)
        positions = torch.where(valid, start[:, None] + cols, 0)
        prefix = self.table.req_to_slot[rows, :max(s.length - s.pending for s in seqs)]
        hidden = self._eager_calls.draft_extend(self._catch_up_ids[rows], self._catch_up_feature[rows],
                                                positions, out_slots, prefix, start, count)
        self.draft_hidden[rows] = hidden
        self._catch_up_count[rows] = 0
        for s in seqs:
            if self.table.listeners:
                self.table.caught_up(s.row, s.length - s.pending, s.length)
            s.pending = 0

    @torch.inference_mode()
    def measure_step_costs(self, buckets: list[int], reps: int = 3) -> dict[tuple[SpecShape, int], float]:
        """Seconds per decode step of every shape at every bucket, timed on padded inputs with
        empty prefixes (every row the padding row; graph replays where captured, eager calls
        otherwise; the median of `reps` after one warm-up). NONE includes 1 / catch_up_tokens
        of a catch-up."""
        dev = self.device
        costs = {}

        def timed(fn) -> float:
            fn()
            times = []
            for _ in range(reps):
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)
                t0 = time.perf_counter()
                fn()
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)
                times.append(time.perf_counter() - t0)
            return sorted(times)[len(times) // 2]

        def zeros(*shape, value=0, dtype=torch.int64):
            return torch.full(shape, value, dtype=dtype, device=dev)

        hin = self.target.feature_size
        act = self.draft_hidden.dtype
        for b in buckets:
            prefix, lens = zeros(b, 1, value=PAD_SLOT), zeros(b)
            greedy = self._greedy_params(b)
            for sh in self.shapes:
                steps = self._row_steps[sh]
                # Every row the padding row: empty prefixes, every write to the pad slot.
                host = torch.full((steps.bucket(b) or b, steps.width), PAD_SLOT, dtype=torch.int64)
                host[:, 0] = self.table.pad_row
                packed = steps.upload(host, b)
                if sh.is_none:
                    d = self.catch_up_tokens
                    decode = timed(lambda: steps.run(packed, b, 1))
                    catch_up = timed(lambda: self._eager_calls.draft_extend(
                        zeros(b, d), zeros(b, d, hin, dtype=act), zeros(b, d), zeros(b, d, value=PAD_SLOT),
                        prefix, lens, zeros(b, value=d)))
                    costs[(sh, b)] = decode + catch_up / d
                    continue
                s, _, n = _fields(sh)
                costs[(sh, b)] = timed(lambda: steps.run(packed, b, 1, False, greedy,
                                                         self._greedy_uniforms[:b, :n + 1 + s]))
        return costs


def _fields(shape: SpecShape) -> tuple[int, int, int]:
    return shape.num_steps, shape.topk, shape.num_draft_tokens


def _default_buckets(max_bs: int) -> list[int]:
    """Batch sizes to measure step costs at when nothing is captured: powers of two and max_bs."""
    sizes, b = [], 1
    while b < max_bs:
        sizes.append(b)
        b *= 2
    return sizes + [max_bs]
