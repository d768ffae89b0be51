"""The engine's HTTP face: an OpenAI-compatible API, health/readiness probes and Prometheus metrics.

This module only translates: JSON in → (prompt ids, SamplingParams) → Scheduler → JSON/SSE out.
Everything about batching lives in the scheduler, everything about tensors in the runner. What a
request may ask is bounded before it reaches the scheduler (fields.py), what a client may hold
of the server by limits.py; large bodies are parsed and long prompts encoded off the event loop,
so /health answers under any one client's load (docs/engine.md, "Hostile and careless clients").

Roles (docs/disaggregation.md): a "decode" server takes OpenAI requests only with the header
that names their prefill server (the router sets it) and a "prefill" server takes none; both
answer /disagg/info (the handshake) and /disagg/status (load, for the router); a prefill server
also serves /disagg/register, /disagg/prefill and /disagg/abort (engine/serving/disagg/prefill.py).
Who may call which route is serving/auth.py's (a middleware).
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
from fastapi.routing import APIRoute
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ConfigDict, Field, field_validator

from specdeploy.engine.models.checkpoint import LoadProgress
from specdeploy.engine.serving.auth import AuthMiddleware, Guard
from specdeploy.engine.serving.disagg.protocol import PREFILL_URL_HEADER, AbortBody, PrefillBody, RegisterBody
from specdeploy.engine.serving.fields import (INT64_MAX, INT64_MIN, MAX_CHAT_MESSAGES, MAX_CONTENT_PARTS,
                                              MAX_STOP_SEQUENCES, MAX_STOP_TOKEN_IDS, MIN_SAMPLING_TEMPERATURE,
                                              check_list_length, check_prompt_shape, lone_surrogate,
                                              refused_field, stop_problem)
from specdeploy.engine.serving.limits import (MIN_CONCURRENT_REQUESTS, RETRY_AFTER_S, ConnectionLimits,
                                              INLINE_BODY_BYTES, INLINE_TEXT_CHARS, RequestLimitsMiddleware,
                                              concurrency_for, off_loop, parse_json_body)
from specdeploy.engine.serving import choices as many
from specdeploy.engine.serving import openai_fields as fields
from specdeploy.engine.serving import structured
from specdeploy.engine.serving import tools
from specdeploy.engine.serving.metrics import EngineMetrics
from specdeploy.engine.serving.scheduler import Delta, RequestHandle, SamplingParams, Scheduler, SchedulerError
from specdeploy.engine.serving.tokenizer import ChatTemplateError, PromptTooLong, Tokenizer

log = logging.getLogger("specdeploy.server")

# OpenAI's default for /v1/completions.
_DEFAULT_COMPLETION_MAX_TOKENS = 16
# Names pydantic puts into an error's location for the member of a union it tried.
_TYPE_TAGS = {"str", "int", "float", "bool", "none", "list", "dict"}
# `code` of the errors Starlette raises before a route runs.
_HTTP_CODES = {400: "invalid_body", 404: "not_found", 405: "method_not_allowed", 408: "body_timeout",
               413: "body_too_large"}
# Refusals the scheduler counts in the rejected-requests metric itself.
_COUNTED_BY_SCHEDULER = {"queue_full", "draining"}


class APIError(Exception):
    """An error answered in OpenAI's format: {"error": {"message", "type", "param", "code"}}."""

    _TYPES = {400: "invalid_request_error", 404: "invalid_request_error", 405: "invalid_request_error",
              408: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
              500: "internal_error", 503: "service_unavailable"}

    def __init__(self, status_code: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status_code, self.message, self.param, self.code = status_code, message, param, code
        # A 429 says when to come back.
        self.headers = {"Retry-After": str(RETRY_AFTER_S), **(headers or {})} if status_code == 429 else headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self._TYPES.get(self.status_code, "error"),
                          "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status_code, headers=self.headers)


# ---- request bodies ------------------------------------------------------------------------
# strict: OpenAI rejects "max_tokens": "10"; so do we. Unknown fields are kept aside (model_extra):
# those that change nothing here (`user`, `metadata`, ...) are ignored, those that would change
# the tokens and are not implemented are refused (fields.NOT_IMPLEMENTED).

class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False


class _SamplingFields(fields.ControlFields):
    # Unknown fields are kept (model_extra), so that check_fields can refuse those that would
    # change the tokens.
    model_config = ConfigDict(strict=True, extra="allow")
    model: str
    # None: the model's generation_config.json default, else OpenAI's (1.0, 1.0, off).
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, le=INT64_MAX)  # 0 and -1 both mean off
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stop: str | list[str] | None = None  # bounded in sampling_params (fields.stop_problem)
    stop_token_ids: list[int] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    _stop_count = field_validator("stop", mode="before")(
        lambda v: check_list_length(v, MAX_STOP_SEQUENCES, "stop sequences"))
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None


class CompletionBody(_SamplingFields):
    prompt: Union[str, list[int], list[str], list[list[int]]]
    max_tokens: int | None = Field(_DEFAULT_COMPLETION_MAX_TOKENS, ge=0, le=INT64_MAX)  # 0: only with echo
    _prompt_shape = field_validator("prompt", mode="before")(check_prompt_shape)
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = Field(None, ge=1)
    suffix: str | None = None
    return_token_ids: bool = False  # vLLM's: each choice's prompt_token_ids and token_ids


class ContentPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")  # templates may read name, tool_calls, ...
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    _parts = field_validator("content", mode="before")(
        lambda v: check_list_length(v, MAX_CONTENT_PARTS, "content parts"))


class ChatBody(_SamplingFields, tools.ToolFields):
    model_config = _SamplingFields.model_config  # ToolFields' would drop the unknown fields
    messages: list[ChatMessage] = Field(min_length=1)
    _message_count = field_validator("messages", mode="before")(
        lambda v: check_list_length(v, MAX_CHAT_MESSAGES, "messages"))
    max_tokens: int | None = Field(None, ge=1, le=INT64_MAX)
    max_completion_tokens: int | None = Field(None, ge=1, le=INT64_MAX)
    logprobs: bool = False
    top_logprobs: int | None = None


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
    text = {400: "Invalid request", 404: "Unknown model", 408: "The body did not arrive in time",
            413: "The body is larger than the server takes", 429: "Queue full or too many requests, retry later",
            503: "Not ready (loading weights) or draining",
            409: "Aborted (or the room is in use)",
            403: "The peer's session was registered from another address",
            412: "The peer's session is not registered (POST /disagg/register)", 502: "The transfer to the decode server failed",
            504: "The prefill outlasted the request's deadline"}
    return {code: {"model": ErrorBody, "description": text[code]} for code in codes}


# The disaggregation routes (docs/disaggregation.md); 404: a server of another role.
_DISAGG_INFO_RESPONSES = _errors(404, 503)
_DISAGG_PREFILL_RESPONSES = _errors(400, 403, 404, 409, 412, 502, 503, 504)
_DISAGG_REGISTER_RESPONSES = _errors(400, 404, 503)
_DISAGG_ABORT_RESPONSES = _errors(400, 404, 503)

_GENERATION_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"description": "The completion; with stream=true, server-sent events (data: chunk, then data: [DONE])",
          "content": {"application/json": {}, "text/event-stream": {}}},
    **_errors(400, 404, 408, 413, 429, 503),
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

class _BodyOffLoopRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            body = await self.body()
            self._json = await off_loop(parse_json_body, body, inline=len(body) <= INLINE_BODY_BYTES)
        return self._json


class _BodyOffLoopRoute(APIRoute):
    """FastAPI's route, whose request parses its JSON body off the event loop (FastAPI's
    documented way to customise the Request: a route class)."""

    def get_route_handler(self):
        handler = super().get_route_handler()

        async def off_loop(request: Request):
            return await handler(_BodyOffLoopRequest(request.scope, request.receive))
        return off_loop


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
    load_progress: LoadProgress = field(default_factory=LoadProgress)  # the loader's weights so far

    @property
    def ready(self) -> bool:
        return self.scheduler is not None and not self.scheduler.draining and not self.scheduler.stalled

    @property
    def not_ready_now(self) -> str:
        """Why /ready answers 503 (when it does)."""
        s = self.scheduler
        if s is None:
            return self.not_ready_reason
        if s.draining:
            return "draining"
        return (f"stalled: the queue's head has waited {s.stalled_for_s:.0f} s for KV slots or a running-request "
                f"slot while no engine step ran (--stall-timeout-s {s.stall_timeout_s:g})")


# -> (scheduler, tokenizer) or, for the split roles, (scheduler, tokenizer, disaggregation service)
Loader = Callable[[EngineMetrics], tuple]


def create_app(state: EngineState, loader: Loader | None = None,
               on_load_failure: Callable[[BaseException], None] | None = None,
               limits: ConnectionLimits | None = None, guard: Guard | None = None) -> FastAPI:
    """Build the app. With `loader`, it runs in a worker thread after start-up, so /health answers
    (and the pod is not killed) while weights load and graphs are captured; /ready turns 200 after.
    `limits`: body size and deadline, the concurrency cap (limits.py; default ConnectionLimits());
    `guard`: API keys and the split roles' secret (serving/auth.py)."""
    limits = limits or ConnectionLimits()

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
    app.router.route_class = _BodyOffLoopRoute  # the routes below parse their JSON in a thread
    app.state.engine = state

    def concurrency_cap() -> int | None:
        if limits.max_concurrent_requests is not None:
            return limits.max_concurrent_requests
        s = state.scheduler
        return MIN_CONCURRENT_REQUESTS if s is None else concurrency_for(s.runner.max_running_requests,
                                                                         s.max_queued_requests)

    refusal_codes = {429: "too_many_requests", 413: "body_too_large"}

    def refuse(status: int, message: str) -> JSONResponse:
        state.metrics.request_rejected(refusal_codes[status])
        return APIError(status, message, code=refusal_codes[status]).response()

    app.add_middleware(RequestLimitsMiddleware, limits=limits, cap=concurrency_cap, refuse=refuse)
    app.openapi = lambda: _openapi_without_422(app)
    if guard is not None:
        app.add_middleware(AuthMiddleware, guard=guard)

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

    @app.get("/health", responses={503: {"description": "The engine thread has died",
                                          "content": {"application/json": {}}}})
    async def health():
        # Answered on the event loop alone (no lock, no engine call): it says whether this
        # process can still serve, while loading too; the engine thread ends only at shutdown.
        # While weights load it also says how far (the operator's "X GiB of Y GiB" while a pod
        # starts); the probes read only the status code.
        s = state.scheduler
        if s is not None and s.started and not s.alive and not s.stopping:
            return JSONResponse({"status": "engine thread stopped"}, status_code=503)
        loading = state.load_progress.figures()
        return {"status": "ok", "loading": loading} if loading else {"status": "ok"}

    @app.get("/ready", responses={503: {"description": "Loading weights, draining, or admission stalled",
                                         "content": {"application/json": {}}}})
    async def ready():
        if state.ready:
            return {"status": "ready"}
        return JSONResponse({"status": "not ready", "reason": state.not_ready_now}, status_code=503)

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

    def caller(request: Request) -> str:
        return request.client.host if request.client else ""

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
    async def disagg_prefill(body: PrefillBody, request: Request):
        from specdeploy.engine.serving.disagg.prefill import PrefillRefused

        service = disagg_service("prefill")
        if state.scheduler.draining:
            raise APIError(503, "the server is shutting down", code="draining")
        try:
            return await service.prefill(body, caller(request))
        except PrefillRefused as e:
            raise APIError(e.status_code, str(e), code="prefill_refused") from None

    @app.post("/disagg/abort", responses=_DISAGG_ABORT_RESPONSES)
    async def disagg_abort(body: AbortBody, request: Request):
        return await disagg_service("prefill").abort(body, caller(request))

    @app.post("/disagg/register", responses=_DISAGG_REGISTER_RESPONSES)
    async def disagg_register(body: RegisterBody, request: Request):
        from specdeploy.engine.serving.disagg.prefill import PrefillRefused

        try:
            return disagg_service("prefill").register(body, caller(request))
        except PrefillRefused as e:
            raise APIError(e.status_code, str(e), code="register_refused") from None

    @app.post("/v1/completions", responses=_GENERATION_RESPONSES)
    async def completions(body: CompletionBody, request: Request):
        check_model(body.model)
        url = prefill_url(request)
        scheduler, tokenizer = serving()
        check_fields(body)
        with field_errors():
            fields.check_logprobs("logprobs", body.logprobs)
            max_tokens = body.max_tokens if body.max_tokens is not None else _DEFAULT_COMPLETION_MAX_TOKENS
            if max_tokens == 0 and not body.echo:
                raise fields.FieldError("max_tokens", "must be >= 1 (0 only with echo)")
            best_of = body.best_of or body.n
            if best_of < body.n:
                raise fields.FieldError("best_of", f"must be >= n ({body.n}), got {best_of}")
            if body.stream and best_of > body.n:
                raise fields.FieldError("best_of", "cannot be streamed (best_of > n)")
            # Off the event loop: a long prompt takes the tokenizer seconds, and /health must answer.
            prompts = await off_loop(completion_prompts, body.prompt, tokenizer, scheduler.context_length,
                                     inline=_text_chars(body.prompt) <= INLINE_TEXT_CHARS)
            check_choices(scheduler, len(prompts) * best_of, "best_of" if body.best_of else "n")
        # best_of ranks by cumulative log-probability: computed even if not reported.
        logprobs = body.logprobs if body.logprobs is not None else (
            0 if best_of > body.n or body.return_token_ids else None)
        echo_logprobs = body.logprobs if body.echo else None
        grammar = await request_grammar(body, tokenizer)
        runs = submit_choices(scheduler, tokenizer, body, prompts, best_of, max(max_tokens, 1), logprobs,
                              echo_logprobs, "completions", url, grammar)
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())

        def echoed(c: many.Choice) -> str:
            return tokenizer.decode(c.prompt_ids) if body.echo else ""

        def choice_logprobs(c: many.Choice, token_ids: list[int], entries: list, offset: int = 0):
            if body.logprobs is None:
                return None
            return fields.completion_logprobs(tokenizer, token_ids, entries, body.logprobs, offset)

        def chunk(index: int, text: str, finish_reason: str | None, lps=None) -> dict[str, Any]:
            return {"id": rid, "object": "text_completion", "created": created, "model": state.model_name,
                    "choices": [{"index": index, "text": text, "logprobs": lps, "finish_reason": finish_reason}]}

        def echo_part(c: many.Choice):
            ids = c.prompt_ids if body.echo else []
            entries = ([None] + list(c.prompt_logprobs or [])) if body.echo else []
            return ids, entries

        if body.stream:
            echoed_choices: set[int] = set()

            def on_delta(index: int, c: many.Choice, delta: Delta) -> list[dict[str, Any]]:
                out = []
                if body.echo and index not in echoed_choices:  # the prompt (and its logprobs) first
                    echoed_choices.add(index)
                    ids, entries = echo_part(c)
                    out.append(chunk(index, echoed(c), None, choice_logprobs(c, ids, entries)))
                text = delta.text if max_tokens else ""
                lps = choice_logprobs(c, delta.token_ids, delta.logprobs or []) \
                    if max_tokens and delta.token_ids else None
                if text or lps:
                    out.append(chunk(index, text, None, lps))
                if delta.finish_reason is not None:
                    out.append(chunk(index, "", delta.finish_reason))
                return out
            return sse_many(runs, on_delta, body.stream_options)
        await many.collect_all(runs, request)
        check_errors(runs)
        shown = runs if best_of == body.n else [c for p in range(len(prompts)) for c in many.best(
            [r for r in runs if r.prompt_index == p], body.n)]
        out = {"id": rid, "object": "text_completion", "created": created, "model": state.model_name,
               "choices": []}
        for index, c in enumerate(shown):
            ids, entries = echo_part(c)
            if max_tokens:
                ids, entries = ids + c.token_ids, entries + c.logprobs
            out["choices"].append({"index": index, "text": echoed(c) + (c.text if max_tokens else ""),
                                   "logprobs": choice_logprobs(c, ids, entries),
                                   "finish_reason": c.last.finish_reason if max_tokens else "length"})
            if body.return_token_ids:
                out["choices"][-1].update(prompt_token_ids=c.prompt_ids, token_ids=c.token_ids if max_tokens else [])
        out["usage"] = usage_of(runs, count_output=bool(max_tokens))
        return out

    @app.post("/v1/chat/completions", responses=_GENERATION_RESPONSES)
    async def chat_completions(body: ChatBody, request: Request):
        check_model(body.model)
        url = prefill_url(request)
        scheduler, tokenizer = serving()
        check_fields(body)
        messages = [chat_message_dict(m) for m in body.messages]
        with field_errors():
            fields.check_logprobs("top_logprobs", body.top_logprobs)
            if body.top_logprobs and not body.logprobs:
                raise fields.FieldError("top_logprobs", "needs logprobs: true")
            check_choices(scheduler, body.n, "n")
            tool_req = tools.tool_request(body, tokenizer.chat_template)
            if tool_req is not None and tool_req.choice != "auto" and structured.request_spec(body) is not None:
                raise fields.FieldError("tool_choice", f"{body.tool_choice!r} constrains the reply itself: "
                                                       f"not with response_format or guided_*")
        # Off the event loop: a long conversation takes the tokenizer seconds, and /health must answer.
        prompt_ids = await off_loop(chat_prompt_ids, tools.template_messages(messages), tokenizer,
                                    scheduler.context_length, tool_req.tools if tool_req is not None else None,
                                    inline=sum(_text_chars(m["content"]) for m in messages) <= INLINE_TEXT_CHARS)
        max_tokens = body.max_completion_tokens or body.max_tokens
        if max_tokens is None:  # OpenAI's chat default: as much as the context and the KV pool allow
            max_tokens = max(1, scheduler.max_new_tokens(len(prompt_ids)))
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        if tool_req is not None and tool_req.choice != "auto":
            with field_errors():
                grammar = await asyncio.to_thread(tools.call_grammar, tool_req, tokenizer)
        else:
            grammar = await request_grammar(body, tokenizer)
        runs = submit_choices(scheduler, tokenizer, body, [prompt_ids], body.n, max_tokens, logprobs, None,
                              "chat_completions", url, grammar)
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

        def choice_logprobs(token_ids: list[int], entries: list):
            if logprobs is None:
                return None
            return fields.chat_logprobs(tokenizer, token_ids, entries, logprobs)

        def chunk(index: int, delta: dict[str, Any], finish_reason: str | None, lps=None) -> dict[str, Any]:
            return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": state.model_name,
                    "choices": [{"index": index, "delta": delta, "logprobs": lps, "finish_reason": finish_reason}]}

        if body.stream:
            started: set[int] = set()
            streams = {i: tools.ToolStream(tool_req.fmt) for i in range(len(runs))} if tool_req else {}

            def on_delta(index: int, c: many.Choice, delta: Delta) -> list[dict[str, Any]]:
                out = []
                if index not in started:
                    started.add(index)
                    out.append(chunk(index, {"role": "assistant", "content": ""}, None))
                text, events, calls = delta.text, [], []
                if streams:
                    text, events = streams[index].feed(delta.text)
                    if delta.finish_reason is not None:
                        tail, more, calls = streams[index].finish()
                        text, events = text + tail, events + more
                    if not body.parallel_tool_calls:  # the first call only
                        events, calls = [e for e in events if e["index"] == 0], calls[:1]
                lps = choice_logprobs(delta.token_ids, delta.logprobs or []) if delta.token_ids else None
                if text or lps:
                    out.append(chunk(index, {"content": text} if text else {}, None, lps))
                out += [chunk(index, {"tool_calls": [e]}, None) for e in events]
                if delta.finish_reason is not None:
                    out.append(chunk(index, {}, "tool_calls" if calls else delta.finish_reason))
                return out
            return sse_many(runs, on_delta, body.stream_options)
        await many.collect_all(runs, request)
        check_errors(runs)

        def message(c: many.Choice) -> tuple[dict[str, Any], str]:
            if tool_req is not None:
                content, calls = tools.parse(c.text, tool_req.fmt)
                calls = calls if body.parallel_tool_calls else calls[:1]
                if calls:
                    return {"role": "assistant", "content": content, "tool_calls": calls}, "tool_calls"
            return {"role": "assistant", "content": c.text}, c.last.finish_reason

        shaped = [message(c) for c in runs]
        return {"id": rid, "object": "chat.completion", "created": created, "model": state.model_name,
                "choices": [{"index": i, "message": m, "logprobs": choice_logprobs(c.token_ids, c.logprobs),
                             "finish_reason": reason} for i, (c, (m, reason)) in enumerate(zip(runs, shaped))],
                "usage": usage_of(runs)}

    def sse_many(runs: list[many.Choice], on_delta, stream_options) -> StreamingResponse:
        """on_delta(index, choice, delta) -> the chunks of one choice's delta; with
        include_usage a last chunk (no choices) carries the usage of all."""
        include_usage = bool(stream_options and stream_options.include_usage)

        async def events() -> AsyncIterator[str]:
            finished = False
            last: dict[str, Any] | None = None
            try:
                async for index, delta in many.merged(runs):
                    if delta.error is not None:
                        yield sse(delta_error(delta).body())
                        finished = True
                        break
                    for payload in on_delta(index, runs[index], delta):
                        last = payload
                        yield sse(payload)
                else:
                    finished = True
                    if include_usage and last is not None:
                        yield sse({**last, "choices": [], "usage": usage_of(runs)})
                yield "data: [DONE]\n\n"
            finally:
                if not finished:  # the client went away (or the server is stopping): free its slots
                    many.abort_all(runs)
                elif any(c.last is None or c.last.finish_reason is None for c in runs):
                    many.abort_all(runs)  # an engine error in one choice: the others stop too

        # no-cache / no buffering: proxies must pass tokens through as they come.
        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    return app


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def usage_of(runs: list[many.Choice], count_output: bool = True) -> dict[str, Any]:
    """Usage of many choices: each distinct prompt counted once, every choice's output."""
    prompt_tokens = sum(len(c.prompt_ids) for c in {c.prompt_index: c for c in runs}.values())
    completion = sum(c.last.completion_tokens for c in runs if c.last is not None) if count_output else 0
    cached = sum(c.last.cached_tokens for c in runs if c.last is not None)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion, "prompt_tokens_details": {"cached_tokens": cached}}


def check_errors(runs: list[many.Choice]) -> None:
    for c in runs:
        if c.last is not None and c.last.error is not None:
            raise delta_error(c.last)


class field_errors:
    """`with field_errors():` turns openai_fields.FieldError into a 400 naming the field."""

    def __enter__(self):
        return self

    def __exit__(self, kind, exc, tb):
        if isinstance(exc, fields.FieldError):
            raise APIError(400, str(exc), param=exc.param, code="invalid_value") from None
        return False


def check_choices(scheduler: Scheduler, count: int, param: str) -> None:
    """n / best_of / prompts: every choice is a running request, and all must fit at once."""
    limit = scheduler.runner.max_running_requests
    if count > limit:
        raise fields.FieldError(param, f"{count} choices in one request; this server runs at most {limit} "
                                       f"requests at once (--max-running-requests)")


async def request_grammar(body, tokenizer: Tokenizer):
    """The body's compiled grammar (structured.py), or None; compiled off the event loop."""
    with field_errors():
        spec = structured.request_spec(body)
        if spec is None:
            return None
        return await asyncio.to_thread(structured.compile_spec, spec, tokenizer)


def submit_choices(scheduler: Scheduler, tokenizer: Tokenizer, body, prompts: list[list[int]], per_prompt: int,
                   max_tokens: int, logprobs: int | None, prompt_logprobs: int | None, endpoint: str,
                   url: str | None, grammar=None) -> list[many.Choice]:
    """One engine request per choice (per_prompt for each prompt; seeded choices get seed + j);
    if one cannot be submitted, those already submitted are aborted."""
    runs: list[many.Choice] = []
    try:
        for p, ids in enumerate(prompts):
            for j in range(per_prompt):
                with field_errors():
                    params = sampling_params(body, max_tokens, tokenizer, logprobs=logprobs,
                                             prompt_logprobs=prompt_logprobs, seed_offset=j,
                                             grammar=grammar.matcher() if grammar is not None else None)
                if params.controls is not None and url is not None:
                    param = fields.controls_param(body)
                    raise APIError(400, f"{param}: penalties, logit_bias, min_tokens, logprobs, structured output "
                                        f"and tool choices are not supported by split prefill/decode servers",
                                   param=param)
                runs.append(many.Choice(submit(scheduler, ids, params, endpoint, url), p, ids))
    except BaseException:
        many.abort_all(runs)
        raise
    return runs


def submit(scheduler: Scheduler, prompt_ids: list[int], params: SamplingParams, endpoint: str,
           prefill_url: str | None = None) -> RequestHandle:
    try:
        return scheduler.submit(prompt_ids, params, endpoint, prefill_url)
    except SchedulerError as e:
        code = {429: "queue_full", 503: "draining"}.get(e.status_code, "context_length_exceeded")
        raise APIError(e.status_code, str(e), code=code) from None


def delta_error(delta: Delta) -> APIError:
    """A request the engine finished with an error: 400 where the request was at fault."""
    code = "invalid_request" if delta.error_status == 400 else "engine_error"
    return APIError(delta.error_status, delta.error, code=code)


# What a request without temperature / top_p / top_k gets when the model's generation_config.json
# names none either (OpenAI's documented defaults; top_k 0 is off).
OPENAI_SAMPLING_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 0}


def check_fields(body: _SamplingFields) -> None:
    """400 for a field asking for what this engine does not implement, or text that is no text."""
    refused = refused_field({**(body.model_extra or {}), **dict(body)})
    if refused is not None:
        raise APIError(400, f"{refused} is not supported by this server", param=refused, code="unsupported_field")
    texts = {name: getattr(body, name) for name in ("prompt", "messages", "stop") if hasattr(body, name)}
    where = lone_surrogate({k: [m.model_dump() for m in v] if k == "messages" else v for k, v in texts.items()})
    if where is not None:
        raise APIError(400, f"{where}: a lone UTF-16 surrogate is not text", param=where.split(".")[0],
                       code="invalid_value")


def sampling_params(body: _SamplingFields, max_tokens: int, tokenizer: Tokenizer, *, logprobs: int | None = None,
                    prompt_logprobs: int | None = None, grammar=None, seed_offset: int = 0) -> SamplingParams:
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    problem = stop_problem(stop)
    if problem is not None:
        raise APIError(400, problem, param="stop")
    stop_token_ids = set(body.stop_token_ids or [])
    check_token_ids(stop_token_ids, tokenizer, "stop_token_ids")
    defaults = {**OPENAI_SAMPLING_DEFAULTS, **tokenizer.sampling_defaults}
    given = {name: getattr(body, name) for name in OPENAI_SAMPLING_DEFAULTS}
    chosen = {name: defaults[name] if value is None else value for name, value in given.items()}
    if chosen["temperature"] < MIN_SAMPLING_TEMPERATURE:
        chosen["temperature"] = 0.0
    return SamplingParams(max_tokens=max_tokens, temperature=float(chosen["temperature"]),
                          top_p=float(chosen["top_p"]), top_k=max(int(chosen["top_k"]), 0),
                          seed=None if body.seed is None else body.seed + seed_offset, stop=stop,
                          stop_token_ids=stop_token_ids, ignore_eos=body.ignore_eos,
                          controls=fields.controls(body, tokenizer.vocab_size, max_tokens, logprobs=logprobs,
                                                   prompt_logprobs=prompt_logprobs, grammar=grammar))


def check_token_ids(ids, tokenizer: Tokenizer, param: str) -> None:
    bad = [i for i in ids if not 0 <= i < tokenizer.vocab_size]
    if bad:
        raise APIError(400, f"{param}: token id {bad[0]} is outside the vocabulary [0, {tokenizer.vocab_size})",
                       param=param)


def completion_prompts(prompt, tokenizer: Tokenizer, context_length: int) -> list[list[int]]:
    """A string, token ids, or a list of either -> token ids per prompt; 400 for one that is empty
    or longer than the context, found before encoding all of a much longer one."""
    batch = prompt if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)) else [prompt]
    out = []
    for one in batch:
        if isinstance(one, str):
            try:
                ids = tokenizer.encode_at_most(one, context_length)
            except PromptTooLong as e:
                raise prompt_too_long(e, context_length, "prompt") from None
        else:
            if len(one) > context_length:
                raise prompt_too_long(PromptTooLong(len(one), exact=True), context_length, "prompt")
            check_token_ids(one, tokenizer, "prompt")
            ids = list(one)
        if not ids:
            raise fields.FieldError("prompt", "the prompt is empty")
        out.append(ids)
    return out


def _text_chars(value) -> int:
    """Characters (or token ids) a prompt or message content holds: what encoding it costs."""
    if isinstance(value, str):
        return len(value)
    return sum(_text_chars(v) if isinstance(v, (str, list)) else 1 for v in value) if isinstance(value, list) else 0


def chat_prompt_ids(messages: list[dict[str, Any]], tokenizer: Tokenizer, context_length: int,
                    tool_defs: list[dict[str, Any]] | None = None) -> list[int]:
    try:
        return tokenizer.encode_chat(messages, max_tokens=context_length, tools=tool_defs)
    except ChatTemplateError as e:
        raise APIError(400, str(e), param="messages") from None
    except PromptTooLong as e:
        raise prompt_too_long(e, context_length, "messages") from None


def prompt_too_long(e: PromptTooLong, context_length: int, param: str) -> APIError:
    return APIError(400, f"this model's context length is {context_length} tokens; the prompt alone has {e}",
                    param=param, code="context_length_exceeded")


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
    none is left the server stops and the process exits 0. When `drain_timeout_s` passes first
    (the operator renders it inside the pod's grace period), or at a second signal, it stops at
    once: open streams are cut rather than waited for.
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
            if self._drain_started_s is not None or self.should_exit:  # the second signal: now
                log.info("received signal %d again: stopping now", sig)
                self.force_exit = True
            self.should_exit = True
            return
        log.info("received signal %d: draining before exit (up to %.0f s)", sig, self.drain_timeout_s)
        self._drain_started_s = time.monotonic()
        self.state.scheduler.start_drain()

    async def shutdown(self, sockets=None) -> None:
        if self.force_exit:
            # Stopping now: cut the open streams, or the listening socket's close (Python 3.12's
            # wait_closed waits for every connection) would wait for them after all.
            for connection in list(self.server_state.connections):
                connection.transport.close()
        await super().shutdown(sockets)

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
                self.should_exit = self.force_exit = True
        return await super().on_tick(counter)
