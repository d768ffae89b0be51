"""CUDA graphs for short prefill chunks of one request: the target's forward and the draft's
extend over at most EXTEND_GRAPH_TOKENS[-1] tokens.

A prefix-cache hit leaves a short remainder of the prompt (the question after a cached system
prompt); run eagerly, its forwards pay a kernel launch per op (tens of ms at the 8B shape). Here
one graph per token-count bucket replays them instead:

    target  tokens, positions, out_slots [1, q]; prefix_slots [1, context_length]; starts,
            takes [1] -> logits of the last valid entry [1, V]; the feature of every entry
            written to a static buffer [1, q_max, Hin] (the draft graph's input)
    draft   the shifted tokens (the token after each entry, the first sampled one last) over
            the same positions, slots and prefix -> the draft state after the last valid
            entry [1, Hc]

A chunk of `take` tokens is padded to the smallest bucket q >= take: token 0, position 0, the pad
slot (entries past `take` are masked off by `takes`, as the eager prefill pads a batch's shorter
rows), and the prefix table's columns past the request's prefix hold the pad slot. A chunk above
the largest bucket, or a batch of more than one request, runs eagerly (runner.py).

With capture=False nothing is captured and each call runs the graph body eagerly on the padded
static buffers: the same code on CPU, which is how the padding is tested without a GPU.
"""

from __future__ import annotations

import gc
import logging
import time

import torch

from specdeploy.engine.memory.kv import PAD_SLOT
from specdeploy.engine.models.attention import causal_batch
from specdeploy.engine.planner.plan import EXTEND_GRAPH_TOKENS
from specdeploy.engine.runtime.calls import ModelCalls

log = logging.getLogger("specdeploy.engine.runtime.extend_graphs")


def extend_bucket(take: int, buckets: tuple[int, ...] = EXTEND_GRAPH_TOKENS) -> int | None:
    """The smallest bucket holding `take` tokens; None when none does (eager)."""
    if take < 1:
        raise ValueError(f"a prefill chunk has at least one token, got {take}")
    return next((q for q in sorted(buckets) if q >= take), None)


class ExtendGraphs:
    def __init__(self, calls: ModelCalls, context_length: int, buckets: tuple[int, ...] = EXTEND_GRAPH_TOKENS,
                 capture: bool = True):
        if not buckets or min(buckets) < 1:
            raise ValueError(f"extend graph buckets must be positive token counts, got {buckets}")
        self.calls, self.buckets = calls, tuple(sorted(set(buckets)))
        self.context_length = context_length
        target, draft = calls.target, calls.draft
        dev = target.embed_tokens.weight.device
        dtype = target.embed_tokens.weight.dtype
        qmax = self.buckets[-1]
        i64 = dict(dtype=torch.int64, device=dev)
        self.tokens = torch.zeros(1, qmax, **i64)
        self.shifted = torch.zeros(1, qmax, **i64)
        self.positions = torch.zeros(1, qmax, **i64)
        self.slots = torch.full((1, qmax), PAD_SLOT, **i64)
        self.prefix = torch.full((1, context_length), PAD_SLOT, **i64)
        self.starts = torch.zeros(1, **i64)
        self.takes = torch.ones(1, **i64)
        self.feature = (torch.zeros(1, qmax, target.feature_size, dtype=dtype, device=dev)
                        if draft is not None else None)
        self.target_graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.draft_graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.replays = 0          # chunks served by a replay (or, uncaptured, by the padded body)
        self.capture_bytes = 0    # what the allocator reserved during the captures
        self.pool = None
        if capture:
            self._capture()

    # Graph bodies: fixed shapes, static buffers only.

    def _target_body(self, q: int) -> torch.Tensor:
        calls = self.calls
        batch = causal_batch(self.slots[:, :q], self.takes, self.prefix, self.starts)
        out = calls.target(self.tokens[:, :q], self.positions[:, :q], batch, calls.target_kv)
        last = out.hidden[torch.arange(1, device=self.takes.device), self.takes - 1]   # [1, H]
        if self.feature is not None:
            self.feature[:, :q].copy_(out.feature)
        return calls.target.logits(last)

    def _draft_body(self, q: int) -> torch.Tensor:
        return self.calls.draft_extend(self.shifted[:, :q], self.feature[:, :q], self.positions[:, :q],
                                       self.slots[:, :q], self.prefix, self.starts, self.takes)

    @torch.no_grad()
    def _capture(self) -> None:
        stream = torch.cuda.Stream()
        t_all = time.perf_counter()
        reserved = torch.cuda.memory_reserved()
        bodies = [(self.target_graphs, self._target_body)]
        if self.feature is not None:
            bodies.append((self.draft_graphs, self._draft_body))
        for q in reversed(self.buckets):  # largest first: the smaller reuse its pool
            for graphs, body in bodies:
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    for _ in range(2):  # warm-up (lazy inits, autotuning) outside the graph
                        body(q)
                torch.cuda.current_stream().wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                gc.collect()
                torch.cuda.synchronize()
                gc.disable()
                try:
                    with torch.cuda.graph(graph, pool=self.pool, stream=stream):
                        out = body(q)
                finally:
                    gc.enable()
                graphs[q] = (graph, out)
                self.pool = graph.pool()
        self.capture_bytes = torch.cuda.memory_reserved() - reserved
        log.info("cuda graphs prefill chunk: %d token counts (%d..%d) captured in %.1f s, pool +%.0f MiB",
                 len(self.buckets), self.buckets[0], self.buckets[-1], time.perf_counter() - t_all,
                 self.capture_bytes / 2**20)

    # Calls.

    def bucket(self, take: int) -> int | None:
        return extend_bucket(take, self.buckets)

    def target(self, tokens, positions, slots, prefix, starts, takes) -> torch.Tensor:
        """One request's chunk (tokens, positions, slots [1, take]; prefix [1, Kp <= context];
        starts, takes [1]) -> logits of its last entry [1, V] (float32). The inputs stay in the
        static buffers for `draft`."""
        take = tokens.shape[1]
        q = self.bucket(take)
        if q is None or tokens.shape[0] != 1:
            raise ValueError(f"a graphed prefill chunk is one request of at most {self.buckets[-1]} "
                             f"tokens, got {tuple(tokens.shape)}")
        kp = prefix.shape[1]
        if kp > self.context_length:
            raise ValueError(f"prefix of {kp} slots exceeds the context length {self.context_length}")
        self.tokens[:, :take].copy_(tokens)
        self.tokens[:, take:q].zero_()
        self.positions[:, :take].copy_(positions)
        self.positions[:, take:q].zero_()
        self.slots[:, :take].copy_(slots)
        self.slots[:, take:q].fill_(PAD_SLOT)
        self.prefix[:, :kp].copy_(prefix)
        self.prefix[:, kp:].fill_(PAD_SLOT)
        self.starts.copy_(starts)
        self.takes.copy_(takes)
        self._q = q
        self.replays += 1
        if q in self.target_graphs:
            graph, out = self.target_graphs[q]
            graph.replay()
            return out
        return self._target_body(q)

    def draft(self, shifted: torch.Tensor) -> torch.Tensor:
        """After `target` on the same chunk: the draft extend over it with the target's features;
        shifted [1, take] -> the draft state after its last entry [1, Hc]."""
        q, take = self._q, shifted.shape[1]
        self.shifted[:, :take].copy_(shifted)
        self.shifted[:, take:q].zero_()
        if q in self.draft_graphs:
            graph, out = self.draft_graphs[q]
            graph.replay()
            return out
        return self._draft_body(q)
