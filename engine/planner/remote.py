"""A model on an HF-compatible hub, read for planning: config.json and safetensors headers only.

`specdeploy plan --target ORG/NAME` plans a model nobody has downloaded. Three kinds of request,
all to `{endpoint}/{repo}/resolve/{revision}/{file}` (redirects followed, as the hub sends
large files to a CDN):
    GET config.json
    GET model.safetensors.index.json                  (404: a single-file checkpoint)
    GET {shard} with Range: bytes=0-524287            (206: the 8-byte length and the header;
                                                       a second range when the header is longer)
A server that ignores Range answers 200 with the whole file: only the bytes asked for are read
before the connection is closed. Standard library only (urllib), like the rest of the planner;
the operator reads the same files with httpx (operator/cluster/config_source.py) and both hand
the bytes to the same pure function (weights.read_checkpoint_weights).

A hub's answers are untrusted input, and this module is the one home of the limits every hub
reader applies (here, the operator's config_source, the engine's serving/hub.py):
- a total deadline (`Deadline`), not only a per-read timeout: a server sending one byte every
  few seconds never trips a read timeout. Here a watchdog shuts the socket down at the
  deadline (headers and body alike); the httpx readers clip every socket operation's timeout to
  what is left (`bound_httpx_client`);
- byte caps: MAX_HUB_JSON_BYTES for a JSON answer (config.json, an index, a revision listing),
  weights.MAX_SAFETENSORS_HEADER_BYTES per header, weights.MAX_CHECKPOINT_SHARDS shards;
- names: a revision with '.' or '..' segments or a leading '-' is refused (`revision_problem`),
  a commit the hub names must be 40 hex digits (`is_commit`).
"""

from __future__ import annotations

import http.client
import io
import json
import os
import re
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from specdeploy.engine.planner.errors import ConfigError
from specdeploy.engine.planner.weights import (
    SINGLE_FILE,
    CheckpointWeights,
    read_checkpoint_weights,
)

DEFAULT_HUB_ENDPOINT = "https://huggingface.co"
HUB_TIMEOUT_S = 30.0
# Total time for everything read of one model here (config.json, the index, every shard header).
HUB_DEADLINE_S = 120.0
# One JSON answer of a hub, read whole into memory: real ones are kilobytes (a config.json) to a
# few megabytes (the index of a checkpoint of thousands of tensors, a repository listing).
MAX_HUB_JSON_BYTES = 16 << 20
# A read after the deadline gets this timeout: it fails at once unless bytes are already there.
_EXPIRED_TIMEOUT_S = 1e-3
COMMIT = re.compile(r"^[0-9a-f]{40}$")

# org/name as the hub spells repository ids (a local path that exists always wins over this).
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def is_hub_id(text: str) -> bool:
    return bool(HUB_ID.match(text)) and not text.endswith((".json", ".safetensors"))


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
    parts, total = [], 0
    while True:
        chunk = read(chunk_bytes)
        if not chunk:
            return b"".join(parts)
        total += len(chunk)
        if total > limit:
            raise ConfigError(f"{what}: larger than {limit} bytes; refused")
        parts.append(chunk)


# ---- a deadline for httpx (the operator and the engine read the hub with it) ------------------
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


# ---- a deadline for urllib (`specdeploy plan`) -----------------------------------------------

def _watch(connection, deadline: Deadline) -> None:
    """Shut the connection's socket down at the deadline: a blocked read returns at once. The
    socket itself is held: urllib drops the connection's reference once the headers are in."""
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
    def __init__(self, *args, deadline: Deadline, **kwargs):
        super().__init__(*args, **kwargs)
        self._deadline = deadline

    def connect(self):
        super().connect()
        _watch(self, self._deadline)


class _HTTPSConnection(http.client.HTTPSConnection):
    def __init__(self, *args, deadline: Deadline, **kwargs):
        super().__init__(*args, **kwargs)
        self._deadline = deadline

    def connect(self):
        super().connect()
        _watch(self, self._deadline)


class _HTTPHandler(urllib.request.HTTPHandler):
    def __init__(self, deadline: Deadline):
        super().__init__()
        self._deadline = deadline

    def http_open(self, req):
        return self.do_open(_HTTPConnection, req, deadline=self._deadline)


class _HTTPSHandler(urllib.request.HTTPSHandler):
    def __init__(self, deadline: Deadline):
        super().__init__()
        self._deadline = deadline

    def https_open(self, req):
        return self.do_open(_HTTPSConnection, req, context=self._context, deadline=self._deadline)


def hub_file_url(endpoint: str, repo: str, revision: str, name: str) -> str:
    # The hub quotes the whole revision ("refs/pr/1" -> "refs%2Fpr%2F1"), not the repo id's slash.
    return (f"{endpoint.rstrip('/')}/{urllib.parse.quote(repo, safe='/')}"
            f"/resolve/{urllib.parse.quote(revision, safe='')}/{urllib.parse.quote(name)}")


class HubFiles:
    """weights.CheckpointFiles over a hub repository at one revision."""

    def __init__(self, repo: str, revision: str = "main", *, endpoint: str | None = None,
                 token: str | None = None, timeout_s: float = HUB_TIMEOUT_S, deadline_s: float = HUB_DEADLINE_S):
        problem = revision_problem(revision)
        if problem is not None:
            raise ConfigError(problem)
        self.repo, self.revision = repo, revision
        self.endpoint = (endpoint or os.environ.get("HF_ENDPOINT") or DEFAULT_HUB_ENDPOINT).rstrip("/")
        self.token = token if token is not None else os.environ.get("HF_TOKEN")
        self.timeout_s = timeout_s
        self.deadline = Deadline(deadline_s)  # for everything read through this object
        self._opener = urllib.request.build_opener(_HTTPHandler(self.deadline), _HTTPSHandler(self.deadline))
        self.origin = f"{self.endpoint}/{repo}/resolve/{revision}"

    def _late(self, url: str) -> ConfigError:
        return ConfigError(f"GET {url}: the hub did not answer within the {self.deadline.seconds:.0f} s deadline")

    def _open(self, name: str, headers: dict[str, str]):
        """The open response, or None on 404."""
        url = hub_file_url(self.endpoint, self.repo, self.revision, name)
        if self.deadline.expired:
            raise self._late(url)
        request = urllib.request.Request(url, headers=headers)
        if self.token:
            # Not sent on to a redirect's host: CDN URLs carry their own signature.
            request.add_unredirected_header("Authorization", f"Bearer {self.token}")
        try:
            return self._opener.open(request, timeout=self.deadline.clip(self.timeout_s))
        except urllib.error.HTTPError as err:
            err.close()
            if err.code == 404:
                return None
            if err.code == 416:  # a range past the end of the file
                return io.BytesIO()  # no status: read as an empty partial answer
            if err.code in (401, 403):
                raise ConfigError(f"GET {url}: {err.code} ({'token rejected' if self.token else 'no token given'}; "
                                  "set HF_TOKEN to a token with access)") from None
            raise ConfigError(f"GET {url}: {err.code} from the hub") from None
        except (urllib.error.URLError, OSError, http.client.HTTPException) as err:
            if self.deadline.expired:
                raise self._late(url) from None
            reason = getattr(err, "reason", err)
            raise ConfigError(f"GET {url}: hub unreachable ({reason})") from None

    def _read(self, name: str, response, length: int) -> bytes:
        """Up to `length` bytes of the body, within the deadline."""
        try:
            return response.read(length)
        except (OSError, http.client.HTTPException) as err:
            if self.deadline.expired:
                raise self._late(f"{self.origin}/{name}") from None
            raise ConfigError(f"GET {self.origin}/{name}: the hub's answer broke off ({err})") from None

    def read_json(self, name: str) -> Any | None:
        response = self._open(name, {})
        if response is None:
            return None
        with response:
            declared = response.headers.get("Content-Length") if hasattr(response, "headers") else None
            if declared and declared.isdigit() and int(declared) > MAX_HUB_JSON_BYTES:
                raise ConfigError(f"{self.origin}/{name}: {declared} bytes, larger than {MAX_HUB_JSON_BYTES}; refused")
            try:
                body = read_capped(response.read, MAX_HUB_JSON_BYTES, f"{self.origin}/{name}")
            except (OSError, http.client.HTTPException) as err:
                if self.deadline.expired:
                    raise self._late(f"{self.origin}/{name}") from None
                raise ConfigError(f"GET {self.origin}/{name}: the hub's answer broke off ({err})") from None
            if self.deadline.expired:  # the watchdog cut it short: what arrived may look whole
                raise self._late(f"{self.origin}/{name}")
        try:
            return json.loads(body)
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise ConfigError(f"{self.origin}/{name}: not valid JSON ({err})") from None

    def read_range(self, name: str, start: int, length: int) -> bytes | None:
        response = self._open(name, {"Range": f"bytes={start}-{start + length - 1}"})
        if response is None:
            return None
        with response:
            if getattr(response, "status", 206) == 206:
                body = self._read(name, response, length)
            else:  # 200: the server ignored Range and sends the whole file; read only up to what we need.
                body = self._read(name, response, start + length)[start:]
            if self.deadline.expired:
                raise self._late(f"{self.origin}/{name}")
            return body

    def safetensors_names(self) -> list[str]:
        return [SINGLE_FILE]


def load_hub_model(repo: str, revision: str = "main", *, endpoint: str | None = None,
                   token: str | None = None) -> tuple[dict[str, Any], CheckpointWeights | None]:
    """(config dict, checkpoint weights or None) of a hub repository, nothing downloaded."""
    files = HubFiles(repo, revision, endpoint=endpoint, token=token)
    config = files.read_json("config.json")
    if config is None:
        raise ConfigError(f"{files.origin}/config.json: 404 (no such model {repo!r} or revision {revision!r})")
    if not isinstance(config, dict):
        raise ConfigError(f"{files.origin}/config.json: expected a JSON object")
    return config, read_checkpoint_weights(files)
