"""Model files from an HF-compatible hub, into the local HF cache layout.

The engine pod gets `HF_ENDPOINT` (the hub or a mirror), `HF_HOME` (a volume) and maybe `HF_TOKEN`
from the operator. A model id that is not a local directory is looked up in the cache first and
fetched only when missing; what is fetched lands where the next start (or transformers) finds it:
    $HF_HOME/hub/models--{org}--{name}/snapshots/{commit}/{file}
    $HF_HOME/hub/models--{org}--{name}/refs/{revision}      (the commit)
Only what the engine reads is fetched: JSON configs, tokenizer files, chat templates and one copy
of the weights: the safetensors, or, in a repository that has none (the published EAGLE and EAGLE-3
heads), the `pytorch_model*.bin` files (engine/models/checkpoint.py reads both).
"""

from __future__ import annotations

import fnmatch
import logging
import os
import time
import urllib.parse
from pathlib import Path

from specdeploy.engine.planner.remote import DEFAULT_HUB_ENDPOINT

log = logging.getLogger("specdeploy.hub")

WANTED_FILES = ("*.json", "tokenizer.model", "*.jinja", "*.txt")
SAFETENSORS_FILES = "*.safetensors"
# training_args.bin, optimizer.bin and the like are no weights: only these names are.
PYTORCH_FILES = "pytorch_model*.bin"
PYTORCH_INDEX = "pytorch_model.bin.index.json"
# Checkpoint copies in other formats, and the subfolders some repos add (original/ for Meta's own
# format): never needed, often as large as the model.
SKIPPED_FILES = ("*/*", "*.pt", "*.pth", "*.gguf", "*.msgpack", "*.h5", "*.onnx")
_PROGRESS_EVERY_S = 10.0
_CHUNK_BYTES = 8 << 20


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
    names = [n for n in names if not any(fnmatch.fnmatch(n, p) for p in SKIPPED_FILES)]
    if any(fnmatch.fnmatch(n, SAFETENSORS_FILES) for n in names):
        weights, stale_index = SAFETENSORS_FILES, PYTORCH_INDEX  # a .bin copy's index is not read
    else:
        weights, stale_index = PYTORCH_FILES, None
    return sorted({n for n in names
                   if n != stale_index and any(fnmatch.fnmatch(n, p) for p in (*WANTED_FILES, weights))})


def fetch_model(repo_id: str, revision: str = "main", *, endpoint: str | None = None,
                token: str | None = None, cache: Path | None = None) -> Path:
    """Download what the engine needs of `repo_id` at `revision`; -> the snapshot directory."""
    import httpx

    endpoint = (endpoint or os.environ.get("HF_ENDPOINT") or DEFAULT_HUB_ENDPOINT).rstrip("/")
    token = token or os.environ.get("HF_TOKEN")
    cache = cache or hub_cache_dir()
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    quoted_rev = urllib.parse.quote(revision, safe="")
    with httpx.Client(base_url=endpoint, headers=headers, follow_redirects=True,
                      timeout=httpx.Timeout(30.0, read=300.0)) as client:
        resp = client.get(f"/api/models/{repo_id}/revision/{quoted_rev}")
        if resp.status_code in (401, 403):
            raise HubError(f"{repo_id}: {endpoint} refused access ({resp.status_code}); set HF_TOKEN for gated models")
        if resp.status_code == 404:
            raise HubError(f"{repo_id}: no such model or revision {revision!r} at {endpoint}")
        resp.raise_for_status()
        info = resp.json()
        commit = info.get("sha") or revision
        files = wanted_files([s["rfilename"] for s in info.get("siblings", [])])
        if "config.json" not in files:
            raise HubError(f"{repo_id}@{revision}: the repository has no config.json")
        repo = _repo_dir(cache, repo_id)
        snapshot = repo / "snapshots" / commit
        snapshot.mkdir(parents=True, exist_ok=True)
        log.info("fetching %s@%s (%s) from %s: %d files", repo_id, revision, commit[:12], endpoint, len(files))
        t0 = time.monotonic()
        total_bytes = 0
        for name in files:
            total_bytes += _download(client, f"/{repo_id}/resolve/{commit}/{urllib.parse.quote(name)}",
                                     snapshot / name, name)
        ref = repo / "refs" / revision
        ref.parent.mkdir(parents=True, exist_ok=True)  # a revision may hold slashes (refs/pr/1)
        ref.write_text(commit)
    elapsed_s = time.monotonic() - t0
    log.info("fetched %s: %.2f GiB in %.0f s (%.0f MiB/s)", repo_id, total_bytes / 2**30, elapsed_s,
             total_bytes / 2**20 / max(elapsed_s, 1e-3))
    return snapshot


def _download(client, url: str, dest: Path, name: str) -> int:
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
        last_report_s = t0 = time.monotonic()
        with open(part, "wb") as f:
            for chunk in resp.iter_bytes(_CHUNK_BYTES):
                f.write(chunk)
                done += len(chunk)
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
