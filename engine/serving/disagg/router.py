"""`specdeploy router`: the OpenAI front of a disaggregated deployment.

Each /v1/completions or /v1/chat/completions request goes, unchanged, to a decode server, with
the header naming the prefill server it is to use (protocol.PREFILL_URL_HEADER); the decode
server tokenizes, has the prefill server compute the prompt, and answers. The router passes the
answer through byte for byte (status, headers that matter, SSE chunks as they come, usage,
errors), so a client sees what one engine server would send. A client that goes away closes the
decode server's connection, which aborts the request there (and on its prefill server).

Backends: each --prefill / --decode URL names one server or a headless Service; its host is
resolved every refresh, and every address it resolves to is a backend (a pod). Every
`refresh_s` the router reads each backend's /disagg/status (role, running, waiting, free KV
slots); a backend that does not answer, answers not ready, or has the wrong role takes no
requests until it does. A request goes to the ready backend with the least load: requests this
router has in flight there plus its running and waiting requests, then the larger share of free
KV slots.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
import urllib.parse
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from specdeploy.engine.serving.auth import AuthMiddleware, Guard, disagg_headers
from specdeploy.engine.serving.disagg.protocol import PREFILL_URL_HEADER
from specdeploy.engine.serving.limits import (INLINE_BODY_BYTES, ConnectionLimits, RequestLimitsMiddleware, off_loop,
                                              parse_json_body)

log = logging.getLogger("specdeploy.router")

# How often a non-streaming request checks whether its client is still there.
_DISCONNECT_POLL_S = 0.25
# Response headers passed back to the client (hop-by-hop and length headers are the server's own).
_PASSED_HEADERS = ("content-type", "cache-control", "x-accel-buffering")


@dataclass
class Backend:
    url: str           # http://address:port as requests are sent
    role: str          # "prefill" | "decode"
    ready: bool = False
    running: int = 0
    waiting: int = 0
    free_slots: int = 0
    capacity_slots: int = 1
    in_flight: int = 0  # requests this router has sent there and not seen finish
    error: str | None = "not probed yet"

    def load(self) -> tuple[int, float]:
        return (self.in_flight + self.running + self.waiting, -self.free_slots / max(self.capacity_slots, 1))

    def status(self) -> dict:
        return {"url": self.url, "role": self.role, "ready": self.ready, "running": self.running,
                "waiting": self.waiting, "free_slots": self.free_slots, "in_flight": self.in_flight,
                "error": self.error}


def pick(backends: list[Backend]) -> Backend | None:
    """The ready backend with the least load (pure; ties go to the first listed)."""
    ready = [b for b in backends if b.ready]
    return min(ready, key=Backend.load) if ready else None


def expand(url: str) -> list[str]:
    """The backend URLs one --prefill/--decode URL stands for: one per address its host resolves
    to (all pods of a headless Service), in a stable order; the URL itself if it resolves to none."""
    parts = urllib.parse.urlsplit(url.rstrip("/"))
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{url}: not an http(s) URL")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        infos = socket.getaddrinfo(parts.hostname, port, type=socket.SOCK_STREAM)
    except OSError:
        return [url.rstrip("/")]
    addresses = sorted({info[4][0] for info in infos})
    hosts = [f"[{a}]" if ":" in a else a for a in addresses]
    return [f"{parts.scheme}://{h}:{port}" for h in hosts] or [url.rstrip("/")]


@dataclass
class Pools:
    prefill_urls: list[str]
    decode_urls: list[str]
    backends: dict[str, Backend] = field(default_factory=dict)

    def refresh_members(self) -> None:
        """Re-resolve the URLs: new addresses become backends, vanished ones are dropped."""
        wanted: dict[str, str] = {}
        for role, urls in (("prefill", self.prefill_urls), ("decode", self.decode_urls)):
            for url in urls:
                for member in expand(url):
                    wanted.setdefault(member, role)
        for url in list(self.backends):
            if url not in wanted:
                del self.backends[url]
        for url, role in wanted.items():
            if url not in self.backends:
                self.backends[url] = Backend(url, role)

    def of(self, role: str) -> list[Backend]:
        return [b for b in self.backends.values() if b.role == role]


def _error(status: int, message: str, code: str) -> JSONResponse:
    kind = {429: "rate_limit_error", 503: "service_unavailable", 502: "bad_gateway",
            400: "invalid_request_error", 408: "invalid_request_error", 413: "invalid_request_error"}.get(status, "error")
    return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": code}},
                        status_code=status)


def create_app(prefill_urls: list[str], decode_urls: list[str], *, refresh_s: float = 1.0,
               timeout_s: float = 600.0, guard: Guard | None = None) -> FastAPI:
    """`guard`: the clients' API keys and the secret the router shows its backends (serving/auth.py)."""
    pools = Pools(list(prefill_urls), list(decode_urls))
    client = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=5.0))
    counters = {"requests": 0, "errors": 0}

    async def probe(backend: Backend) -> None:
        try:
            r = await client.get(f"{backend.url}/disagg/status", timeout=min(refresh_s * 2, 5.0),
                                 headers=disagg_headers(guard))
            data = r.json()
        except (httpx.HTTPError, ValueError) as e:
            backend.ready, backend.error = False, f"{type(e).__name__}: {e}"
            return
        if data.get("role") != backend.role:
            backend.ready, backend.error = False, f"role is {data.get('role')!r}, expected {backend.role!r}"
            return
        backend.ready = bool(data.get("ready"))
        backend.error = None if backend.ready else "not ready"
        backend.running, backend.waiting = int(data.get("running", 0)), int(data.get("waiting", 0))
        backend.free_slots, backend.capacity_slots = int(data.get("free_slots", 0)), int(data.get("capacity_slots", 1))

    async def refresh() -> None:
        await asyncio.to_thread(pools.refresh_members)
        await asyncio.gather(*(probe(b) for b in list(pools.backends.values())))

    async def refresher() -> None:
        while True:
            try:
                await refresh()
            except Exception:
                log.exception("backend refresh failed")
            await asyncio.sleep(refresh_s)

    @asynccontextmanager
    async def lifespan(app):
        await refresh()
        task = asyncio.create_task(refresher())
        yield
        task.cancel()
        await client.aclose()

    app = FastAPI(title="specdeploy router", lifespan=lifespan)
    app.state.pools = pools
    # The engine's body cap and body deadline (limits.py); concurrency is the engines' to refuse.
    app.add_middleware(RequestLimitsMiddleware, limits=ConnectionLimits(), cap=lambda: None,
                       refuse=lambda status, message: _error(status, message, "body_too_large"))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        # A body cut off by the limits (408, 413) or Starlette's own refusals, in OpenAI's shape.
        codes = {408: "body_timeout", 413: "body_too_large", 404: "not_found", 405: "method_not_allowed"}
        response = _error(exc.status_code, str(exc.detail), codes.get(exc.status_code, "invalid_request"))
        response.headers.update(exc.headers or {})
        return response

    if guard is not None:  # added last: the outermost, so an unauthenticated body is never read
        app.add_middleware(AuthMiddleware, guard=guard)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/ready")
    async def ready():
        if pick(pools.of("prefill")) and pick(pools.of("decode")):
            return {"status": "ready"}
        return JSONResponse({"status": "not ready", "reason": "no ready prefill and decode server"},
                            status_code=503)

    @app.get("/status")
    async def status():
        return {"backends": [b.status() for b in pools.backends.values()], **counters}

    @app.get("/metrics")
    async def metrics():
        lines = ["# TYPE specdeploy_router_requests_total counter",
                 f"specdeploy_router_requests_total {counters['requests']}",
                 "# TYPE specdeploy_router_errors_total counter",
                 f"specdeploy_router_errors_total {counters['errors']}",
                 "# TYPE specdeploy_router_backend_ready gauge"]
        lines += [f'specdeploy_router_backend_ready{{role="{b.role}",url="{b.url}"}} {int(b.ready)}'
                  for b in pools.backends.values()]
        lines += ["# TYPE specdeploy_router_backend_in_flight gauge"]
        lines += [f'specdeploy_router_backend_in_flight{{role="{b.role}",url="{b.url}"}} {b.in_flight}'
                  for b in pools.backends.values()]
        return Response("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        decode = pick(pools.of("decode"))
        if decode is None:
            return _error(503, "no decode server is ready", "not_ready")
        r = await client.get(f"{decode.url}/v1/models", headers=disagg_headers(guard))
        return Response(r.content, status_code=r.status_code, media_type=r.headers.get("content-type"))

    async def forward(request: Request, path: str):
        counters["requests"] += 1
        raw = await request.body()
        try:
            parsed = await off_loop(parse_json_body, raw, inline=len(raw) <= INLINE_BODY_BYTES)
            stream = bool(parsed.get("stream", False))
        except (ValueError, AttributeError):
            stream = False  # the decode server answers the malformed body with its own 400
        prefill, decode = pick(pools.of("prefill")), pick(pools.of("decode"))
        if prefill is None or decode is None:
            counters["errors"] += 1
            missing = "prefill" if prefill is None else "decode"
            return _error(503, f"no {missing} server is ready; retry later", "not_ready")
        headers = {"content-type": request.headers.get("content-type", "application/json"),
                   PREFILL_URL_HEADER: prefill.url, **disagg_headers(guard)}
        if "authorization" in request.headers:
            headers["authorization"] = request.headers["authorization"]
        upstream = client.build_request("POST", f"{decode.url}{path}", content=raw, headers=headers)
        prefill.in_flight += 1
        decode.in_flight += 1

        def done() -> None:
            prefill.in_flight -= 1
            decode.in_flight -= 1

        try:
            response = await client.send(upstream, stream=True)
        except httpx.HTTPError as e:
            done()
            counters["errors"] += 1
            decode.ready, decode.error = False, f"{type(e).__name__}: {e}"
            return _error(503, f"decode server {decode.url} unreachable: {type(e).__name__}", "backend_unavailable")
        passed = {k: v for k, v in response.headers.items() if k.lower() in _PASSED_HEADERS}
        if response.status_code >= 400:
            counters["errors"] += 1
        if stream and response.status_code == 200:
            async def body():
                try:
                    async for chunk in response.aiter_raw():
                        yield chunk
                finally:  # the client went away, or the stream ended: either way let go upstream
                    await response.aclose()
                    done()
            return StreamingResponse(body(), status_code=response.status_code, headers=passed)
        read = asyncio.ensure_future(response.aread())
        try:
            while not read.done():
                await asyncio.wait({read}, timeout=_DISCONNECT_POLL_S)
                if not read.done() and await request.is_disconnected():
                    read.cancel()  # closing the upstream connection aborts the request there
                    break
            content = await read
        except asyncio.CancelledError:
            return Response(status_code=499)
        except httpx.HTTPError as e:
            counters["errors"] += 1
            return _error(502, f"decode server {decode.url} failed mid-answer: {type(e).__name__}", "backend_failed")
        finally:
            await response.aclose()
            done()
        return Response(content, status_code=response.status_code, headers=passed)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await forward(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await forward(request, "/v1/chat/completions")

    return app


class RouterThread:
    """The router in a background thread of this process (tests)."""

    def __init__(self, prefill_urls, decode_urls, port: int, host: str = "127.0.0.1", refresh_s: float = 0.2,
                 guard: Guard | None = None):
        import threading

        import uvicorn

        self.app = create_app(prefill_urls, decode_urls, refresh_s=refresh_s, guard=guard)
        self.server = uvicorn.Server(uvicorn.Config(self.app, host=host, port=port, log_config=None))
        self.base_url = f"http://{host}:{port}"
        self._thread = threading.Thread(target=self.server.run, name="router", daemon=True)

    def start(self, timeout_s: float = 30.0) -> RouterThread:
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.base_url}/ready", timeout=2).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        raise TimeoutError(f"the router was not ready after {timeout_s} s")

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join(timeout=30)
