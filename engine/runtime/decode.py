"""The Runner's decode steps on their way: staged (the step's slots and packed input),
launched (one copy in, the graph, one copy out queued) and collected (the commit), with the two
ways of keeping the device busy while the host works.

Decode steps by row (rows.py): the per-request state lives on the device, indexed by request
row, and each decode step reads and updates it inside its graph; what the host sends is which
rows run and the slots the step took, packed into one pinned buffer and one copy, and what
comes back is one packed copy (tokens; accepted counts, bonus and path tokens, slots to free)
with an event. The host keeps its mirror (lengths, roots, emitted tokens) from that copy.

Overlap (`overlap=True`, the default on CUDA): since a step's input does not depend on the
step before, `_decode` launches step N, then stages step N+1 for the same requests in the same
shape (takes its slots from the free ones, writes its pinned rows, queues their copy behind
step N), and only then waits for step N. The commit that follows gives the staged step back
if the batch changed (a request finished, was aborted, or one joined) or slots run short; the
next step then stages itself as without overlap. The tokens are the same either way; the
staged slots count as free for admission (they are the running requests' reserved scratch).

Launch-ahead (`launch_ahead=True`, `--launch-ahead`): step N+1 is launched, for every request
running then, before step N is waited for (it reads the row state step N leaves on the
device), so the device never waits for the host between steps, not even for the commit and
the caller's work between calls. A request that step N finishes (or that is aborted) rides
step N+1 too: its output is discarded and its slots go back when N+1 is collected, so each
request needs one more step of context (`max_sequence_tokens`). Each call still returns one
step's outputs; every request gets the same tokens. Not with adaptive speculation, whose
policy sees each step before choosing the next.

`Decode` is a part of `Runner` (runner.py), over the runner's state: the slot table, the row
steps per shape (`_row_steps`), the running requests and the step's undo lists.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdeploy.engine.planner.plan import SpecShape
from specdeploy.engine.memory.kv import PAD_SLOT
from specdeploy.engine.runtime.request import Seq, StepOutput
from specdeploy.engine.runtime.rows import RowSteps
from specdeploy.engine.runtime.sampling import wants_processing


@dataclass
class Launched:
    """A decode step on its way: its requests in batch order, the slots it holds past the
    scratch [B, N] (the out slot of a plain step), its output's host copy and the event it is
    done at (None: already there)."""
    seqs: list
    shape: SpecShape
    steps: RowSteps
    slots: torch.Tensor
    host: torch.Tensor
    event: object
    logprobs: list | None = None    # per request, its emitted tokens' (eager steps with controls)


@dataclass
class Staged:
    """A decode step's input, staged: host rows copied to `packed` (on the device), the slots
    it took [B * (K - 1)], row after row; `key` says which step it was staged for."""
    key: tuple
    packed: torch.Tensor
    slots: torch.Tensor


class Decode:
    def _init_decode(self, overlap: bool | None, cuda_graph_batch_sizes) -> None:
        """Overlap and launch-ahead state, and the host staging of the decode steps' packed input
        and output (pinned on CUDA, so that neither copy waits): two input buffers, one being
        filled while the other's copy may still be queued behind the running step, each with the
        event of its last copy. Overlap is off with pools that follow every slot handed out
        (DeepSeek-V4's): they are sized for one step."""
        self.overlap = (self.device.type == "cuda") if overlap is None else overlap
        self.overlap = self.overlap and not self.table.listeners and not self.launch_ahead
        if self.launch_ahead and self.table.listeners:
            raise ValueError(f"launch_ahead: not for {type(self.target).__name__} targets (pools sized for one step)")
        self._ahead: Staged | None = None
        self._current: Launched | None = None      # launched, not collected yet (this call)
        self._in_flight: Launched | None = None    # launched ahead, collected next call
        self._stashed: list[StepOutput] = []       # a collected step's outputs, for the next call
        self.num_decode_steps = 0
        self.num_overlapped_steps = 0     # decode steps whose input was staged during the previous
        pin = self.device.type == "cuda"
        m = self.max_running_requests
        rows_max = max([m, *(cuda_graph_batch_sizes or ())])
        width = max(st.width for st in self._row_steps.values())
        out_width = max(st.out_width for st in self._row_steps.values())
        self._ring = [torch.zeros(rows_max * width, dtype=torch.int64, pin_memory=pin) for _ in range(2)]
        self._ring_events = [torch.cuda.Event() for _ in range(2)] if pin else None
        self._ring_next = 0
        self._out_host = [torch.zeros(m * out_width, dtype=torch.int64, pin_memory=pin) for _ in range(2)]
        self._out_events = [torch.cuda.Event() for _ in range(2)] if pin else None
        self._out_next = 0

    def _decode(self, seqs: list[Seq], shape: SpecShape) -> list[StepOutput]:
        """One decode step of `shape` (plain, or speculative) for every running request.

        Host side: the staged input (made while the previous step ran, when it is this
        step's), one copy to the device, the graph, one copy back; with overlap the next step
        is staged before this one is waited for (assuming every request continues; a request
        that finishes drops it). Then the commit: the slots off the accepted paths go back,
        lengths and tokens are emitted."""
        if self.launch_ahead:
            return self._decode_launch_ahead(seqs, shape)
        key = (shape, tuple(s.row for s in seqs))
        staged, self._ahead = self._ahead, None
        if staged is not None and staged.key != key:
            self.table.free(staged.slots)
            staged = None
        if staged is not None:
            self.num_overlapped_steps += 1
        self._current = step = self._launch(seqs, shape, staged)
        if self.overlap:
            self._ahead = self._stage(step.steps, seqs, key, ahead=True)
        outs = self._collect(step)
        self._current = None
        return outs

    def _decode_launch_ahead(self, seqs: list[Seq], shape: SpecShape) -> list[StepOutput]:
        """Launch-ahead overlap: the step launched last call (for every request then running)
        is this call's; the next one is launched now, for every request running now, before
        this one is waited for, so that the device never waits for the host between steps.
        A request that this step finishes (or that is aborted) rides one step too many, whose
        output is discarded and whose slots go back when it is collected."""
        step, self._in_flight = self._in_flight, None
        if wants_processing(list(self._running.values())):
            # Controls read each request's tokens so far on the host: no step may be launched
            # before the one before it is collected.
            if step is not None:
                return self._collect(step)
            return self._collect(self._launch(seqs, shape))
        if step is None:
            step = self._launch(seqs, shape)
        else:
            self.num_overlapped_steps += 1
            launched = {id(s) for s in step.seqs}
            if any(id(s) not in launched for s in seqs):
                # A request started between calls (activate): it decodes from the next call,
                # when the pipeline restarts with everyone.
                return self._collect(step)
        ahead = list(self._running.values())
        try:
            self._in_flight = self._launch(ahead, shape, lookahead=self._max_steps + 1) if ahead else None
        except BaseException:
            self._stashed = self._collect(step)  # kept consistent; returned by the next call
            raise
        outs = self._collect(step)
        if not self._running:
            self._drop_in_flight()
        return outs

    def _launch(self, seqs: list[Seq], shape: SpecShape, staged: Staged | None = None,
                lookahead: int = 0) -> Launched:
        """Stage (unless staged), copy and launch one decode step, and queue its output's copy
        to the host; -> the launched step, which owns its slots past the scratch.
        lookahead: positions the requests may have grown by since their host lengths (a step
        launched before the one before it is collected)."""
        steps = self._row_steps[shape]
        b = len(seqs)
        self.num_decode_steps += 1
        if staged is None:
            staged = self._stage(steps, seqs, (shape, tuple(s.row for s in seqs)))
        sampling = any(s.req.temperature > 0 for s in seqs)
        # Prefix columns an eager body reads: the longest committed length.
        width = max(s.length for s in seqs) + lookahead
        taken = staged.slots.view(b, steps.width - 1)
        process = self._step_logits(seqs)
        try:
            if steps.kind == "spec":
                n, m = shape.num_draft_tokens, shape.num_steps
                if sampling:
                    # [B, N + 1 + S]: verify coins per node, the bonus draw, one per chain draft step.
                    params, uniforms = self._sampling_params(seqs), self._uniforms(seqs, n + 1 + m)
                else:
                    params, uniforms = self._greedy_args(b, n + 1 + m)
                out, _ = steps.run(staged.packed, b, width, sampling, params, uniforms, process)
            else:
                out, logits = steps.run(staged.packed, b, width)
                if sampling or process is not None:  # the body wrote the argmax; these replace it
                    tokens = self._sample(seqs, process.plain(logits) if process else logits)
                    if process is not None and process.wants_logprobs:
                        process.recorded = process.logprobs(logits[:, None], tokens[:, None])
                    rows = staged.packed[:b, 0]
                    self.rows.roots[rows] = tokens
                    if steps.kind == "feature":
                        self._catch_up_ids[rows, self._catch_up_count[rows] - 1] = tokens
                    out = tokens[:, None]
        except BaseException:  # a failed forward commits nothing: its slots go back
            self.table.free(staged.slots)
            raise
        scratch = (shape.num_steps - 1) * shape.topk if steps.kind == "spec" else 0
        if scratch:
            # The scratch goes back now: the device is done with it before any later step
            # (one stream), and the next step may take it.
            self.table.free(taken[:, :scratch])
            taken = taken[:, scratch:]
        host, event = self._to_host(out)
        return Launched(seqs, shape, steps, taken, host, event, getattr(process, "recorded", None))

    def _collect(self, step: Launched) -> list[StepOutput]:
        """Wait for a launched step's output and commit it on the host: the slots off the
        accepted paths go back, lengths and tokens are emitted. Requests released since the
        launch (finished or aborted: a launch-ahead over-run) give back all its slots."""
        if step.event is not None:
            step.event.synchronize()                         # the one wait of the step
        values = step.host.tolist()
        live = [self._running.get(s.req.id) is s for s in step.seqs]
        shape, b = step.shape, len(step.seqs)
        listeners = self.table.listeners
        if step.steps.kind == "spec":
            n, m = shape.num_draft_tokens, shape.num_steps
            accepted = [v[0] for v in values]
            off_path = step.host[:, 2 + m + 1:].reshape(-1)  # [B * N], sum(N - 1 - accepted) first
            lps = step.logprobs
            if all(live):
                self.table.free(off_path[:b * (n - 1) - sum(accepted)])
            else:
                at = 0
                for i, (ok, a) in enumerate(zip(live, accepted)):
                    self.table.free(off_path[at:at + n - 1 - a] if ok else step.slots[i])
                    at += n - 1 - a
            seqs = [s for s, ok in zip(step.seqs, live) if ok]
            values = [v for v, ok in zip(values, live) if ok]
            lps = [x for x, ok in zip(lps, live) if ok] if lps is not None else None
            accepted = [v[0] for v in values]
            for s, a in zip(seqs, accepted):
                if listeners:
                    self.table.commit(s.row, s.length, s.length + a + 1, lag=(s.pending, s.pending))
                s.length += a + 1
            self._commit_step()
            self.num_draft_tokens_proposed += len(seqs) * m
            self.num_draft_tokens_accepted += sum(accepted)
            emitted = [v[3:a + 3] + [v[1]] for v, a in zip(values, accepted)]
            if lps is not None:
                lps = [x[:a + 1] if x is not None else None for x, a in zip(lps, accepted)]
            return self._emit(seqs, emitted, accepted, m, lps)
        lps = step.logprobs
        if not all(live):
            for i, ok in enumerate(live):
                if not ok:
                    self.table.free(step.slots[i])
            seqs = [s for s, ok in zip(step.seqs, live) if ok]
            values = [v for v, ok in zip(values, live) if ok]
            lps = [x for x, ok in zip(lps, live) if ok] if lps is not None else None
        else:
            seqs = step.seqs
        for s in seqs:
            if listeners:
                lag = s.pending + (step.steps.kind == "feature")
                self.table.commit(s.row, s.length, s.length + 1, lag=(s.pending, lag))
            s.length += 1
            if step.steps.kind == "feature":
                s.pending += 1
        self._commit_step()
        return self._emit(seqs, values, [0] * len(seqs), logprobs=lps)

    def _drop_in_flight(self) -> None:
        """No request is left running: the launched-ahead step's slots go back (the device
        finishes it before any later work that could reuse them) and its output is ignored."""
        if self._in_flight is not None:
            self.table.free(self._in_flight.slots)
            self._in_flight = None

    def _stage(self, steps: RowSteps, seqs: list[Seq], key: tuple, ahead: bool = False) -> Staged | None:
        """Take the step's slots, write its packed rows (and padding) into a host buffer and
        start their copy. ahead: for the next step, from free slots only (None if they are
        short: it is staged when it runs instead)."""
        b, width = len(seqs), steps.width
        need = b * (width - 1)
        if ahead and self.table.num_free < need:
            return None
        slots = self.table.alloc_host(need) if ahead else self._alloc(need, host=True)
        bs = steps.bucket(b) or b
        i = self._ring_next
        self._ring_next ^= 1
        if self._ring_events is not None:
            self._ring_events[i].synchronize()              # its last copy has left it
        host = self._ring[i][:bs * width].view(bs, width)
        host[:b, 0] = torch.tensor([s.row for s in seqs], dtype=torch.int64)
        host[:b, 1:] = slots.view(b, width - 1)
        host[b:, 0] = self.table.pad_row
        host[b:, 1:] = PAD_SLOT
        packed = steps.upload(host, b)
        if self._ring_events is not None:
            self._ring_events[i].record()
        return Staged(key, packed, slots)

    def _drop_ahead(self) -> None:
        """Give back the staged next step's slots (its batch changed, or slots are short)."""
        if self._ahead is not None:
            self.table.free(self._ahead.slots)
            self._ahead = None

    def _to_host(self, out: torch.Tensor) -> tuple[torch.Tensor, object]:
        """out [B, K] on the device -> (its host copy, the event it is done at): on CUDA queued
        into one of two pinned buffers (two steps may be in flight), else a plain copy."""
        if self._out_events is None:
            return (out.cpu() if out.device.type != "cpu" else out), None
        b, k = out.shape
        i = self._out_next
        self._out_next ^= 1
        host = self._out_host[i][:b * k].view(b, k)
        host.copy_(out, non_blocking=True)
        self._out_events[i].record()
        return host, self._out_events[i]
