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
"""

from __future__ import annotations

import io
import json
import os
import re
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

# org/name as the hub spells repository ids (a local path that exists always wins over this).
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def is_hub_id(text: str) -> bool:
    return bool(HUB_ID.match(text)) and not text.endswith((".json", ".safetensors"))


def hub_file_url(endpoint: str, repo: str, revision: str, name: str) -> str:
    # The hub quotes the whole revision ("refs/pr/1" -> "refs%2Fpr%2F1"), not the repo id's slash.
    return (f"{endpoint.rstrip('/')}/{urllib.parse.quote(repo, safe='/')}"
            f"/resolve/{urllib.parse.quote(revision, safe='')}/{urllib.parse.quote(name)}")


class HubFiles:
    """weights.CheckpointFiles over a hub repository at one revision."""

    def __init__(self, repo: str, revision: str = "main", *, endpoint: str | None = None,
                 token: str | None = None, timeout_s: float = HUB_TIMEOUT_S):
        self.repo, self.revision = repo, revision
        self.endpoint = (endpoint or os.environ.get("HF_ENDPOINT") or DEFAULT_HUB_ENDPOINT).rstrip("/")
        self.token = token if token is not None else os.environ.get("HF_TOKEN")
        self.timeout_s = timeout_s
        self.origin = f"{self.endpoint}/{repo}/resolve/{revision}"

    def _open(self, name: str, headers: dict[str, str]):
        """The open response, or None on 404."""
        url = hub_file_url(self.endpoint, self.repo, self.revision, name)
        request = urllib.request.Request(url, headers=headers)
        if self.token:
            # Not sent on to a redirect's host: CDN URLs carry their own signature.
            request.add_unredirected_header("Authorization", f"Bearer {self.token}")
        try:
            return urllib.request.urlopen(request, timeout=self.timeout_s)
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
        except (urllib.error.URLError, OSError) as err:
            reason = getattr(err, "reason", err)
            raise ConfigError(f"GET {url}: hub unreachable ({reason})") from None

    def read_json(self, name: str) -> Any | None:
        response = self._open(name, {})
        if response is None:
            return None
        with response:
            body = response.read()
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
                return response.read(length)
            # 200: the server ignored Range and sends the whole file; read only up to what we need.
            return response.read(start + length)[start:]

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
