"""The one hub client: how every reader of an HF-compatible hub names its files, how long it
waits, and how much it reads. The planner (`specdeploy plan ORG/NAME`, remote.py), the operator
(operator/cluster/config_source.py) and the engine (engine/serving/hub.py) all read through it.

One URL builder (`hub_file_url`, `hub_revision_url`) and one timeout/deadline policy:
- HUB_TIMEOUT_S bounds each socket operation; a `Deadline` bounds a whole job (HUB_DEADLINE_S
  for a model's config and weight headers, HUB_CONFIG_DEADLINE_S for one config.json): a server
  sending one byte every few seconds never trips a per-read timeout;
- every socket a job opens has each connect, read and write clipped to what is left of its
  deadline (`Deadline.clip`), whichever HTTP library opened it.

Two faces over that policy, for two kinds of caller: `urllib_opener` (standard library only: the
planner must run in a bare install) and `httpx_client` (the operator and the engine, which hand
it httpx.Client: nothing of httpx is imported here). Neither imports torch.

A hub's answers are untrusted input; the limits here: MAX_HUB_JSON_BYTES for a JSON answer
(config.json, an index, a revision listing; `read_capped`), with weights.MAX_SAFETENSORS_HEADER_BYTES
per header and weights.MAX_CHECKPOINT_SHARDS shards; a revision with '.' or '..' segments or a leading '-' is refused
(`revision_problem`); a commit the hub names must be 40 hex digits (`is_commit`).
"""

from __future__ import annotations

import functools
import http.client
import re
import socket
import threading
import time
import urllib.parse
import urllib.request
from typing import Any

from specdeploy.engine.planner.errors import ConfigError

DEFAULT_HUB_ENDPOINT = "https://huggingface.co"
# Each connect, read or write (clipped further to what is left of the job's deadline).
HUB_TIMEOUT_S = 30.0
# Total time for everything read of one model's config and checkpoint headers.
HUB_DEADLINE_S = 120.0
# config.json is one small file: the whole GET (redirects included) ends by then.
HUB_CONFIG_DEADLINE_S = 20.0
# One JSON answer of a hub, read whole into memory: real ones are kilobytes (a config.json) to a
# few megabytes (the index of a checkpoint of thousands of tensors, a repository listing).
MAX_HUB_JSON_BYTES = 16 << 20
# A socket operation after the deadline gets this timeout: it fails at once unless bytes are already there.
_EXPIRED_TIMEOUT_S = 1e-3
COMMIT = re.compile(r"^[0-9a-f]{40}$")


def hub_file_url(endpoint: str, repo: str, revision: str, name: str) -> str:
    """`{endpoint}/{repo}/resolve/{revision}/{name}`. The hub quotes the whole revision
    ("refs/pr/1" -> "refs%2Fpr%2F1"), not the repo id's slash."""
    return (f"{endpoint.rstrip('/')}/{urllib.parse.quote(repo, safe='/')}"
            f"/resolve/{urllib.parse.quote(revision, safe='')}/{urllib.parse.quote(name)}")


def hub_revision_url(endpoint: str, repo: str, revision: str) -> str:
    """The listing of `repo` at `revision` (its commit and file names), as JSON."""
    return (f"{endpoint.rstrip('/')}/api/models/{urllib.parse.quote(repo, safe='/')}"
            f"/revision/{urllib.parse.quote(revision, safe='')}")


def auth_headers(token: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token else {}


def revision_problem(revision: str) -> str | None:
    """Why `revision` cannot name a hub revision (it becomes a URL segment and a cache path), or None."""
    if not revision or revision.startswith("-"):
        return f"revision {revision!r}: must not be empty or start with '-'"
    if any(part in ("", ".", "..") for part in revision.split("/")) or "\\" in revision:
        return f"revision {revision!r}: must not have empty, '.' or '..' segments"
    if any(ord(c) < 0x21 or ord(c) == 0x7F for c in revision):
        return f"revision {revision!r}: must not hold spaces or control characters"
    return None


def is_commit(text: object) -> bool:
    """A full commit hash as the hub writes it: 40 lowercase hex digits."""
    return isinstance(text, str) and bool(COMMIT.match(text))


class Deadline:
    """A point in time every read of one job must end by (time.monotonic())."""

    def __init__(self, seconds: float, now=time.monotonic):
        self.seconds, self._now = seconds, now
        self.at = now() + seconds

    def left(self) -> float:
        return self.at - self._now()

    @property
    def expired(self) -> bool:
        return self.left() <= 0

    def clip(self, timeout: float | None) -> float:
        """A socket operation's timeout: at most what is left."""
        left = max(self.left(), _EXPIRED_TIMEOUT_S)
        return left if timeout is None else min(timeout, left)


def read_capped(read, limit: int, what: str, chunk_bytes: int = 1 << 16) -> bytes:
    """Bytes from `read(n)` until it returns b""; ConfigError past `limit` bytes."""
    parts: list[bytes] = []
    total = 0
    while True:
        chunk = read(chunk_bytes)
        if not chunk:
            return b"".join(parts)
        total += len(chunk)
        if total > limit:
            raise ConfigError(f"{what}: larger than {limit} bytes; refused")
        parts.append(chunk)


# ---- the urllib face (the planner) ------------------------------------------------------------
# http.client sets a socket's timeout once, at connect: a watchdog shuts the socket down at the
# deadline instead, so that a blocked read (headers or body) returns at once.

def _watch(connection, deadline: Deadline) -> None:
    """Shut the connection's socket down at the deadline. The socket itself is held: urllib drops
    the connection's reference once the headers are in."""
    sock = connection.sock

    def expire():
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
    timer = threading.Timer(max(deadline.left(), 0.0), expire)
    timer.daemon = True
    timer.start()
    connection._deadline_timer = timer


class _HTTPConnection(http.client.HTTPConnection):
    """A connection watched by a deadline once connected (the HTTPS one below is this too)."""

    def __init__(self, *args: Any, deadline: Deadline, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._deadline = deadline

    def connect(self) -> None:
        super().connect()
        _watch(self, self._deadline)


class _HTTPSConnection(_HTTPConnection, http.client.HTTPSConnection):
    pass


class _DeadlineHandler(urllib.request.HTTPHandler, urllib.request.HTTPSHandler):
    """urllib's HTTP and HTTPS handlers in one (the opener keeps neither default), their
    connections watched by one deadline."""

    def __init__(self, deadline: Deadline):
        super().__init__()
        self._deadline = deadline

    def http_open(self, req):
        return self.do_open(functools.partial(_HTTPConnection, deadline=self._deadline), req)

    def https_open(self, req):
        return self.do_open(functools.partial(_HTTPSConnection, deadline=self._deadline), req)


def urllib_opener(deadline: Deadline) -> urllib.request.OpenerDirector:
    """An opener whose every connection ends by `deadline` (open it with timeout=deadline.clip(HUB_TIMEOUT_S))."""
    return urllib.request.build_opener(_DeadlineHandler(deadline))


# ---- the httpx face (the operator, the engine) -------------------------------------------------
# httpx has per-operation timeouts only. Its connection pools open sockets through a network
# backend; wrapping that backend clips every connect, read and write to the deadline, so a drip
# of headers or body ends there. Duck-typed: nothing of httpx is imported here.

class _DeadlineStream:
    def __init__(self, inner, deadline: Deadline):
        self._inner, self._deadline = inner, deadline

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return self._inner.read(max_bytes, self._deadline.clip(timeout))

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self._inner.write(buffer, self._deadline.clip(timeout))

    def close(self) -> None:
        self._inner.close()

    def start_tls(self, ssl_context, server_hostname: str | None = None, timeout: float | None = None):
        return _DeadlineStream(self._inner.start_tls(ssl_context, server_hostname, self._deadline.clip(timeout)),
                               self._deadline)

    def get_extra_info(self, info: str):
        return self._inner.get_extra_info(info)


class _DeadlineBackend:
    def __init__(self, inner, deadline: Deadline):
        self._inner, self._deadline = inner, deadline

    def connect_tcp(self, host, port, timeout=None, local_address=None, socket_options=None):
        return _DeadlineStream(self._inner.connect_tcp(host, port, self._deadline.clip(timeout), local_address,
                                                       socket_options), self._deadline)

    def connect_unix_socket(self, path, timeout=None, socket_options=None):
        return _DeadlineStream(self._inner.connect_unix_socket(path, self._deadline.clip(timeout), socket_options),
                               self._deadline)

    def sleep(self, seconds: float) -> None:
        self._inner.sleep(seconds)


def bound_httpx_client(client, deadline: Deadline):
    """`client` (an httpx.Client, proxies from the environment included) with every socket
    operation it makes ending by `deadline`; -> the same client."""
    transports = [client._transport, *(t for t in client._mounts.values() if t is not None)]
    for transport in transports:
        pool = getattr(transport, "_pool", None)
        if pool is None or not hasattr(pool, "_network_backend"):
            raise TypeError(f"cannot bound {type(transport).__name__}: no connection pool to wrap")
        pool._network_backend = _DeadlineBackend(pool._network_backend, deadline)
    return client


def httpx_client(client_class: Any, deadline: Deadline | None, *, timeout: Any = HUB_TIMEOUT_S, **kwargs: Any):
    """A `client_class` (httpx.Client: passed in, the planner imports no httpx) that follows
    redirects (the hub sends large files to a CDN), each socket operation within `timeout` and,
    with a `deadline`, all of them ending by it."""
    client = client_class(timeout=timeout, follow_redirects=True, **kwargs)
    return bound_httpx_client(client, deadline) if deadline is not None else client
