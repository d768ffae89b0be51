"""CUDA graphs for the decode loop: target decode and the speculative iteration.

A speculative iteration is captured whole by default (`fused`): draft multi-step, tree, target
verify, acceptance and draft extend replay as one graph per batch size, one for greedy and one
for sampling requests, so the host launches one graph and waits once per step. With
fused=False each model call is its own graph (draft multi-step, verify, extend) and the tree and
acceptance between them run eagerly: the phases can then be timed one by one.

`GraphedCalls` has the methods of `ModelCalls`. Every input lives in a static buffer allocated
once for the largest batch (`max_bs` rows; the prefix is `context_length` slots wide); a call
with b rows copies its inputs into the first b rows, pads rows b..bs of the smallest captured
bucket bs >= b with harmless values (pad slot, zero lengths, a self-only mask) and replays that
bucket's graph. Batches above the largest bucket run eagerly.

The hidden-state buffers are exactly the plan's (H_s = spec_hidden_size, H_in = draft input):
    draft multi-step input     [max_bs * topk,            H_s]   (`draft_hidden_states`)
    draft-extend input         [max_bs * (num_steps + 1), H_in]  (`draft_extend_hidden_states`)
    verify feature output      [max_bs * num_draft_tokens, H_in] (`verify_hidden_states`)

With `capture=False` nothing is captured and each call runs the eager function on the padded
static buffers: the same code path on CPU, which is how the padding is tested without a GPU.
"""

from __future__ import annotations

import gc
import logging
import time
from dataclasses import dataclass

import torch

from specdeploy.engine.runtime.calls import ModelCalls, speculate
from specdeploy.engine.memory.kv import PAD_SLOT

log = logging.getLogger("specdeploy.engine.runtime.graphs")


@dataclass
class _Input:
    buf: torch.Tensor                 # [max_bs, ...] static
    pad: torch.Tensor | float | int   # value for rows b..bs (and prefix columns beyond the data)


class _Graphed:
    """One call kind: static inputs, one graph per bucket, padded replay."""

    def __init__(self, fn, inputs: dict[str, _Input], buckets, capture: bool, stream, eager=None,
                 name: str = "call", pool=None):
        # `eager` serves batches above the largest bucket (fn may write static outputs sized
        # for max_bs); it defaults to fn.
        self.fn, self.inputs, self.buckets = fn, inputs, sorted(buckets)
        self.eager = eager or fn
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, tuple]] = {}
        # Bytes the allocator reserved during each bucket's capture: the private pool's growth.
        self.capture_bytes: dict[int, int] = {}
        self.pool = pool
        if capture:
            self._capture(stream, name)

    @torch.no_grad()
    def _capture(self, stream, name: str) -> None:
        """Warm up and capture every bucket, largest first. Without autograd: a module with a
        parameter that requires grad would otherwise make each graph's outputs keep the whole
        forward's intermediates alive in the private pool (graph_pool_probe.py shows it)."""
        pool = self.pool
        # One memory pool per call kind, shared by its buckets (largest captured first).
        # Kinds share one only when given it (`pool`): otherwise an output of one kind (e.g.
        # the chain proposals of the draft) may still be read after another kind has replayed.
        t_all = time.perf_counter()
        for i, bs in enumerate(reversed(self.buckets), 1):
            t0 = time.perf_counter()
            self._fill_padding(0, bs)
            stream.wait_stream(torch.cuda.current_stream())  # the padding writes above
            with torch.cuda.stream(stream):
                for _ in range(2):  # warm-up (lazy inits, autotuning) outside the graph
                    self.fn(**self._views(bs))
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            # A garbage collection inside the capture could destroy an unreachable older
            # graph, whose cudaFree would invalidate this capture; collect before, not during.
            gc.collect()
            torch.cuda.synchronize()
            torch.cuda.empty_cache()  # as torch.cuda.graph does on entry: the warm-ups' blocks go
            gc.disable()
            reserved = torch.cuda.memory_reserved()
            try:
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    out = self.fn(**self._views(bs))
            finally:
                gc.enable()
            self.graphs[bs] = (graph, out)
            self.capture_bytes[bs] = torch.cuda.memory_reserved() - reserved
            pool = self.pool = graph.pool()
            log.debug("cuda graph %s: batch %d captured (%d/%d) in %.0f ms, pool +%.1f MiB", name, bs, i,
                      len(self.buckets), 1e3 * (time.perf_counter() - t0), self.capture_bytes[bs] / 2**20)
        if self.buckets:
            log.info("cuda graphs %s: %d batch sizes (%d..%d) captured in %.1f s, pool +%.0f MiB", name,
                     len(self.buckets), self.buckets[0], self.buckets[-1], time.perf_counter() - t_all,
                     sum(self.capture_bytes.values()) / 2**20)

    def _views(self, bs: int) -> dict[str, torch.Tensor]:
        return {name: inp.buf[:bs] for name, inp in self.inputs.items()}

    def _fill_padding(self, b: int, bs: int, skip=()) -> None:
        for name, inp in self.inputs.items():
            if b < bs and name not in skip:
                rows = inp.buf[b:bs]
                rows.copy_(inp.pad.expand_as(rows)) if torch.is_tensor(inp.pad) else rows.fill_(inp.pad)

    def bucket(self, b: int) -> int | None:
        """The batch size whose graph serves b rows (None: above the largest, eager)."""
        return next((s for s in self.buckets if s >= b), None)

    def __call__(self, b: int, values: dict[str, torch.Tensor], padded=()):
        """padded: inputs the caller has already written, rows 0..bs of the bucket with their
        padding (a step's packed input, copied straight from pinned host memory)."""
        bs = self.bucket(b)
        if bs is None:
            return self.eager(**values)
        for name, value in values.items():
            buf = self.inputs[name].buf
            if value.shape[1:] == buf.shape[1:]:
                buf[:b].copy_(value)
            else:  # narrower prefix table: copy the data, pad the remaining columns
                buf[:b, :value.shape[1]].copy_(value)
                buf[:b, value.shape[1]:].fill_(PAD_SLOT)
        self._fill_padding(b, bs, padded)
        if bs in self.graphs:
            graph, out = self.graphs[bs]
            graph.replay()
        else:
            out = self.fn(**self._views(bs))
        return tuple(None if o is None else o[:b] for o in out)


class GraphedCalls:
    def __init__(self, calls: ModelCalls, batch_sizes, context_length: int, capture: bool = True,
                 fused: bool = True, pool=None, step_graphs: bool = True):
        """pool: a graph memory pool to capture into (the runner's shapes share one: only one
        of their graphs replays at a time and its outputs are consumed before the next);
        `self.pool` is the pool after capture. step_graphs=False captures no whole-step graph
        (target decode, the fused speculative step): the runner captures its own, addressed by
        request row (rows.py), around the eager calls and these static hidden-state buffers."""
        self.calls = calls
        self.pool = pool
        target, draft = calls.target, calls.draft
        dev = target.embed_tokens.weight.device
        dtype = target.embed_tokens.weight.dtype
        self.max_bs = max_bs = max(batch_sizes)
        steps, k = calls.num_steps, calls.topk
        i64 = dict(dtype=torch.int64, device=dev)

        def ints(*shape, pad=0):
            return _Input(torch.full((max_bs, *shape), pad, **i64), pad)

        def prefix():
            return {"prefix_slots": ints(context_length, pad=PAD_SLOT), "prefix_lens": ints()}

        self.fused = fused and draft is not None
        stream = torch.cuda.Stream() if capture else None
        step_sizes = batch_sizes if step_graphs else ()
        decode_inputs = {"ids": ints(1), "positions": ints(1), "out_slots": ints(1, pad=PAD_SLOT),
                         **prefix()}
        # Plain decode runs without a draft head, or as the NONE shape of an adaptive runner
        # (num_steps 0), which also returns the feature its draft catches up from.
        self.target_decode_graph = _Graphed(
            self._decode, decode_inputs, step_sizes if draft is None else (), capture, stream,
            name="target decode", pool=self.pool)
        self.pool = self.target_decode_graph.pool
        if draft is not None and calls.num_steps == 0:
            self.target_decode_feature_graph = _Graphed(
                calls.target_decode_feature, decode_inputs, step_sizes, capture, stream,
                name="target decode (with feature)", pool=self.pool)
            self.pool = self.target_decode_feature_graph.pool
            self.fused = False
            return
        if draft is None:
            return
        n = calls.num_draft_tokens
        hin, hc = target.feature_size, draft.carried_size
        eye = torch.eye(n, dtype=torch.bool, device=dev)
        # The plan's three hidden-state buffers, flat as the plan states them.
        self.draft_hidden_states = torch.zeros(max_bs * k, hc, dtype=dtype, device=dev)
        self.draft_extend_hidden_states = torch.zeros(max_bs * (steps + 1), hin, dtype=dtype, device=dev)
        self.verify_hidden_states = torch.zeros(max_bs * n, hin, dtype=dtype, device=dev)
        f32 = dict(dtype=torch.float32, device=dev)
        sampling_inputs = {
            "temperature": _Input(torch.zeros(max_bs, **f32), 0.0), "top_k": ints(),
            "top_p": _Input(torch.ones(max_bs, **f32), 1.0)}
        if fused:
            bodies = _Bodies(self)
            spec_inputs = {
                "roots": ints(), "lens": ints(), "prefix_slots": ints(context_length, pad=PAD_SLOT),
                "hidden": _Input(self.draft_hidden_states.view(max_bs, k, hc), 0.0),
                "scratch": ints((steps - 1) * k, pad=PAD_SLOT), "tree_slots": ints(n, pad=PAD_SLOT),
                **sampling_inputs,
                "uniforms": _Input(torch.full((max_bs, n + 1 + steps), 0.5, **f32), 0.5)}
            # Sampling first (its warping needs the most memory), then greedy in the same pool:
            # a step consumes its graph's outputs before the next step replays either.
            self.spec_step_graphs = {}
            pool = self.pool

            def body(on, sampling):
                return lambda **kw: speculate(on, **{**kw, "hidden": kw["hidden"].reshape(-1, hc)},
                                              sampling=sampling)
            for sampling in (True, False):
                self.spec_step_graphs[sampling] = g = _Graphed(
                    body(bodies, sampling), spec_inputs, step_sizes, capture, stream, pool=pool,
                    eager=body(calls, sampling),
                    name="speculative step (" + ("sampling" if sampling else "greedy") + ")")
                pool = self.pool = g.pool
            return
        self.target_verify_graph = _Graphed(
            self._verify, {"ids": ints(n), "positions": ints(n), "out_slots": ints(n, pad=PAD_SLOT),
                           **prefix(),
                           "tree_mask": _Input(torch.zeros(max_bs, n, n, dtype=torch.bool, device=dev), eye)},
            batch_sizes, capture, stream, eager=calls.target_verify, name="target verify")
        extend_hidden = self.draft_extend_hidden_states.view(max_bs, steps + 1, hin)
        self.draft_extend_graph = _Graphed(
            lambda **kw: (calls.draft_extend(**kw),),
            {"ids": ints(steps + 1), "hidden": _Input(extend_hidden, 0.0), "positions": ints(steps + 1),
             "out_slots": ints(steps + 1, pad=PAD_SLOT), **prefix(), "num_valid": ints(pad=1)},
            batch_sizes, capture, stream, name="draft extend")
        # Both drafting variants (top-k; chain sampling, topk 1 only) read the same inputs.
        multi_step_inputs = {
            "hidden": _Input(self.draft_hidden_states.view(max_bs, k, hc), 0.0), **prefix(),
            "scratch": ints((steps - 1) * k, pad=PAD_SLOT), **sampling_inputs,
            "uniforms": _Input(torch.full((max_bs, steps), 0.5, **f32), 0.5)}
        self.draft_multi_step_graphs = {
            chain: _Graphed(lambda chain=chain, **kw: calls.draft_multi_step(
                                kw.pop("hidden").reshape(-1, hc), **kw, chain_sampling=chain),
                            multi_step_inputs, batch_sizes, capture, stream,
                            name="draft multi-step" + (" (chain sampling)" if chain else ""))
            for chain in ((False, True) if k == 1 else (False,))}

    # Graph bodies: fixed-shape functions returning tuples of tensors.

    def _decode(self, **kw):
        return (self.calls.target_decode(**kw),)

    def _verify(self, ids, positions, out_slots, prefix_slots, prefix_lens, tree_mask):
        logits, feature = self.calls.target_verify(ids, positions, out_slots, prefix_slots, prefix_lens,
                                                   tree_mask)
        b, n, hin = feature.shape
        out = self.verify_hidden_states[:b * n].view(b, n, hin)
        out.copy_(feature)
        return logits, out

    def _extend(self, ids, hidden, positions, out_slots, prefix_slots, prefix_lens, num_valid):
        b, q, hin = hidden.shape
        static = self.draft_extend_hidden_states[:b * q].view(b, q, hin)
        static.copy_(hidden)
        return self.calls.draft_extend(ids, static, positions, out_slots, prefix_slots, prefix_lens,
                                       num_valid)

    # The ModelCalls interface.

    @property
    def num_steps(self) -> int:
        return self.calls.num_steps

    @property
    def topk(self) -> int:
        return self.calls.topk

    @property
    def num_draft_tokens(self) -> int:
        return self.calls.num_draft_tokens

    def spec_step(self, roots, lens, prefix_slots, hidden, scratch, tree_slots, temperature, top_k,
                  top_p, uniforms, sampling: bool):
        if not self.fused:  # per-call graphs, tree and acceptance eager in between
            return speculate(self, roots, lens, prefix_slots, hidden, scratch, tree_slots, temperature,
                             top_k, top_p, uniforms, sampling)
        b = roots.shape[0]
        values = dict(roots=roots, lens=lens, prefix_slots=prefix_slots, hidden=hidden.view(b, self.topk, -1),
                      scratch=scratch, tree_slots=tree_slots)
        # The greedy graph reads no sampling input: a greedy step copies none (the eager call
        # above the largest bucket takes them all).
        if sampling or b > self.max_bs:
            values.update(temperature=temperature, top_k=top_k, top_p=top_p, uniforms=uniforms)
        return self.spec_step_graphs[sampling](b, values)

    def target_decode(self, ids, positions, out_slots, prefix_slots, prefix_lens):
        return self.target_decode_graph(ids.shape[0], dict(
            ids=ids, positions=positions, out_slots=out_slots, prefix_slots=prefix_slots,
            prefix_lens=prefix_lens))[0]

    def target_decode_feature(self, ids, positions, out_slots, prefix_slots, prefix_lens):
        return self.target_decode_feature_graph(ids.shape[0], dict(
            ids=ids, positions=positions, out_slots=out_slots, prefix_slots=prefix_slots,
            prefix_lens=prefix_lens))

    def target_verify(self, ids, positions, out_slots, prefix_slots, prefix_lens, tree_mask):
        if self.fused:
            return self._verify(ids, positions, out_slots, prefix_slots, prefix_lens, tree_mask)
        return self.target_verify_graph(ids.shape[0], dict(
            ids=ids, positions=positions, out_slots=out_slots, prefix_slots=prefix_slots,
            prefix_lens=prefix_lens, tree_mask=tree_mask))

    def draft_extend(self, ids, hidden, positions, out_slots, prefix_slots, prefix_lens, num_valid):
        if self.fused or ids.shape[1] != self.calls.num_steps + 1:  # prefill extends run eagerly
            return self.calls.draft_extend(ids, hidden, positions, out_slots, prefix_slots,
                                           prefix_lens, num_valid)
        return self.draft_extend_graph(ids.shape[0], dict(
            ids=ids, hidden=hidden, positions=positions, out_slots=out_slots,
            prefix_slots=prefix_slots, prefix_lens=prefix_lens, num_valid=num_valid))[0]

    def draft_multi_step(self, hidden, prefix_slots, prefix_lens, scratch, temperature, top_k,
                         top_p, uniforms, chain_sampling: bool):
        if self.fused:
            return self.calls.draft_multi_step(hidden, prefix_slots, prefix_lens, scratch, temperature,
                                               top_k, top_p, uniforms, chain_sampling)
        k = self.calls.topk
        b = hidden.shape[0] // k
        return self.draft_multi_step_graphs[chain_sampling](b, dict(
            hidden=hidden.view(b, k, -1), prefix_slots=prefix_slots, prefix_lens=prefix_lens,
            scratch=scratch, temperature=temperature, top_k=top_k, top_p=top_p, uniforms=uniforms))

    def buffer_shapes(self) -> dict[str, tuple[int, int]]:
        """The hidden-state buffers as allocated, named like the plan's BufferPlan fields."""
        if self.calls.draft is None:
            return {}
        return {"draft_hidden_states_shape": tuple(self.draft_hidden_states.shape),
                "draft_extend_hidden_states_shape": tuple(self.draft_extend_hidden_states.shape),
                "verify_hidden_states_shape": tuple(self.verify_hidden_states.shape)}


class _Bodies:
    """What a fused speculative-step graph captures: the eager model calls, with the verify
    features and the draft-extend input passing through the plan's static hidden-state buffers."""

    def __init__(self, graphed: GraphedCalls):
        calls = graphed.calls
        self.num_steps, self.topk, self.num_draft_tokens = calls.num_steps, calls.topk, calls.num_draft_tokens
        self.draft_multi_step = calls.draft_multi_step
        self.target_verify = graphed._verify
        self.draft_extend = graphed._extend
