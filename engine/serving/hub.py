"""Model files from an HF-compatible hub, into the local HF cache layout.

The engine pod gets `HF_ENDPOINT` (the hub or a mirror), `HF_HOME` (a volume) and maybe `HF_TOKEN`
from the operator. A model id that is not a local directory is looked up in the cache first and
fetched only when missing; what is fetched lands where the next start (or transformers) finds it:
    $HF_HOME/hub/models--{org}--{name}/snapshots/{commit}/{file}
    $HF_HOME/hub/models--{org}--{name}/refs/{revision}      (the commit)
Only what the engine reads is fetched: JSON configs, tokenizer files, chat templates and one copy
of the weights: the safetensors, or, in a repository that has none (the published EAGLE and EAGLE-3
heads), the `pytorch_model*.bin` files (engine/models/checkpoint.py reads both).

The hub's answers are untrusted input (read through the one hub client, planner/hub_client.py,
which keeps the URLs, timeouts and limits): the revision listing
and every file but the weights are read under one total deadline (HUB_DEADLINE_S) and a byte cap
(MAX_HUB_JSON_BYTES for the listing, MAX_SMALL_FILE_BYTES per file); the commit the hub names
must be 40 hex digits and each file name a plain name, since both become paths in the cache; a
revision with '.'/'..' segments is refused before anything is asked. The weights are read with a
per-read timeout only (they may take hours) and must match their declared length.
"""

from __future__ import annotations

import fnmatch
import json
import logging
import os
import time
from pathlib import Path

from specdeploy.engine.planner.hub_client import (
    DEFAULT_HUB_ENDPOINT,
    HUB_DEADLINE_S,
    HUB_TIMEOUT_S,
    MAX_HUB_JSON_BYTES,
    Deadline,
    auth_headers,
    hub_file_url,
    hub_revision_url,
    httpx_client,
    is_commit,
    revision_problem,
)
from specdeploy.engine.planner.torch_files import PYTORCH_FILES, PYTORCH_INDEX

log = logging.getLogger("specdeploy.hub")

WANTED_FILES = ("*.json", "tokenizer.model", "*.jinja", "*.txt")
SAFETENSORS_FILES = "*.safetensors"
# Checkpoint copies in other formats, and the subfolders some repos add (original/ for Meta's own
# format): never needed, often as large as the model.
SKIPPED_FILES = ("*/*", "*.pt", "*.pth", "*.gguf", "*.msgpack", "*.h5", "*.onnx")
_PROGRESS_EVERY_S = 10.0
_CHUNK_BYTES = 8 << 20
# A weight file's reads: a CDN may pause a large transfer longer than a small answer's timeout.
WEIGHTS_READ_TIMEOUT_S = 300.0
# A configuration, tokenizer or template file: the largest published tokenizer.json files are
# tens of megabytes.
MAX_SMALL_FILE_BYTES = 256 << 20


class HubError(RuntimeError):
    pass


def hub_cache_dir() -> Path:
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    return Path(os.environ.get("HF_HOME") or Path.home() / ".cache" / "huggingface") / "hub"


def _repo_dir(cache: Path, repo_id: str) -> Path:
    return cache / ("models--" + repo_id.replace("/", "--"))


def cached_snapshot(repo_id: str, revision: str = "main", cache: Path | None = None) -> Path | None:
    """The cached snapshot of `repo_id` at `revision`, if one is complete enough to load."""
    repo = _repo_dir(cache or hub_cache_dir(), repo_id)
    ref = repo / "refs" / revision
    snapshot = repo / "snapshots" / (ref.read_text().strip() if ref.is_file() else revision)
    return snapshot if (snapshot / "config.json").is_file() else None


def wanted_files(names: list[str]) -> list[str]:
    """The files of a repository listing that the engine reads (sorted): configs, tokenizer,
    templates, and the safetensors, else, when there are none, the PyTorch weight files."""
    names = [n for n in names if _plain_name(n) and not any(fnmatch.fnmatch(n, p) for p in SKIPPED_FILES)]
    if any(fnmatch.fnmatch(n, SAFETENSORS_FILES) for n in names):
        weights, stale_index = SAFETENSORS_FILES, PYTORCH_INDEX  # a .bin copy's index is not read
    else:
        weights, stale_index = PYTORCH_FILES, None
    return sorted({n for n in names
                   if n != stale_index and any(fnmatch.fnmatch(n, p) for p in (*WANTED_FILES, weights))})


def _plain_name(name: object) -> bool:
    """A repository file name that stays inside the snapshot directory."""
    return (isinstance(name, str) and bool(name) and not name.startswith(("/", ".")) and "\\" not in name
            and ".." not in name.split("/") and all(ord(c) >= 0x20 for c in name))


def fetch_model(repo_id: str, revision: str = "main", *, endpoint: str | None = None,
                token: str | None = None, cache: Path | None = None, deadline_s: float = HUB_DEADLINE_S) -> Path:
    """Download what the engine needs of `repo_id` at `revision`; -> the snapshot directory."""
    import httpx

    problem = revision_problem(revision)
    if problem is not None:
        raise HubError(f"{repo_id}: {problem}")
    endpoint = (endpoint or os.environ.get("HF_ENDPOINT") or DEFAULT_HUB_ENDPOINT).rstrip("/")
    token = token or os.environ.get("HF_TOKEN")
    cache = cache or hub_cache_dir()
    deadline = Deadline(deadline_s)  # the listing and the small files; weights have no total bound
    timeout = httpx.Timeout(HUB_TIMEOUT_S, read=WEIGHTS_READ_TIMEOUT_S)
    with httpx_client(httpx.Client, deadline, timeout=timeout, headers=auth_headers(token)) as small, \
            httpx_client(httpx.Client, None, timeout=timeout, headers=auth_headers(token)) as large:
        try:
            info = _listing(small, hub_revision_url(endpoint, repo_id, revision), repo_id, revision, endpoint)
        except httpx.TimeoutException:
            if deadline.expired:
                raise HubError(f"{repo_id}: {endpoint} did not answer within the {deadline_s:.0f} s deadline") from None
            raise
        commit = info.get("sha") if isinstance(info, dict) else None
        if commit is None and is_commit(revision):
            commit = revision
        if not is_commit(commit):
            raise HubError(f"{repo_id}@{revision}: the hub named no commit (40 hex digits) but {commit!r}")
        siblings = info.get("siblings") if isinstance(info.get("siblings"), list) else []
        files = wanted_files([s.get("rfilename") for s in siblings if isinstance(s, dict)])
        if "config.json" not in files:
            raise HubError(f"{repo_id}@{revision}: the repository has no config.json")
        repo = _repo_dir(cache, repo_id)
        snapshot = repo / "snapshots" / commit
        snapshot.mkdir(parents=True, exist_ok=True)
        log.info("fetching %s@%s (%s) from %s: %d files", repo_id, revision, commit[:12], endpoint, len(files))
        t0 = time.monotonic()
        total_bytes = 0
        for name in files:
            weights = name.endswith((".safetensors", ".bin"))
            try:
                total_bytes += _download(large if weights else small, hub_file_url(endpoint, repo_id, commit, name),
                                         snapshot / name, name, None if weights else MAX_SMALL_FILE_BYTES)
            except httpx.TimeoutException:
                if not weights and deadline.expired:
                    raise HubError(f"{name}: {endpoint} did not send it within the {deadline_s:.0f} s deadline") from None
                raise
        ref = repo / "refs" / revision
        ref.parent.mkdir(parents=True, exist_ok=True)  # a revision may hold slashes (refs/pr/1)
        ref.write_text(commit)
    elapsed_s = time.monotonic() - t0
    log.info("fetched %s: %.2f GiB in %.0f s (%.0f MiB/s)", repo_id, total_bytes / 2**30, elapsed_s,
             total_bytes / 2**20 / max(elapsed_s, 1e-3))
    return snapshot


def _listing(client, url: str, repo_id: str, revision: str, endpoint: str) -> dict:
    """The revision listing (JSON), at most MAX_HUB_JSON_BYTES."""
    with client.stream("GET", url) as resp:
        if resp.status_code in (401, 403):
            raise HubError(f"{repo_id}: {endpoint} refused access ({resp.status_code}); set HF_TOKEN for gated models")
        if resp.status_code == 404:
            raise HubError(f"{repo_id}: no such model or revision {revision!r} at {endpoint}")
        if resp.status_code != 200:
            raise HubError(f"{repo_id}: {endpoint} answered {resp.status_code}")
        body, total = [], 0
        for chunk in resp.iter_bytes():
            total += len(chunk)
            if total > MAX_HUB_JSON_BYTES:
                raise HubError(f"{repo_id}: the listing of {endpoint} is larger than {MAX_HUB_JSON_BYTES} bytes")
            body.append(chunk)
    try:
        info = json.loads(b"".join(body))
    except ValueError as e:
        raise HubError(f"{repo_id}: the listing of {endpoint} is not JSON ({e})") from None
    if not isinstance(info, dict):
        raise HubError(f"{repo_id}: the listing of {endpoint} is not a JSON object")
    return info


def _download(client, url: str, dest: Path, name: str, limit_bytes: int | None = None) -> int:
    """One file, written beside its final name and renamed when complete (a pod killed mid-way
    never leaves a truncated file that looks whole). Already present: skipped."""
    if dest.exists():
        return 0
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_name(dest.name + ".part")
    done = 0
    with client.stream("GET", url) as resp:
        if resp.status_code != 200:
            raise HubError(f"{name}: download failed with HTTP {resp.status_code}")
        size = int(resp.headers.get("content-length") or 0)
        if limit_bytes is not None and size > limit_bytes:
            raise HubError(f"{name}: {size} bytes, larger than {limit_bytes}; refused")
        last_report_s = t0 = time.monotonic()
        with open(part, "wb") as f:
            for chunk in resp.iter_bytes(_CHUNK_BYTES):
                f.write(chunk)
                done += len(chunk)
                if limit_bytes is not None and done > limit_bytes:
                    f.close()
                    part.unlink()
                    raise HubError(f"{name}: more than {limit_bytes} bytes; refused")
                now = time.monotonic()
                if now - last_report_s >= _PROGRESS_EVERY_S:
                    last_report_s = now
                    share = f" ({100 * done / size:.0f}%)" if size else ""
                    log.info("  %s: %.2f GiB%s, %.0f MiB/s", name, done / 2**30, share,
                             done / 2**20 / (now - t0))
    if size and done != size:
        raise HubError(f"{name}: got {done} of {size} bytes")
    part.rename(dest)
    return done
