"""Connection and request limits: what one client can hold of the server.

- **Headers** must arrive within `header_timeout_s` of a connection opening (or of the previous
  response on a kept-alive one): a client that opens connections and sends nothing, or a byte at
  a time (slowloris), is cut off. uvicorn has no such timer, so `BoundedH11Protocol` adds one to
  its h11 protocol (`bounded_h11_protocol`).
- **Bodies** are capped in size (413: at once from Content-Length, else when the count passes
  the cap; never read past it) and must arrive within `body_timeout_s` of the headers (408).
  (Starlette's RequestBodyLimitMiddleware would do the first, but answers in its own words.)
- **Concurrency**: at most `max_concurrent_requests` requests are in the server at once (being
  read, tokenized, queued or streamed); the next gets 429 with Retry-After. The probes and
  /metrics are not counted and never refused, so /health answers under any one client's load.

The queue's own 429 (Scheduler.submit) carries the same Retry-After. JSON bodies are parsed in a
worker thread with the cyclic collector paused (`parse_json_body`), not on the event loop.
"""

from __future__ import annotations

import asyncio
import gc
import json
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:  # the CLI's parser imports this module's defaults: the standard library only at import
    from starlette.responses import Response
    from starlette.types import ASGIApp, Message, Receive, Scope, Send

# What a 429 tells a client to wait, in seconds (whole seconds: RFC 9110's delay-seconds).
RETRY_AFTER_S = 1
# Never refused nor counted: Kubernetes' probes and Prometheus' scrape.
UNCOUNTED_PATHS = frozenset({"/health", "/ready", "/metrics"})
DEFAULT_MAX_BODY_BYTES = 8 << 20
DEFAULT_HEADER_TIMEOUT_S = 10.0
DEFAULT_BODY_TIMEOUT_S = 60.0
# /ready turns 503 when the queue's head has waited this long while the engine computed nothing.
DEFAULT_STALL_TIMEOUT_S = 60.0
# Without --max-concurrent-requests: this many per request the scheduler can run or queue, at least the floor.
CONCURRENT_PER_SCHEDULED_REQUEST = 2
MIN_CONCURRENT_REQUESTS = 64


@dataclass
class ConnectionLimits:
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S
    max_concurrent_requests: int | None = None  # None: from the scheduler's limits (concurrency_for)


def concurrency_for(max_running_requests: int, max_queued_requests: int) -> int:
    """The default cap: room for every request the scheduler can hold, twice over (requests being
    read or tokenized, streams finishing), and never fewer than MIN_CONCURRENT_REQUESTS."""
    return max(MIN_CONCURRENT_REQUESTS,
               CONCURRENT_PER_SCHEDULED_REQUEST * (max_running_requests + max_queued_requests))


class RequestLimitsMiddleware:
    """The concurrency cap (429 + Retry-After), the body's size cap (413) and its read deadline
    (408), as plain ASGI so that a refused request costs no routing. `cap()` is read per request
    (the default comes from the scheduler, which exists only once loading finished);
    `refuse(status, message)` is the response a refused request gets (the API's error shape).
    Past the headers, a refusal is raised from `receive` as an HTTPException, which the app
    answers the same way."""

    def __init__(self, app: ASGIApp, limits: ConnectionLimits, cap: Callable[[], int | None],
                 refuse: Callable[[int, str], Response]) -> None:
        self.app, self.limits, self.cap, self.refuse = app, limits, cap, refuse
        self.in_flight = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in UNCOUNTED_PATHS:
            return await self.app(scope, receive, send)
        cap = self.cap()
        if cap is not None and self.in_flight >= cap:
            response = self.refuse(429, f"too many requests in the server ({self.in_flight}, the limit is {cap}); "
                                        "retry later")
            return await response(scope, receive, send)
        if _content_length(scope) > self.limits.max_body_bytes:
            return await self.refuse(413, self.too_large())(scope, receive, send)
        self.in_flight += 1
        try:
            await self.app(scope, self._bounded(receive), send)
        finally:
            self.in_flight -= 1

    def too_large(self) -> str:
        return f"the request body is larger than this server takes ({self.limits.max_body_bytes} bytes)"

    def _bounded(self, receive: Receive) -> Receive:
        from starlette.exceptions import HTTPException

        deadline = time.monotonic() + self.limits.body_timeout_s
        body_done, received = False, 0

        async def bounded_receive() -> Message:
            nonlocal body_done, received
            if body_done:  # after the body only a disconnect can come: no deadline for that wait
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(deadline - time.monotonic(), 0.001))
            except asyncio.TimeoutError:
                raise HTTPException(408, f"the request body did not arrive within {self.limits.body_timeout_s:g} s") \
                    from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limits.max_body_bytes:
                    raise HTTPException(413, self.too_large())
            if message["type"] != "http.request" or not message.get("more_body", False):
                body_done = True
            return message
        return bounded_receive


def _content_length(scope: Scope) -> int:
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:  # h11 refuses these before a request starts; 0 lets the count decide
                return 0
    return 0


# Below these sizes work is done on the event loop: microseconds, less than the hop to a thread,
# and it never queues behind another client's long prompt in the thread pool.
INLINE_BODY_BYTES = 64 << 10
INLINE_TEXT_CHARS = 8192


async def off_loop(fn, *args, inline: bool = False):
    """fn(*args) in a worker thread, or here when `inline` (the work is small)."""
    return fn(*args) if inline else await asyncio.to_thread(fn, *args)


_gc_lock = threading.Lock()
_gc_pausers = 0      # guarded by _gc_lock: parses under way
_gc_was_enabled = True


def parse_json_body(body: bytes):
    """json.loads with the cyclic garbage collector paused: a body of many small containers
    (6 MB of `[], [], ...`) makes the collector run over and over while they are created, 2 s
    instead of 0.3 s with the GIL held. Bodies are capped (max_body_bytes), so is what accrues."""
    global _gc_pausers, _gc_was_enabled
    with _gc_lock:
        if _gc_pausers == 0:
            _gc_was_enabled = gc.isenabled()
            gc.disable()
        _gc_pausers += 1
    try:
        return json.loads(body)
    finally:
        with _gc_lock:
            _gc_pausers -= 1
            if _gc_pausers == 0 and _gc_was_enabled:
                gc.enable()


def bounded_h11_protocol(header_timeout_s: float) -> type:
    """uvicorn's h11 protocol with a deadline for a request's headers: the timer runs from the
    connection's start (and, on a kept-alive connection, from the next request's first byte)
    until the headers are complete, and closes the connection when it fires first. Idle time
    between requests is uvicorn's keep-alive timeout's."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class BoundedH11Protocol(H11Protocol):
        def connection_made(self, transport) -> None:  # type: ignore[override]
            self._header_timer: asyncio.TimerHandle | None = None
            super().connection_made(transport)
            self._arm_header_timer()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.conn.their_state is h11.IDLE:  # headers incomplete: the clock runs
                self._arm_header_timer()
            else:
                self._cancel_header_timer()

        def on_response_complete(self) -> None:
            self._cancel_header_timer()
            super().on_response_complete()

        def connection_lost(self, exc) -> None:
            self._cancel_header_timer()
            super().connection_lost(exc)

        def _arm_header_timer(self) -> None:
            if self._header_timer is None and not self.transport.is_closing():
                self._header_timer = self.loop.call_later(header_timeout_s, self._headers_too_slow)

        def _cancel_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_too_slow(self) -> None:
            self._header_timer = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.logger.info("closing a connection whose request headers did not arrive within %g s",
                                 header_timeout_s)
                self.transport.close()

    return BoundedH11Protocol
