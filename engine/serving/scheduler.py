"""Continuous batching around the Runner.

The scheduler owns requests: a bounded waiting queue, admission into the running batch, per-request
output state (detokenization, stop strings, stop token ids, max_tokens), aborts, and draining.
The runner owns buffers: it prefills what it is given and decodes everything running, one `step()`
at a time. Neither knows HTTP.

Threads: the runner's step loop runs in one dedicated thread (torch would otherwise block the
event loop). Requests are submitted from the event loop; their outputs come back through a
per-request asyncio.Queue fed with `loop.call_soon_threadsafe`. `run_in_engine` runs a function
on the engine thread between steps (the disaggregation services use it to touch the runner).

Liveness: `stalled` says the queue's head has waited past `stall_timeout_s` while no step ran
(slots held by requests that compute nothing): /ready answers 503 and a gauge says so.

Decode role (docs/disaggregation.md): a request submitted with a `prefill_url` is admitted with
`runner.receive` (its prompt's slots taken, nothing computed) and handed to `remote` (the
decode service), which has the prefill server fill those slots and then activates it. Until
then an abort must not free the slots (the prefill server may still be writing into them): the
client is answered at once, and `remote` frees them once the prefill server has stopped.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Protocol

from specdeploy.engine.serving.metrics import EngineMetrics
from specdeploy.engine.runtime.runner import NoCapacity, Request, Runner, StepOutput
from specdeploy.engine.runtime.sampling import LogitControls
from specdeploy.engine.serving.tokenizer import IncrementalDetokenizer, Tokenizer

log = logging.getLogger("specdeploy.scheduler")

# Decode steps between publications of the adaptive policy's estimates in /metrics.
_ADAPTIVE_PUBLISH_STEPS = 8


class SchedulerError(Exception):
    """A request refused before admission; `status_code` is what HTTP should answer."""

    status_code = 400


class QueueFullError(SchedulerError):
    status_code = 429


class DrainingError(SchedulerError):
    status_code = 503


class RequestTooLargeError(SchedulerError):
    status_code = 400


@dataclass
class SamplingParams:
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: set[int] = field(default_factory=set)
    ignore_eos: bool = False
    controls: LogitControls | None = None  # penalties, bias, min_tokens, grammar, logprobs


@dataclass
class Delta:
    """What one engine step produced for one request, as the HTTP layer streams it."""

    text: str
    num_new_tokens: int
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0      # prompt tokens served from the prefix cache
    error: str | None = None
    error_status: int = 500     # with `error`: 400 where the request was at fault (the runner refused it)
    # With logprobs asked for: the tokens whose text this delta (or an earlier one: text held
    # back for stop strings) carries, and one (logprob, top) entry each; the prompt's on the first.
    token_ids: list[int] = field(default_factory=list)
    logprobs: list | None = None
    prompt_logprobs: list | None = None


@dataclass
class _RequestState:
    id: str
    endpoint: str
    prompt_ids: list[int]
    params: SamplingParams
    stop_token_ids: set[int]
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    detokenizer: IncrementalDetokenizer
    arrival_s: float
    prefill_url: str | None = None  # decode role: the prefill server that computes the prompt
    first_token_s: float | None = None
    num_output_tokens: int = 0
    num_runner_outputs: int = 0
    num_cached_tokens: int = 0
    text: str = ""
    emitted_chars: int = 0
    finished: bool = False
    # Tokens (and their logprobs) not yet handed out with a delta.
    unsent_ids: list[int] = field(default_factory=list)
    unsent_lps: list = field(default_factory=list)
    prompt_lps: list | None = None


class RemotePrefill(Protocol):
    """What the scheduler needs from the decode role's service (engine/serving/disagg/decode.py).
    Both are called on the request's event loop."""

    def start(self, req_id: str, prompt_ids: list[int], params: SamplingParams, prefill_url: str,
              row: int, slots: list[int]) -> None: ...

    def cancel(self, req_id: str) -> None: ...


class RequestHandle:
    """The event-loop side of one request: iterate its deltas, or abort it."""

    def __init__(self, scheduler: Scheduler, state: _RequestState):
        self._scheduler = scheduler
        self._state = state
        self.id = state.id
        self.prompt_tokens = len(state.prompt_ids)

    async def deltas(self) -> AsyncIterator[Delta]:
        while True:
            delta = await self._state.queue.get()
            yield delta
            if delta.finish_reason is not None:
                return

    def abort(self) -> None:
        self._scheduler.abort(self.id)


class Scheduler:
    """Owns requests and drives `runner.step()` in its own thread."""

    def __init__(self, runner: Runner, tokenizer: Tokenizer, metrics: EngineMetrics, *,
                 max_queued_requests: int, log_interval_s: float = 5.0, stall_timeout_s: float = 60.0):
        self.runner = runner
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.max_queued_requests = max_queued_requests
        # The runner reserves each request's worst case when it is added (prompt + max_tokens +
        # one iteration's draft scratch) and refuses with NoCapacity when that does not fit now;
        # so a running request never runs out of KV slots and nothing needs preempting.
        # check_fits applies the runner's two limits (max_sequence_tokens, slots_needed) up front,
        # so a request that could *never* run is refused with a 400 instead of waiting in the queue.
        self.capacity_slots = runner.table.capacity
        metrics.serving_capacity(runner.max_running_requests, runner.table.capacity)
        # The most prompt + max_tokens a request may have (what clients see as the context).
        self.context_length = runner.max_sequence_tokens
        self.log_interval_s = log_interval_s
        # Liveness (`stalled`): since when the queue's head has found no room, and when the
        # runner last computed a step. Written by the engine thread, read by the event loop
        # (float stores are atomic).
        self.stall_timeout_s = stall_timeout_s
        self._head_blocked_since: float | None = None
        self._last_step_s = time.monotonic()
        self._stall_logged = False  # engine thread only

        self._cv = threading.Condition()
        self._waiting: collections.deque[_RequestState] = collections.deque()  # guarded by _cv
        self._aborts: list[str] = []  # guarded by _cv
        self._commands: list[Callable[[], None]] = []  # guarded by _cv: run on the engine thread
        self._admission_blocked = False  # engine thread only: the queue's head did not fit
        self.remote: RemotePrefill | None = None
        self._stop = False  # guarded by _cv
        self._num_unfinished = 0  # guarded by _cv: submitted and not yet finished, wherever they are
        self._running: dict[str, _RequestState] = {}  # engine thread only
        self._outbox: list[tuple[asyncio.AbstractEventLoop, asyncio.Queue, Delta]] = []  # engine thread only
        self._draft_counts = (runner.num_draft_tokens_proposed, runner.num_draft_tokens_accepted)
        self._num_running_published = 0  # read by the event loop (an int store is atomic)
        self.draining = False
        self._rejection_logged_s = 0.0  # event loop only
        self._rejected_since_log = 0
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None

        # Totals for the periodic log line (engine thread only).
        self._log_last_s = time.monotonic()
        self._log_tokens = 0
        self._log_steps = 0
        self._log_accepted = 0
        self._log_finished = 0
        self._log_ttfts_s: list[float] = []
        self._log_rejected_before = metrics.rejected_total()
        self._adaptive_steps = 0
        self._log_prompt_tokens = 0
        self._log_cached_tokens = 0

    # ---- event-loop side -------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="engine-step-loop", daemon=True)
        self._thread.start()

    @property
    def started(self) -> bool:
        return self._thread is not None

    def shutdown(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join()

    def start_drain(self) -> None:
        if not self.draining:
            self.draining = True
            log.info("draining: refusing new requests, %d running and %d queued will finish",
                     self._num_running_published, len(self._waiting))

    @property
    def stalled_for_s(self) -> float:
        """How long the queue's head has waited for room while no step ran (0: not stalled):
        slots held by requests that compute nothing (or by a leak) would keep it waiting forever."""
        since = self._head_blocked_since
        if since is None:
            return 0.0
        return max(0.0, time.monotonic() - max(since, self._last_step_s))

    @property
    def stalled(self) -> bool:
        return self.stalled_for_s > self.stall_timeout_s

    @property
    def stopping(self) -> bool:
        return self._stop

    @property
    def alive(self) -> bool:
        """The engine thread runs (it ends only at shutdown)."""
        return self._thread is not None and self._thread.is_alive()

    @property
    def is_idle(self) -> bool:
        with self._cv:
            return self._num_unfinished == 0

    def max_new_tokens(self, prompt_tokens: int) -> int:
        """The largest max_tokens that fits with this prompt (0 or less: the prompt alone does not)."""
        return self.runner.max_new_tokens(prompt_tokens)

    def check_fits(self, prompt_tokens: int, max_tokens: int) -> None:
        """Raise RequestTooLargeError for a request that could never run, whatever the load."""
        if prompt_tokens == 0:
            raise RequestTooLargeError("the prompt is empty")
        if prompt_tokens + max_tokens > self.context_length:
            raise RequestTooLargeError(
                f"this model's context length is {self.context_length} tokens; the request asks for "
                f"{prompt_tokens + max_tokens} ({prompt_tokens} in the prompt + {max_tokens} to generate)")
        need = self.runner.slots_needed(prompt_tokens, max_tokens)
        if need > self.capacity_slots:
            raise RequestTooLargeError(
                f"the request needs {need} KV slots but the cache holds {self.capacity_slots}")

    def submit(self, prompt_ids: list[int], params: SamplingParams, endpoint: str,
               prefill_url: str | None = None) -> RequestHandle:
        if self.draining:
            self.metrics.request_rejected("draining")
            raise DrainingError("the server is shutting down")
        self.check_fits(len(prompt_ids), params.max_tokens)
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids |= self.tokenizer.eos_token_ids
        if params.controls is not None and params.controls.min_tokens:
            params.controls.min_tokens_banned = frozenset(stop_ids)
        loop = asyncio.get_running_loop()
        state = _RequestState(
            id=f"req-{next(self._ids)}", endpoint=endpoint, prompt_ids=list(prompt_ids), params=params,
            stop_token_ids=stop_ids,
            loop=loop, queue=asyncio.Queue(), detokenizer=IncrementalDetokenizer(self.tokenizer, prompt_ids),
            arrival_s=time.monotonic(), prefill_url=prefill_url)
        if prefill_url is not None and self.remote is None:
            raise SchedulerError("this server does not take prefilled requests (not --role decode)")
        with self._cv:
            if len(self._waiting) >= self.max_queued_requests:
                self.metrics.request_rejected("queue_full")
                self._log_rejection()
                raise QueueFullError(
                    f"the server is at capacity ({self._num_running_published} running, "
                    f"{len(self._waiting)} queued); retry later")
            self._waiting.append(state)
            self._num_unfinished += 1
            self.metrics.num_requests_waiting.set(len(self._waiting))
            self._cv.notify()
        return RequestHandle(self, state)

    def _log_rejection(self) -> None:
        # Under overload every request is a rejection: one line per interval, with the count.
        self._rejected_since_log += 1
        now = time.monotonic()
        if now - self._rejection_logged_s >= self.log_interval_s:
            log.warning("overloaded: refused %d request(s) with 429 (%d running, %d queued, queue limit %d)",
                        self._rejected_since_log, self._num_running_published, len(self._waiting),
                        self.max_queued_requests)
            self._rejection_logged_s, self._rejected_since_log = now, 0

    def abort(self, req_id: str) -> None:
        with self._cv:
            self._aborts.append(req_id)
            self._cv.notify()

    def run_in_engine(self, fn: Callable[[], Any]) -> asyncio.Future:
        """Run fn() on the engine thread between steps; -> a future (of the calling event loop)
        with its result or exception."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()

        def settle(ok: bool, value) -> None:
            if future.done():  # the caller gave up waiting
                return
            future.set_result(value) if ok else future.set_exception(value)

        def command() -> None:
            try:
                result = (True, fn())
            except Exception as e:  # noqa: BLE001 - handed to the caller, never kills the engine thread
                result = (False, e)
            try:
                loop.call_soon_threadsafe(settle, *result)
            except RuntimeError:  # the event loop is closed (shutdown)
                pass

        with self._cv:
            self._commands.append(command)
            self._cv.notify()
        return future

    # ---- decode role: requests prefilled elsewhere (engine thread) -----------------------------

    def activate_remote(self, req_id: str, staged=None) -> None:
        """The prefill server has written the request's KV (into its slots, or into `staged`, a
        staging region: runner.activate) and metadata row: run it."""
        state = self._running.get(req_id)
        if not self.runner.is_receiving(req_id):
            return
        if state is None or state.finished:  # aborted meanwhile; nothing writes the slots now
            self.runner.abort(req_id)
            return
        self._process(self.runner.activate(req_id, staged))

    def release_remote(self, req_id: str, error: str | None = None) -> None:
        """The prefill server will not write into the request's slots (done, failed or gone):
        free them; finish the request with `error` if it is still waiting for its prompt."""
        if self.runner.is_receiving(req_id):
            self.runner.abort(req_id)
        state = self._running.get(req_id)
        if state is not None and not state.finished:
            self._finish(state, "error", error=error or "the prefill server gave up")

    # ---- engine thread ---------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._cv:
                admissible = self._waiting and not self._admission_blocked
                if not (self._stop or admissible or self._aborts or self._commands or self.runner.has_work):
                    # Wake up now and then while idle so the throughput gauge decays to zero.
                    self._cv.wait(timeout=self.log_interval_s)
                if self._stop:
                    break
                aborts, self._aborts = self._aborts, []
                commands, self._commands = self._commands, []
            try:
                if aborts or commands or self.runner.has_work:
                    self._admission_blocked = False  # something may have freed room
                if commands:  # the split roles' transfers arriving, activating: progress too
                    self._last_step_s = time.monotonic()
                for command in commands:
                    command()
                self._apply_aborts(aborts)
                self._admit()
                if self.runner.has_work:
                    self._last_step_s = time.monotonic()
                    self._process(self.runner.step())
            except Exception as e:  # a broken batch must not kill the server: fail what ran in it
                log.exception("engine step failed; failing %d running requests", len(self._running))
                for state in list(self._running.values()):
                    if self.runner.is_receiving(state.id):  # not in the failed batch
                        continue
                    self._safe_runner_abort(state.id)
                    self._finish(state, "error", error=f"engine error: {type(e).__name__}: {e}")
            self._deliver()
            self._publish_gauges()
            self._maybe_log()
        # Shutdown: whatever is left gets an abort so no client waits forever.
        for state in list(self._running.values()) + list(self._waiting):
            self._finish(state, "abort")
        self._deliver()

    def _apply_aborts(self, aborts: list[str]) -> None:
        for req_id in aborts:
            state = self._running.get(req_id)
            if state is not None and self.runner.is_receiving(req_id):
                # The prefill server may be writing into its slots: the decode service frees
                # them once it has stopped; the client is answered now.
                self._finish(state, "abort")
                self._call_on_loop(state, self.remote.cancel, req_id)
                log.info("aborted %s (client went away) while its prompt was being prefilled", req_id)
                continue
            if state is not None:
                self._safe_runner_abort(req_id)
                self._finish(state, "abort")
                log.info("aborted %s (client went away); its KV slots are free", req_id)
                continue
            with self._cv:
                queued = next((s for s in self._waiting if s.id == req_id), None)
                if queued is not None:
                    self._waiting.remove(queued)
            if queued is not None:
                self._finish(queued, "abort")

    def _admit(self) -> None:
        # FIFO: the head of the queue waits for room rather than being overtaken by smaller
        # requests forever.
        while True:
            with self._cv:
                if not self._waiting:
                    self._head_blocked_since = None
                    return
                state = self._waiting[0]
            p = state.params
            req = Request(id=state.id, prompt_ids=state.prompt_ids, max_tokens=p.max_tokens,
                          temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, seed=p.seed,
                          stop_token_ids=state.stop_token_ids, controls=p.controls)
            try:
                if state.prefill_url is None:
                    self.runner.add(req)
                else:
                    row, slots = self.runner.receive(req)
                    self._call_on_loop(state, self.remote.start, state.id, state.prompt_ids, p,
                                       state.prefill_url, row, slots)
            except NoCapacity:
                # Full (running requests or KV slots): it stays at the head of the queue.
                self._admission_blocked = True
                if self._head_blocked_since is None:
                    self._head_blocked_since = time.monotonic()
                return
            except Exception as e:  # noqa: BLE001 - this request's fault: it fails alone, the runner took nothing
                log.warning("runner refused %s: %s", state.id, e)
                with self._cv:
                    self._waiting.popleft()
                self._finish(state, "error", error=str(e), error_status=400 if isinstance(e, ValueError) else 500)
                continue
            with self._cv:
                self._waiting.popleft()
            self._head_blocked_since = None
            self._running[state.id] = state
            self.metrics.prompt_tokens.inc(len(state.prompt_ids))

    def _process(self, outputs: list[StepOutput]) -> None:
        now = time.monotonic()
        if self.runner.policy is not None and self.runner.decoded_shape is not None:
            self.metrics.decode_shape(self.runner.decoded_shape)
            # The estimates every few decode steps (a snapshot walks every shape and bucket).
            if self._adaptive_steps % _ADAPTIVE_PUBLISH_STEPS == 0:
                self.metrics.adaptive_estimates(self.runner.policy.snapshot())
            self._adaptive_steps += 1
        proposed, accepted = self.runner.num_draft_tokens_proposed, self.runner.num_draft_tokens_accepted
        self.metrics.spec_decode_num_draft_tokens.inc(proposed - self._draft_counts[0])
        self.metrics.spec_decode_num_accepted_tokens.inc(accepted - self._draft_counts[1])
        self._draft_counts = (proposed, accepted)
        for out in outputs:
            state = self._running.get(out.req_id)
            if state is None or state.finished:
                continue
            try:
                self._process_one(state, out, now)
            except Exception as e:  # noqa: BLE001 - one request's output failed: it alone is finished
                log.exception("output of %s failed; finishing it", state.id)
                self._safe_runner_abort(state.id)
                self._finish(state, "error", error=f"engine error: {type(e).__name__}: {e}")

    def _process_one(self, state: _RequestState, out: StepOutput, now: float) -> None:
        state.num_runner_outputs += 1
        if state.num_runner_outputs == 1:
            self._count_cached(state, out.num_cached_tokens)
        if out.num_draft_tokens:
            # A speculative decode step (not a prefill, not a plain step), where accepted
            # drafts + 1 tokens were committed.
            self._log_steps += 1
            self._log_accepted += out.num_accepted_drafts
            self.metrics.spec_decode_num_steps.inc()
            self.metrics.spec_decode_acceptance_length.observe(out.num_accepted_drafts + 1)
        if state.first_token_s is None and out.token_ids:
            state.first_token_s = now
            self.metrics.time_to_first_token_s.observe(now - state.arrival_s)
            self._log_ttfts_s.append(now - state.arrival_s)
        self._consume(state, out)

    def _count_cached(self, state: _RequestState, cached: int) -> None:
        """A request's first output says how much of its prompt the prefix cache held."""
        state.num_cached_tokens = cached
        if self.runner.prefix_cache is not None:
            self.metrics.prefix_cache_queries.inc(len(state.prompt_ids))
            self.metrics.prefix_cache_hits.inc(cached)
            self._log_prompt_tokens += len(state.prompt_ids)
            self._log_cached_tokens += cached

    def _consume(self, state: _RequestState, out: StepOutput) -> None:
        """Apply max_tokens, stop token ids and stop strings to one step's tokens; stream the text."""
        p = state.params
        visible: list[int] = []
        finish_reason = None
        num_new = 0
        if out.prompt_logprobs is not None:
            state.prompt_lps = out.prompt_logprobs
        for tok in out.token_ids:
            num_new += 1
            state.num_output_tokens += 1
            if tok in state.stop_token_ids:
                finish_reason = "stop"  # the stop token itself is not part of the text
                break
            visible.append(tok)
            if state.num_output_tokens >= p.max_tokens:
                finish_reason = "length"
                break
        if finish_reason is None and out.finished:
            finish_reason = out.finish_reason or "stop"
        self._log_tokens += num_new
        self.metrics.generation_tokens.inc(num_new)
        if out.logprobs is not None:
            state.unsent_ids += visible
            state.unsent_lps += out.logprobs[:len(visible)]

        state.text += state.detokenizer.add(visible)
        if finish_reason is not None:
            state.text += state.detokenizer.flush()
        min_tokens = p.controls.min_tokens if p.controls is not None else 0
        if p.stop and state.num_output_tokens >= min_tokens:
            # Only the new text (plus the longest stop's length) can hold a new match.
            search_from = max(0, state.emitted_chars - max(len(s) for s in p.stop))
            hits = [i for i in (state.text.find(s, search_from) for s in p.stop) if i >= 0]
            if hits:
                state.text = state.text[:min(hits)]
                finish_reason = "stop"

        if finish_reason is None:
            # Hold back a tail that may be the start of a stop string, so none is ever streamed.
            end = len(state.text) - _stop_prefix_overlap(state.text, p.stop)
            if end > state.emitted_chars:
                self._emit(state, Delta(text=state.text[state.emitted_chars:end], num_new_tokens=num_new))
                state.emitted_chars = end
            return
        if not out.finished:
            # We stopped it (stop string, or a stop token the runner did not see): free its slots now.
            self._safe_runner_abort(state.id)
        self._finish(state, finish_reason, num_new_tokens=num_new)

    def _finish(self, state: _RequestState, finish_reason: str, *, num_new_tokens: int = 0,
                error: str | None = None, error_status: int = 500) -> None:
        if state.finished:
            return
        state.finished = True
        self._running.pop(state.id, None)
        self._emit(state, Delta(text=state.text[state.emitted_chars:], num_new_tokens=num_new_tokens,
                                finish_reason=finish_reason, prompt_tokens=len(state.prompt_ids),
                                completion_tokens=state.num_output_tokens,
                                cached_tokens=state.num_cached_tokens, error=error, error_status=error_status))
        state.emitted_chars = len(state.text)
        self.metrics.request_finished(state.endpoint, finish_reason)
        self.metrics.request_latency_s.observe(time.monotonic() - state.arrival_s)
        self._log_finished += 1
        with self._cv:  # last: a drain may end once this reaches zero
            self._num_unfinished -= 1

    def _emit(self, state: _RequestState, delta: Delta) -> None:
        if state.params.controls is not None and state.params.controls.logprobs is not None:
            delta.token_ids, delta.logprobs = state.unsent_ids, state.unsent_lps
            state.unsent_ids, state.unsent_lps = [], []
        delta.prompt_logprobs, state.prompt_lps = state.prompt_lps, None
        self._outbox.append((state.loop, state.queue, delta))

    def _deliver(self) -> None:
        """Hand this iteration's deltas to the event loop: one wake-up per loop per step, not one
        per request (each call_soon_threadsafe writes to the loop's self-pipe)."""
        if not self._outbox:
            return
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, Delta]]] = {}
        for loop, queue, delta in self._outbox:
            by_loop.setdefault(loop, []).append((queue, delta))
        self._outbox = []
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # the event loop is closed (shutdown): nobody is listening
                pass

    @staticmethod
    def _call_on_loop(state: _RequestState, fn, *args) -> None:
        try:
            state.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the event loop is closed (shutdown)
            pass

    def _safe_runner_abort(self, req_id: str) -> None:
        try:
            self.runner.abort(req_id)
        except KeyError:  # the runner already retired it
            pass

    def _publish_gauges(self) -> None:
        self._num_running_published = len(self._running)
        self.metrics.num_requests_running.set(len(self._running))
        self.metrics.num_requests_waiting.set(len(self._waiting))
        blocked = self._head_blocked_since
        self.metrics.queue_head_wait_s.set(0.0 if blocked is None else time.monotonic() - blocked)
        stalled = self.stalled
        self.metrics.admission_stalled.set(float(stalled))
        if stalled != self._stall_logged:
            self._stall_logged = stalled
            if stalled:
                log.warning("admission stalled: the queue's head has waited %.0f s while no step ran (%d of %d KV "
                            "slots free, %d requests holding a row); /ready answers 503",
                            self.stalled_for_s, self.runner.num_free_slots, self.capacity_slots,
                            self.runner.num_running)
            else:
                log.info("admission moves again; /ready answers 200")
        if self.capacity_slots:
            self.metrics.kv_slot_usage.set(1.0 - self.runner.num_free_slots / self.capacity_slots)
        if self.runner.prefix_cache is not None:
            self.metrics.prefix_cache_slots.set(self.runner.prefix_cache.cached_slots)

    def _maybe_log(self) -> None:
        now = time.monotonic()
        elapsed_s = now - self._log_last_s
        if elapsed_s < self.log_interval_s:
            return
        rejected = self.metrics.rejected_total()
        errors = rejected - self._log_rejected_before
        if self._log_tokens or self._running or self._waiting or errors or self._log_finished:
            tok_per_s = self._log_tokens / elapsed_s
            kv_usage = 1.0 - self.runner.num_free_slots / self.capacity_slots if self.capacity_slots else 0.0
            self.metrics.generation_throughput.set(tok_per_s)
            adaptive = ""
            if self.runner.policy is not None:
                snap = self.runner.policy.snapshot()
                rates = ",".join(f"{r:.2f}" for r in snap["acceptance_rates"].get("chain", []))
                adaptive = f" shape={snap['shape']} chain_accept=[{rates}]"
            # Without a draft every step commits one token: no acceptance length to report.
            accept = (f" accept_len={1.0 + self._log_accepted / self._log_steps:.2f}"
                      if self.runner.draft is not None and self._log_steps else "")
            prefix = ""
            if self.runner.prefix_cache is not None and self._log_prompt_tokens:
                hit_rate = self._log_cached_tokens / self._log_prompt_tokens
                self.metrics.prefix_cache_hit_rate.set(hit_rate)
                prefix = f" prefix_hit={100 * hit_rate:.1f}%"
            # Over the interval: finished requests per second, refused ones (4xx / 5xx, the
            # rejected-requests metric) and the median time to first token of those that began.
            ttfts = sorted(self._log_ttfts_s)
            ttft = f"{ttfts[(len(ttfts) - 1) // 2]:.3f}s" if ttfts else "-"
            log.info("decode: running=%d queued=%d req/s=%.2f errors=%d ttft_p50=%s gen_tok/s=%.1f%s%s%s "
                     "kv_usage=%.1f%%", len(self._running), len(self._waiting), self._log_finished / elapsed_s,
                     errors, ttft, tok_per_s, accept, adaptive, prefix, 100 * kv_usage)
        else:
            self.metrics.generation_throughput.set(0.0)
        self._log_last_s, self._log_tokens, self._log_steps, self._log_accepted = now, 0, 0, 0
        self._log_prompt_tokens = self._log_cached_tokens = 0
        self._log_finished, self._log_ttfts_s, self._log_rejected_before = 0, [], rejected


def _put_all(items: list[tuple[asyncio.Queue, Delta]]) -> None:
    for queue, delta in items:
        queue.put_nowait(delta)


def _stop_prefix_overlap(text: str, stops: list[str]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of some stop string."""
    best = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:n]):
                best = n
                break
    return best
