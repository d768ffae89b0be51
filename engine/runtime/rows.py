"""Decode steps addressed by request row: what the runner's decode loop sends to the device.

The state a decode step reads and changes lives on the device, one entry per request row
(R = max_running_requests rows, plus the padding row R that padded batch rows use):

    lens          [R + 1] int64        committed tokens (the position of the next one)
    roots         [R + 1] int64        the last emitted token (not in the KV yet)
    req_to_slot   [R + 1, context]     the SlotTable's
    draft_hidden  [R + 1, Hc]          the draft state after each root (with a draft head)
    catch-up      [R + 1, D(, Hin)]    the adaptive NONE shape's entries and their count

so a step's host input is only which rows run and the slots it took for them, one int64 row
per request:

    plain  [row, out slot]                                       (K = 2)
    spec   [row, scratch ((S - 1) * topk), tree slots (N)]       (K = 1 + (S - 1) * topk + N)

staged in pinned host memory with its padding rows (the pad row, pad slots) and copied in one
non-blocking copy into the static input of the step's graph. The body gathers the rest on the
device (token ids, positions, prefix tables, the draft hidden state), runs the model calls,
and writes the step's effect back into the row state (committed slots, new lengths and roots,
the draft state, catch-up entries): one graph replay with no other kernel around it. Its one
output, packed int64 [B, K_out], comes back in one non-blocking copy into pinned memory with an
event:

    plain  [token]                                               (the argmax; sampling redraws)
    spec   [accepted, bonus, path tokens (S + 1), slots to free (N)]

Because no input depends on the output of the step before, the runner stages step N+1 (its
slots, its pinned rows, their copy) while step N runs and only then waits for step N
(runner.py, "overlap"). Padded rows all address row R: its length is reset to 0 by every step,
so whatever they write stays in row R and the pad slot.
"""

from __future__ import annotations

import torch

from specdeploy.engine.models.layers import argmax
from specdeploy.engine.runtime.calls import speculate
from specdeploy.engine.memory.kv import PAD_SLOT, SlotTable


class RowState:
    """The per-row device state above (the slot table and draft buffers are the runner's)."""

    def __init__(self, table: SlotTable, draft_hidden: torch.Tensor | None = None,
                 catch_up: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None):
        self.table = table
        self.pad_row = table.pad_row
        dev = table.req_to_slot.device
        self.lens = torch.zeros(self.pad_row + 1, dtype=torch.int64, device=dev)
        self.roots = torch.zeros(self.pad_row + 1, dtype=torch.int64, device=dev)
        self.draft_hidden = draft_hidden
        self.catch_ids, self.catch_feature, self.catch_count = catch_up or (None, None, None)

    def start(self, rows: list[int], lens: list[int], roots: list[int]) -> None:
        """Requests that begin decoding (a prefill ended, a transfer arrived)."""
        dev = self.lens.device
        index = torch.tensor(rows, dtype=torch.int64, device=dev)
        self.lens[index] = torch.tensor(lens, dtype=torch.int64, device=dev)
        self.roots[index] = torch.tensor(roots, dtype=torch.int64, device=dev)


def plain_width(shape) -> int:
    return 2


def spec_width(shape) -> int:
    return 1 + (shape.num_steps - 1) * shape.topk + shape.num_draft_tokens


def plain_body(calls, st: RowState, packed: torch.Tensor, width: int, feature: bool):
    """packed [B, 2] (row, out slot) -> (tokens [B, 1] argmax, logits [B, V])."""
    rows, slots = packed[:, 0].contiguous(), packed[:, 1:2].contiguous()
    lens = st.lens[rows]
    prefix = st.table.req_to_slot[rows, :width]
    ids = st.roots[rows][:, None]
    if feature:
        logits, feat = calls.target_decode_feature(ids, lens[:, None], slots, prefix, lens)
    else:
        logits = calls.target_decode(ids, lens[:, None], slots, prefix, lens)
    tokens = argmax(logits)
    pad = rows == st.pad_row
    st.table.req_to_slot[rows, lens] = slots[:, 0]
    st.lens[rows] = torch.where(pad, 0, lens + 1)
    st.roots[rows] = tokens
    if feature:  # the draft's entry (next token, feature at the root) waits for its catch-up
        count = st.catch_count[rows]
        st.catch_ids[rows, count] = tokens
        st.catch_feature[rows, count] = feat
        st.catch_count[rows] = torch.where(pad, 0, count + 1)
    return tokens[:, None], logits


def spec_body(on, st: RowState, packed: torch.Tensor, width: int, sampling: bool, temperature, top_k,
              top_p, uniforms, hidden_buf: torch.Tensor | None = None, process=None):
    """One speculative iteration (calls.speculate) of the rows in packed [B, K] ->
    [B, 2 + (S + 1) + N] (accepted, bonus, path tokens, slots to free: the first
    sum(N - 1 - accepted) entries, row after row). hidden_buf: the plan's static draft-hidden
    buffer the gathered state passes through (a fused graph)."""
    steps, n, k = on.num_steps, on.num_draft_tokens, on.topk
    b = packed.shape[0]
    m = (steps - 1) * k
    rows = packed[:, 0].contiguous()
    scratch, tree_slots = packed[:, 1:1 + m].contiguous(), packed[:, 1 + m:1 + m + n].contiguous()
    lens, roots = st.lens[rows], st.roots[rows]
    prefix = st.table.req_to_slot[rows, :width]
    hidden = st.draft_hidden[rows][:, None].expand(-1, k, -1).reshape(b * k, -1)
    if hidden_buf is not None:
        hidden_buf[:b * k].copy_(hidden)
        hidden = hidden_buf[:b * k]
    num_acc, bonus, path_tokens, path_slots, positions, to_free, draft_hidden = speculate(
        on, roots, lens, prefix, hidden, scratch, tree_slots, temperature, top_k, top_p, uniforms,
        sampling, process)
    # All S + 1 columns are written; those past the new length hold the pad slot and are never
    # read (prefix_lens bounds every read) before being overwritten.
    st.table.req_to_slot[rows[:, None], positions] = path_slots
    st.draft_hidden[rows] = draft_hidden
    st.roots[rows] = bonus
    st.lens[rows] = torch.where(rows == st.pad_row, 0, lens + num_acc + 1)
    return torch.cat([num_acc[:, None], bonus[:, None], path_tokens, to_free], 1)


class RowSteps:
    """One shape's decode step over rows: a CUDA graph per captured batch size (or its padded
    static buffers replayed eagerly, graph_mode "padded"), the eager body otherwise.

    kind: "plain" (target decode), "feature" (the adaptive NONE shape: also files the draft's
    catch-up entry) or "spec" (a speculative iteration; fused: the whole of it in the graph,
    else the body runs eagerly around the per-call graphs of `calls`)."""

    def __init__(self, calls, st: RowState, kind: str, shape, graph_mode: str = "off",
                 batch_sizes=(), context_length: int = 0, fused: bool = True, pool=None):
        from specdeploy.engine.runtime.graphs import GraphedCalls, _Bodies, _Graphed, _Input

        self.st, self.kind, self.shape = st, kind, shape
        self.calls = calls
        self.width = spec_width(shape) if kind == "spec" else plain_width(shape)
        self.out_width = 2 + shape.num_steps + 1 + shape.num_draft_tokens if kind == "spec" else 1
        graphed = isinstance(calls, GraphedCalls)
        self.eager_calls = calls.calls if graphed else calls
        # An eager speculative step: the per-call graphs of unfused calls, else the eager calls
        # (batches above the largest bucket of a fused step).
        self.eager_spec = calls if graphed and not calls.fused else self.eager_calls
        self.graphs: dict[bool, _Graphed] = {}       # sampling -> graph (plain: False only)
        self.pool = pool
        self.hidden_buf = None
        if graph_mode == "off" or not batch_sizes or (kind == "spec" and not (graphed and calls.fused)):
            return  # eager body (an unfused speculative step replays the per-call graphs)
        dev = st.lens.device
        max_bs = max(batch_sizes)
        pad = torch.full((self.width,), PAD_SLOT, dtype=torch.int64, device=dev)
        pad[0] = st.pad_row
        inputs = {"packed": _Input(torch.zeros(max_bs, self.width, dtype=torch.int64, device=dev), pad)}
        stream = torch.cuda.Stream() if graph_mode == "capture" else None
        capture = graph_mode == "capture"
        if kind != "spec":
            feature = kind == "feature"
            self.graphs[False] = _Graphed(
                lambda packed: plain_body(self.eager_calls, st, packed, context_length, feature),
                inputs, batch_sizes, capture, stream, pool=pool,
                name="target decode by row" + (" (with feature)" if feature else ""))
            self.pool = self.graphs[False].pool
            return
        f32 = dict(dtype=torch.float32, device=dev)
        n, steps = shape.num_draft_tokens, shape.num_steps
        inputs.update({
            "temperature": _Input(torch.zeros(max_bs, **f32), 0.0),
            "top_k": _Input(torch.zeros(max_bs, dtype=torch.int64, device=dev), 0),
            "top_p": _Input(torch.ones(max_bs, **f32), 1.0),
            "uniforms": _Input(torch.full((max_bs, n + 1 + steps), 0.5, **f32), 0.5)})
        bodies = _Bodies(calls)
        self.hidden_buf = calls.draft_hidden_states

        def body(sampling):
            return lambda packed, temperature, top_k, top_p, uniforms: (spec_body(
                bodies, st, packed, context_length, sampling, temperature, top_k, top_p, uniforms,
                self.hidden_buf),)
        # Sampling first (its warping needs the most memory), then greedy in the same pool.
        for sampling in (True, False):
            self.graphs[sampling] = _Graphed(
                body(sampling), inputs, batch_sizes, capture, stream, pool=self.pool,
                name="speculative step by row (" + ("sampling" if sampling else "greedy") + ")")
            self.pool = self.graphs[sampling].pool

    def bucket(self, b: int) -> int | None:
        """The padded batch size a graph runs b rows at (None: the eager body, b rows)."""
        return self.graphs[False].bucket(b) if self.graphs else None

    def upload(self, host: torch.Tensor, b: int) -> torch.Tensor:
        """host [bs or b, K] (pinned on CUDA; padding rows filled) -> its device copy: straight
        into the graph's static input when a bucket serves b, else a fresh tensor. Never waits."""
        bs = self.bucket(b)
        dev = self.st.lens.device
        if bs is None:
            return host[:b].to(dev, non_blocking=True) if dev.type != "cpu" else host[:b].clone()
        static = self.graphs[False].inputs["packed"].buf[:bs]
        static.copy_(host[:bs], non_blocking=True)
        return static

    def run(self, packed: torch.Tensor, b: int, width: int, sampling: bool = False, params=None,
            uniforms=None, process=None):
        """packed: what upload returned; width: prefix columns the eager body gathers (the
        longest committed length); process: a speculative step's sampling.StepLogits, which
        runs the body eagerly. -> (out [B, K_out] on the device, logits [B, V] of a plain
        step or None)."""
        graph = self.graphs.get(sampling) if self.graphs else None
        if self.kind != "spec":
            feature = self.kind == "feature"
            if graph is None or graph.bucket(b) is None:
                return plain_body(self.eager_calls, self.st, packed[:b], width, feature)
            tokens, logits = graph(b, {}, padded=("packed",))
            return tokens, logits
        temperature, top_k, top_p = params
        if graph is None or graph.bucket(b) is None or process is not None:
            return spec_body(self.eager_spec, self.st, packed[:b], width, sampling, temperature, top_k,
                             top_p, uniforms, process=process), None
        if sampling:
            values = dict(temperature=temperature, top_k=top_k, top_p=top_p, uniforms=uniforms)
            return graph(b, values, padded=("packed",))[0], None
        # The greedy graph reads no sampling input: nothing to copy or pad for it.
        return graph(b, {}, padded=tuple(graph.inputs))[0], None
