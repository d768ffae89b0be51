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

The hub client (hub_client.py: URLs, timeouts, deadlines, caps) is the one the operator and the
engine read through too; this module is its planner's use: a model's config and weights.
"""

from __future__ import annotations

import http.client
import io
import json
import os
import re
import urllib.error
import urllib.request
from typing import Any

from specdeploy.engine.planner.errors import ConfigError
from specdeploy.engine.planner.hub_client import (
    DEFAULT_HUB_ENDPOINT,
    HUB_DEADLINE_S,
    HUB_TIMEOUT_S,
    MAX_HUB_JSON_BYTES,
    Deadline,
    hub_file_url,
    is_commit,
    read_capped,
    revision_problem,
    urllib_opener,
)
from specdeploy.engine.planner.weights import (
    SINGLE_FILE,
    CheckpointWeights,
    read_checkpoint_weights,
)

# Re-exported: callers of the planner's hub reader name these through it.
__all__ = ["DEFAULT_HUB_ENDPOINT", "MAX_HUB_JSON_BYTES", "HubFiles", "is_commit", "is_hub_id", "load_hub_model",
           "read_checkpoint_weights", "revision_problem"]

# org/name as the hub spells repository ids (a local path that exists always wins over this).
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def is_hub_id(text: str) -> bool:
    return bool(HUB_ID.match(text)) and not text.endswith((".json", ".safetensors"))


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
        self._opener = urllib_opener(self.deadline)
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
