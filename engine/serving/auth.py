"""Who may call the engine and the router: API keys on the OpenAI routes, a shared secret on the
split-role control plane.

    /v1/* (every route not below)
                 `Authorization: Bearer KEY`, KEY one of the lines of --api-key-file
                 (a decode server with a control secret: also the secret, so only the router
                 reaches it and only the router names its prefill server)
    /disagg/*    `X-Specdeploy-Disagg-Token: SECRET` (--disagg-secret-file), router <-> prefill
                 <-> decode; the operator creates the secret once per resource in a Secret
    /health, /ready, /metrics, /docs, /openapi.json   open: probes and scrapers carry no key

A refusal is a 401 in OpenAI's error shape, with `WWW-Authenticate: Bearer` (what the `openai`
client turns into AuthenticationError). Keys are compared with hmac.compare_digest against every
key (no early exit: the time taken says nothing about which key came close).

Rotation: a file is stat()ed on each check and read again when its inode, size or mtime changed.
A Kubernetes Secret volume updates by swapping a symlink (`..data`), so the mounted path's inode
changes and the new keys apply within the kubelet's sync period, with no restart. A file that
cannot be read or holds no key after a change keeps the keys last read (a half-written file must
not lock everyone out, nor open the server); a warning says so.

This is a pure ASGI middleware, not Starlette's BaseHTTPMiddleware: streamed answers pass
through untouched.
"""

from __future__ import annotations

import hmac
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Awaitable, Callable

log = logging.getLogger("specdeploy.auth")

# The header the split roles authenticate each other with (the client's Authorization header is
# the client's: the router passes it on unchanged).
DISAGG_TOKEN_HEADER = "X-Specdeploy-Disagg-Token"
# Routes anyone may reach: the kubelet's probes and Prometheus carry no credentials.
OPEN_PATHS = frozenset({"/health", "/ready", "/metrics", "/docs", "/openapi.json", "/docs/oauth2-redirect"})
# A key shorter than this is refused at start-up: a guessable key is no key.
MIN_KEY_CHARS = 16


class AuthConfigError(ValueError):
    """A key file that cannot serve (missing, unreadable, no key in it): the server does not start."""


def parse_keys(text: str) -> frozenset[bytes]:
    """The keys of a key file: one per line; blank lines and lines starting with '#' are skipped,
    surrounding whitespace (a trailing newline from `kubectl create secret --from-file`) dropped."""
    keys = set()
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keys.add(line.encode())
    return frozenset(keys)


def matches(token: bytes | None, keys: frozenset[bytes]) -> bool:
    """Whether `token` is one of `keys`, compared in constant time with each of them."""
    if token is None:
        return False
    found = False
    for key in keys:
        found |= hmac.compare_digest(token, key)
    return found


class KeyFile:
    """A file of keys, read again when it changes (module docstring: rotation)."""

    def __init__(self, path: str | os.PathLike, what: str = "--api-key-file"):
        self.path, self.what = Path(path), what
        self._stamp: tuple[int, int, int] | None = None
        self._keys: frozenset[bytes] = frozenset()
        self._read(initial=True)

    def _stat(self) -> tuple[int, int, int]:
        st = os.stat(self.path)  # follows the Secret volume's symlinks to the current file
        return st.st_ino, st.st_size, st.st_mtime_ns

    def _read(self, initial: bool = False) -> None:
        try:
            stamp = self._stat()
            keys = parse_keys(self.path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError) as e:
            if initial:
                raise AuthConfigError(f"{self.what} {self.path}: {type(e).__name__}: {e}") from None
            log.warning("%s %s could not be read again (%s); keeping the %d key(s) read before",
                        self.what, self.path, e, len(self._keys))
            return
        short = [k for k in keys if len(k) < MIN_KEY_CHARS]
        if not keys or short:
            why = (f"holds a key shorter than {MIN_KEY_CHARS} characters" if short
                   else "holds no key (one per line)")
            if initial:
                raise AuthConfigError(f"{self.what} {self.path}: {why}")
            log.warning("%s %s now %s; keeping the %d key(s) read before", self.what, self.path, why,
                        len(self._keys))
            self._stamp = stamp  # not read again until it changes once more
            return
        if not initial:
            log.info("%s %s changed: %d key(s) now", self.what, self.path, len(keys))
        self._stamp, self._keys = stamp, keys

    def keys(self) -> frozenset[bytes]:
        try:
            changed = self._stat() != self._stamp
        except OSError:
            changed = True
        if changed:
            self._read()
        return self._keys

    def accepts(self, token: bytes | None) -> bool:
        return matches(token, self.keys())

    def first(self) -> str:
        """One key, as text: what this side sends (the control secret has one)."""
        return min(self.keys()).decode()


@dataclass(frozen=True)
class Guard:
    """What a server requires. `api_keys`: every route but the open ones and /disagg/*;
    `disagg_secret`: the split roles' shared secret on /disagg/*; `router_only`: the other routes
    also need the secret (a decode server, which only the router may call)."""

    api_keys: KeyFile | None = None
    disagg_secret: KeyFile | None = None
    router_only: bool = False

    def _has_secret(self, headers: dict[bytes, bytes]) -> bool:
        return self.disagg_secret.accepts(headers.get(DISAGG_TOKEN_HEADER.lower().encode()))

    def refusal(self, path: str, headers: dict[bytes, bytes]) -> tuple[str, str | None] | None:
        """None to let the request through, else (message, code) of the 401. Everything that is
        not open is guarded (a route added later is not open by mistake)."""
        if path in OPEN_PATHS:
            return None
        if self.disagg_secret is not None and (path == "/disagg" or path.startswith("/disagg/")):
            if not self._has_secret(headers):
                return (f"the split-role control plane needs the deployment's shared secret "
                        f"({DISAGG_TOKEN_HEADER})", "invalid_disagg_token")
            return None
        if self.router_only and self.disagg_secret is not None and not self._has_secret(headers):
            return ("this is a decode server: send requests to the router", "invalid_disagg_token")
        if self.api_keys is not None:
            token = bearer_token(headers.get(b"authorization"))
            if token is None:
                return ("You didn't provide an API key. Provide it in an Authorization header using "
                        "Bearer auth (Authorization: Bearer YOUR_KEY).", None)
            if not self.api_keys.accepts(token):
                return ("Incorrect API key provided.", "invalid_api_key")
        return None


def bearer_token(value: bytes | None) -> bytes | None:
    if not value:
        return None
    scheme, _, token = value.strip().partition(b" ")
    if scheme.lower() != b"bearer" or not token.strip():
        return None
    return token.strip()


def error_body(message: str, code: str | None) -> dict[str, Any]:
    return {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": code}}


ASGIApp = Callable[[dict, Callable[[], Awaitable[dict]], Callable[[dict], Awaitable[None]]], Awaitable[None]]


class AuthMiddleware:
    """ASGI middleware applying a Guard (app.add_middleware(AuthMiddleware, guard=...))."""

    def __init__(self, app: ASGIApp, guard: Guard):
        self.app, self.guard = app, guard

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {}
        for name, value in scope.get("headers") or ():
            headers.setdefault(name.lower(), value)
        refused = self.guard.refusal(scope.get("path", ""), headers)
        if refused is None:
            await self.app(scope, receive, send)
            return
        body = json.dumps(error_body(*refused)).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode()),
                                (b"www-authenticate", b'Bearer realm="specdeploy"')]})
        await send({"type": "http.response.body", "body": body})


def guard_from_files(api_key_file: str | None, disagg_secret_file: str | None, *,
                     router_only: bool = False) -> Guard | None:
    """The Guard of a server's flags (None when neither is given); raises AuthConfigError."""
    if not api_key_file and not disagg_secret_file:
        return None
    return Guard(KeyFile(api_key_file) if api_key_file else None,
                 KeyFile(disagg_secret_file, "--disagg-secret-file") if disagg_secret_file else None,
                 router_only=router_only)


def disagg_headers(guard: Guard | None) -> dict[str, str]:
    """Headers a split-role server or the router sends its peers: the shared secret, if any."""
    if guard is None or guard.disagg_secret is None:
        return {}
    return {DISAGG_TOKEN_HEADER: guard.disagg_secret.first()}
