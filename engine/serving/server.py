"""The engine's HTTP face: an OpenAI-compatible API, health/readiness probes and Prometheus metrics.

This module only translates: JSON in → (prompt ids, SamplingParams) → Scheduler → JSON/SSE out.
Everything about batching lives in the scheduler, everything about tensors in the runner.

Roles (docs/disaggregation.md): a "decode" server takes OpenAI requests only with the header
that names their prefill server (the router sets it) and a "prefill" server takes none; both
answer /disagg/info (the handshake) and /disagg/status (load, for the router); a prefill server
also serves /disagg/prefill and /disagg/abort (engine/serving/disagg/prefill.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid

import uvicorn
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Literal, Union

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ConfigDict, Field

from specdeploy.engine.serving.disagg.protocol import PREFILL_URL_HEADER, AbortBody, PrefillBody
from specdeploy.engine.serving.metrics import EngineMetrics
from specdeploy.engine.serving.scheduler import Delta, RequestHandle, SamplingParams, Scheduler, SchedulerError
from specdeploy.engine.serving.tokenizer import ChatTemplateError, Tokenizer

log = logging.getLogger("specdeploy.server")

# How often a non-streaming request checks whether its client is still there.
_DISCONNECT_POLL_S = 0.25
# OpenAI's default for /v1/completions.
_DEFAULT_COMPLETION_MAX_TOKENS = 16
# Names pydantic puts into an error's location for the member of a union it tried.
_TYPE_TAGS = {"str", "int", "float", "bool", "none", "list", "dict"}
# `code` of the errors Starlette raises before a route runs.
_HTTP_CODES = {400: "invalid_body", 404: "not_found", 405: "method_not_allowed"}
# Refusals the scheduler counts in the rejected-requests metric itself.
_COUNTED_BY_SCHEDULER = {"queue_full", "draining"}


class APIError(Exception):
    """An error answered in OpenAI's format: {"error": {"message", "type", "param", "code"}}."""

    _TYPES = {400: "invalid_request_error", 404: "invalid_request_error", 405: "invalid_request_error",
              429: "rate_limit_error",
              500: "internal_error", 503: "service_unavailable"}

    def __init__(self, status_code: int, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status_code, self.message, self.param, self.code = status_code, message, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self._TYPES.get(self.status_code, "error"),
                          "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status_code)


# ---- request bodies ------------------------------------------------------------------------
# strict: OpenAI rejects "max_tokens": "10"; so do we. Unknown fields are ignored (clients send
# `user`, `logit_bias`, ... that change nothing here).

class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False


class _SamplingFields(_Body):
    model: str
    # None: the model's generation_config.json default, else OpenAI's (1.0, 1.0, off).
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)  # 0 and -1 both mean off
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=1)
    # Accepted so that clients sending the defaults work; anything else is refused, not ignored.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0


class CompletionBody(_SamplingFields):
    prompt: Union[str, list[int], list[str], list[list[int]]]
    max_tokens: int | None = Field(_DEFAULT_COMPLETION_MAX_TOKENS, ge=1)
    echo: bool = False
    logprobs: int | None = None


class ContentPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")  # templates may read name, tool_calls, ...
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None


class ChatBody(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(BaseModel):
    """OpenAI's error shape, the body of every 4xx/5xx this API answers."""

    error: ErrorDetail


# What /openapi.json documents beside a 200, so that clients and schema-driven tools know every
# status the API answers: request errors are 400 (never FastAPI's 422: see _validation_error).
def _errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    text = {400: "Invalid request", 404: "Unknown model", 429: "Queue full, retry later",
            503: "Not ready (loading weights) or draining",
            409: "Aborted (or the room is in use)", 502: "The transfer to the decode server failed",
            504: "The prefill outlasted the request's deadline"}
    return {code: {"model": ErrorBody, "description": text[code]} for code in codes}


# The disaggregation routes (docs/disaggregation.md); 404: a server of another role.
_DISAGG_INFO_RESPONSES = _errors(404, 503)
_DISAGG_PREFILL_RESPONSES = _errors(400, 404, 409, 502, 503, 504)
_DISAGG_ABORT_RESPONSES = _errors(400, 404, 503)

_GENERATION_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"description": "The completion; with stream=true, server-sent events (data: chunk, then data: [DONE])",
          "content": {"application/json": {}, "text/event-stream": {}}},
    **_errors(400, 404, 429, 503),
}


def _openapi_without_422(app: FastAPI) -> dict[str, Any]:
    """FastAPI's schema, less the 422 it documents for every route with parameters: this API
    answers invalid requests with 400 in OpenAI's error shape instead."""
    if app.openapi_schema is None:
        from fastapi.openapi.utils import get_openapi

        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        for operations in schema.get("paths", {}).values():
            for operation in operations.values():
                operation.get("responses", {}).pop("422", None)
        for name in ("HTTPValidationError", "ValidationError"):
            schema.get("components", {}).get("schemas", {}).pop(name, None)
        app.openapi_schema = schema
    return app.openapi_schema


# ---- the app -------------------------------------------------------------------------------

@dataclass
class EngineState:
    """What the routes need; `scheduler` and `tokenizer` arrive when loading finishes."""

    model_name: str
    metrics: EngineMetrics
    tokenizer: Tokenizer | None = None
    scheduler: Scheduler | None = None
    not_ready_reason: str = "loading weights"
    started_s: int = field(default_factory=lambda: int(time.time()))
    role: str = "both"
    disagg: Any = None  # PrefillService | DecodeService once loaded, for the split roles

    @property
    def ready(self) -> bool:
        return self.scheduler is not None and not self.scheduler.draining


# -> (scheduler, tokenizer) or, for the split roles, (scheduler, tokenizer, disaggregation service)
Loader = Callable[[EngineMetrics], tuple]


def create_app(state: EngineState, loader: Loader | None = None,
               on_load_failure: Callable[[BaseException], None] | None = None) -> FastAPI:
    """Build the app. With `loader`, it runs in a worker thread after start-up, so /health answers
    (and the pod is not killed) while weights load and graphs are captured; /ready turns 200 after."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        load_task = None
        if loader is not None:
            async def load():
                try:
                    scheduler, tokenizer, *service = await asyncio.to_thread(loader, state.metrics)
                except Exception as e:
                    state.not_ready_reason = f"loading failed: {e}"
                    if on_load_failure is None:
                        log.exception("loading failed")
                    else:  # it reports the failure (engine/serving/startup.py: one line)
                        on_load_failure(e)
                    return
                state.tokenizer = tokenizer
                state.disagg = service[0] if service else None
                scheduler.start()
                state.scheduler = scheduler
                log.info("ready: serving %s", state.model_name)
            load_task = asyncio.create_task(load())
        elif state.scheduler is not None and not state.scheduler.started:
            state.scheduler.start()
        yield
        if load_task is not None and not load_task.done():
            load_task.cancel()
        if state.disagg is not None and hasattr(state.disagg, "close"):
            await state.disagg.close()
        if state.scheduler is not None:
            state.scheduler.shutdown()

    app = FastAPI(title="specdeploy engine", lifespan=lifespan)
    app.state.engine = state
    app.openapi = lambda: _openapi_without_422(app)

    def refused(request: Request, error: APIError) -> JSONResponse:
        """Every refused request: one INFO line and the rejected-requests metric by its code (the
        scheduler counts and logs its own 429 / 503 refusals, once per interval under overload)."""
        if error.code not in _COUNTED_BY_SCHEDULER:
            state.metrics.request_rejected(error.code or str(error.status_code))
            log.info("%s %s -> %d %s: %s", request.method, request.url.path, error.status_code,
                     error.code or "", error.message)
        return error.response()

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return refused(request, exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        # Starlette's own refusals (no such route, wrong method, an unreadable body) in the same
        # error shape as ours, with their headers (a 405 says Allow).
        response = refused(request, APIError(exc.status_code, str(exc.detail), code=_HTTP_CODES.get(exc.status_code)))
        response.headers.update(exc.headers or {})
        return response

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        if first.get("type") == "json_invalid":
            return refused(request, APIError(400, f"the body is not valid JSON: {first.get('ctx', {}).get('error', '')}",
                                             code="invalid_json"))
        # loc is ("body", field, index | nested field | union member tag, ...): the top-level field
        # is the param; the path without pydantic's union tags ("str", "list[int]") goes in the message.
        loc = [str(x) for x in first.get("loc", ())[1:]
               if not (isinstance(x, str) and (x in _TYPE_TAGS or "[" in x))]
        param = loc[0] if loc else None
        message = first.get("msg", "invalid value")
        if len(loc) < len(first.get("loc", ())) - 1:  # a union: say what it got, not one member's complaint
            message = f"has the wrong type ({type(first.get('input')).__name__})"
        return refused(request, APIError(400, f"{'.'.join(loc) or 'body'}: {message}", param=param,
                                         code="invalid_value"))

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/ready", responses={503: {"description": "Loading weights, or draining",
                                         "content": {"application/json": {}}}})
    async def ready():
        if state.ready:
            return {"status": "ready"}
        reason = "draining" if state.scheduler is not None else state.not_ready_reason
        return JSONResponse({"status": "not ready", "reason": reason}, status_code=503)

    @app.get("/metrics", response_class=PlainTextResponse,
             responses={200: {"content": {CONTENT_TYPE_LATEST.split(";")[0]: {}},
                              "description": "Prometheus text exposition format"}})
    async def metrics():
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    def model_card() -> dict[str, Any]:
        return {"id": state.model_name, "object": "model", "created": state.started_s, "owned_by": "specdeploy",
                "max_model_len": state.scheduler.context_length if state.scheduler else None}

    @app.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model:path}", responses=_errors(404))
    async def get_model(model: str):
        check_model(model)
        return model_card()

    def check_model(model: str) -> None:
        if model != state.model_name:
            raise APIError(404, f"the model '{model}' does not exist; this server serves '{state.model_name}'",
                           param="model", code="model_not_found")

    def serving() -> tuple[Scheduler, Tokenizer]:
        if state.scheduler is None or state.tokenizer is None:
            raise APIError(503, f"the server is not ready ({state.not_ready_reason})", code="not_ready")
        if state.scheduler.draining:
            raise APIError(503, "the server is shutting down", code="draining")
        return state.scheduler, state.tokenizer

    def prefill_url(request: Request) -> str | None:
        """The prefill server a decode server's request names; refuses what this role cannot serve."""
        url = request.headers.get(PREFILL_URL_HEADER)
        if state.role == "prefill":
            raise APIError(400, "this is a prefill server: send requests to the router", code="wrong_role")
        if state.role == "decode" and not url:
            raise APIError(400, f"this is a decode server: send requests to the router (no {PREFILL_URL_HEADER})",
                           code="wrong_role")
        if state.role == "both" and url:
            raise APIError(400, f"{PREFILL_URL_HEADER} given to a server that is not --role decode",
                           code="wrong_role")
        if url is not None and not url.startswith(("http://", "https://")):
            raise APIError(400, f"{PREFILL_URL_HEADER}: not an http(s) URL", code="wrong_role")
        return url

    def disagg_service(role: str):
        if state.role != role:
            raise APIError(404, f"this is a {state.role!r} server, not a {role} server", code="wrong_role")
        if state.disagg is None:
            raise APIError(503, f"the server is not ready ({state.not_ready_reason})", code="not_ready")
        return state.disagg

    @app.get("/disagg/info", responses=_DISAGG_INFO_RESPONSES)
    async def disagg_info():
        if state.role == "both":
            raise APIError(404, "this server runs prefill and decode itself (--role both)", code="wrong_role")
        return disagg_service(state.role).info.to_dict()

    @app.get("/disagg/status")
    async def disagg_status():
        """Load, as the router weighs it."""
        s = state.scheduler
        out: dict[str, Any] = {"role": state.role, "ready": state.ready}
        if s is not None:
            out.update(running=s._num_running_published, waiting=len(s._waiting),
                       max_running_requests=s.runner.max_running_requests,
                       free_slots=s.runner.num_free_slots, capacity_slots=s.capacity_slots)
        d = state.disagg
        if d is not None and getattr(d, "arena", None) is not None:
            out.update(staging_bytes=d.arena.nbytes, staging_free_bytes=d.arena.free_bytes)
        if state.role == "prefill" and d is not None:
            out.update(transfers=d.transfers, bytes_sent=d.bytes_sent, transfer_s=d.transfer_s)
        return out

    @app.post("/disagg/prefill", responses=_DISAGG_PREFILL_RESPONSES)
    async def disagg_prefill(body: PrefillBody):
        from specdeploy.engine.serving.disagg.prefill import PrefillRefused

        service = disagg_service("prefill")
        if state.scheduler.draining:
            raise APIError(503, "the server is shutting down", code="draining")
        try:
            return await service.prefill(body)
        except PrefillRefused as e:
            raise APIError(e.status_code, str(e), code="prefill_refused") from None

    @app.post("/disagg/abort", responses=_DISAGG_ABORT_RESPONSES)
    async def disagg_abort(body: AbortBody):
        return await disagg_service("prefill").abort(body)

    @app.post("/v1/completions", responses=_GENERATION_RESPONSES)
    async def completions(body: CompletionBody, request: Request):
        check_model(body.model)
        url = prefill_url(request)
        scheduler, tokenizer = serving()
        if body.echo:
            raise APIError(400, "echo is not supported by this server", param="echo")
        prompt_ids = completion_prompt_ids(body.prompt, tokenizer)
        max_tokens = body.max_tokens if body.max_tokens is not None else _DEFAULT_COMPLETION_MAX_TOKENS
        handle = submit(scheduler, prompt_ids, sampling_params(body, max_tokens, tokenizer), "completions", url)
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())

        def chunk(text: str, finish_reason: str | None) -> dict[str, Any]:
            return {"id": rid, "object": "text_completion", "created": created, "model": state.model_name,
                    "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}]}

        if body.stream:
            return sse_response(handle, chunk, include_usage=bool(body.stream_options and body.stream_options.include_usage))
        text, last = await collect(handle, request)
        out = chunk(text, last.finish_reason)
        out["usage"] = usage(last)
        return out

    @app.post("/v1/chat/completions", responses=_GENERATION_RESPONSES)
    async def chat_completions(body: ChatBody, request: Request):
        check_model(body.model)
        url = prefill_url(request)
        scheduler, tokenizer = serving()
        messages = [chat_message_dict(m) for m in body.messages]
        try:
            prompt_ids = tokenizer.encode_chat(messages)
        except ChatTemplateError as e:
            raise APIError(400, str(e), param="messages") from None
        max_tokens = body.max_completion_tokens or body.max_tokens
        if max_tokens is None:  # OpenAI's chat default: as much as the context and the KV pool allow
            max_tokens = max(1, scheduler.max_new_tokens(len(prompt_ids)))
        handle = submit(scheduler, prompt_ids, sampling_params(body, max_tokens, tokenizer), "chat_completions", url)
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

        def chunk(text: str, finish_reason: str | None, first: bool = False) -> dict[str, Any]:
            delta: dict[str, Any] = {"role": "assistant", "content": text} if first else {}
            if text and not first:
                delta["content"] = text
            return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": state.model_name,
                    "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]}

        if body.stream:
            return sse_response(handle, chunk, include_usage=bool(body.stream_options and body.stream_options.include_usage),
                                first_chunk=chunk("", None, first=True))
        text, last = await collect(handle, request)
        return {"id": rid, "object": "chat.completion", "created": created, "model": state.model_name,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                             "logprobs": None, "finish_reason": last.finish_reason}],
                "usage": usage(last)}

    def sse_response(handle: RequestHandle, chunk, include_usage: bool, first_chunk: dict | None = None):
        async def events() -> AsyncIterator[str]:
            finished = False
            try:
                if first_chunk is not None:
                    yield sse(first_chunk)
                async for delta in handle.deltas():
                    if delta.finish_reason is None:
                        if delta.text:
                            yield sse(chunk(delta.text, None))
                        continue
                    finished = True
                    if delta.error is not None:
                        yield sse(APIError(500, delta.error, code="engine_error").body())
                        break
                    if delta.text:
                        yield sse(chunk(delta.text, None))
                    yield sse(chunk("", delta.finish_reason))
                    if include_usage:
                        tail = chunk("", None)
                        tail["choices"] = []
                        tail["usage"] = usage(delta)
                        yield sse(tail)
                yield "data: [DONE]\n\n"
            finally:
                if not finished:  # the client went away (or the server is stopping): free its slots
                    handle.abort()

        # no-cache / no buffering: proxies must pass tokens through as they come.
        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    return app


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def usage(delta: Delta) -> dict[str, Any]:
    return {"prompt_tokens": delta.prompt_tokens, "completion_tokens": delta.completion_tokens,
            "total_tokens": delta.prompt_tokens + delta.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": delta.cached_tokens}}


def submit(scheduler: Scheduler, prompt_ids: list[int], params: SamplingParams, endpoint: str,
           prefill_url: str | None = None) -> RequestHandle:
    try:
        return scheduler.submit(prompt_ids, params, endpoint, prefill_url)
    except SchedulerError as e:
        code = {429: "queue_full", 503: "draining"}.get(e.status_code, "context_length_exceeded")
        raise APIError(e.status_code, str(e), code=code) from None


async def collect(handle: RequestHandle, request: Request) -> tuple[str, Delta]:
    """Gather a whole response; abort it if the client disconnects while it is generated."""
    parts: list[str] = []
    last: list[Delta] = []

    async def consume():
        async for delta in handle.deltas():
            parts.append(delta.text)
            last.append(delta)

    task = asyncio.ensure_future(consume())
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=_DISCONNECT_POLL_S)
            if not task.done() and await request.is_disconnected():
                handle.abort()
                await task
    finally:
        if not task.done():  # cancelled ourselves (server stopping)
            handle.abort()
            task.cancel()
    final = last[-1]
    if final.error is not None:
        raise APIError(500, final.error, code="engine_error")
    return "".join(parts), final


# What a request without temperature / top_p / top_k gets when the model's generation_config.json
# names none either (OpenAI's documented defaults; top_k 0 is off).
OPENAI_SAMPLING_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 0}


def sampling_params(body: _SamplingFields, max_tokens: int, tokenizer: Tokenizer) -> SamplingParams:
    unsupported = [name for name in ("presence_penalty", "frequency_penalty") if getattr(body, name)]
    unsupported += ["logprobs"] if getattr(body, "logprobs", None) else []
    if unsupported:
        raise APIError(400, f"{unsupported[0]} is not supported by this server", param=unsupported[0])
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if any(s == "" for s in stop):
        raise APIError(400, "stop strings must not be empty", param="stop")
    stop_token_ids = set(body.stop_token_ids or [])
    check_token_ids(stop_token_ids, tokenizer, "stop_token_ids")
    defaults = {**OPENAI_SAMPLING_DEFAULTS, **tokenizer.sampling_defaults}
    given = {name: getattr(body, name) for name in OPENAI_SAMPLING_DEFAULTS}
    chosen = {name: defaults[name] if value is None else value for name, value in given.items()}
    return SamplingParams(max_tokens=max_tokens, temperature=float(chosen["temperature"]),
                          top_p=float(chosen["top_p"]), top_k=max(int(chosen["top_k"]), 0), seed=body.seed, stop=stop,
                          stop_token_ids=stop_token_ids, ignore_eos=body.ignore_eos)


def check_token_ids(ids, tokenizer: Tokenizer, param: str) -> None:
    bad = [i for i in ids if not 0 <= i < tokenizer.vocab_size]
    if bad:
        raise APIError(400, f"{param}: token id {bad[0]} is outside the vocabulary [0, {tokenizer.vocab_size})",
                       param=param)


def completion_prompt_ids(prompt, tokenizer: Tokenizer) -> list[int]:
    # One prompt per request: a string, token ids, or a one-element batch of either.
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise APIError(400, "only one prompt per request is supported", param="prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        ids = tokenizer.encode(prompt)
    else:
        check_token_ids(prompt, tokenizer, "prompt")
        ids = list(prompt)
    if not ids:
        raise APIError(400, "the prompt is empty", param="prompt")
    return ids


def chat_message_dict(message: ChatMessage) -> dict[str, Any]:
    out = message.model_dump(exclude_none=True)
    if isinstance(message.content, list):  # OpenAI content parts: only text is understood here
        out["content"] = "".join(part.text for part in message.content)
    out.setdefault("content", "")
    return out


class DrainingServer(uvicorn.Server):
    """uvicorn, with Kubernetes-friendly termination.

    The first SIGTERM/SIGINT starts a drain: /ready answers 503 (the Service stops routing here),
    new generation requests get 503, requests already admitted or queued run to completion; when
    none is left (or `drain_timeout_s` passed) the server stops and the process exits 0.
    A second signal stops at once.
    """

    def __init__(self, config: uvicorn.Config, state: EngineState, drain_timeout_s: float = 600.0):
        super().__init__(config)
        self.state = state
        self.drain_timeout_s = drain_timeout_s
        self.exit_code = 0
        self._drain_started_s: float | None = None

    def handle_exit(self, sig: int, frame) -> None:
        # Unlike uvicorn's own handler, the signal is not re-raised after shutdown: a drained
        # server exits 0, which is what the Deployment's rollout expects.
        if self._drain_started_s is not None or self.state.scheduler is None:
            if self.should_exit:
                self.force_exit = True
            self.should_exit = True
            return
        log.info("received signal %d: draining before exit (up to %.0f s)", sig, self.drain_timeout_s)
        self._drain_started_s = time.monotonic()
        self.state.scheduler.start_drain()

    def fail(self, error: BaseException) -> None:
        """Stop with exit code 1 (loading failed: the pod should restart and say why)."""
        self.exit_code = 1
        self.should_exit = True

    async def on_tick(self, counter: int) -> bool:
        if self._drain_started_s is not None and not self.should_exit:
            waited_s = time.monotonic() - self._drain_started_s
            if self.state.scheduler.is_idle:
                log.info("drained in %.1f s; stopping", waited_s)
                self.should_exit = True
            elif waited_s > self.drain_timeout_s:
                log.warning("drain timeout (%.0f s) passed with requests still running; stopping", waited_s)
                self.should_exit = True
        return await super().on_tick(counter)
