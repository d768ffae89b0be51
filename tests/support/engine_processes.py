"""`specdeploy engine serve` as real processes (each with the ranks it starts itself), for tests
that cannot run two servers in one process (a tensor-parallel server's rank 0 owns the process's
torch.distributed group)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx


def ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/ready", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


@contextlib.contextmanager
def serving(argvs: dict[str, list[str]], log_dir: Path, timeout_s: float = 300.0):
    """Start `python -m specdeploy.cli ARGV` for each name (its log in log_dir/NAME.log; the port
    is the argv's --port) and wait until every one is ready: -> {name: base URL}. Each is sent
    SIGTERM at the end (killed if it has not stopped within a minute)."""
    procs: dict[str, tuple[subprocess.Popen, object]] = {}
    urls = {}
    try:
        for name, argv in argvs.items():
            log = open(log_dir / f"{name}.log", "w")
            proc = subprocess.Popen([sys.executable, "-P", "-m", "specdeploy.cli", *argv], stdout=log,
                                    stderr=subprocess.STDOUT, env=dict(os.environ, OMP_NUM_THREADS="1"))
            procs[name] = (proc, log)
            urls[name] = f"http://127.0.0.1:{argv[argv.index('--port') + 1]}"
        deadline = time.monotonic() + timeout_s
        for name, url in urls.items():
            while not ready(url):
                if procs[name][0].poll() is not None or time.monotonic() > deadline:
                    raise AssertionError(f"{name} did not become ready:\n" + (log_dir / f"{name}.log").read_text(errors="replace")[-4000:])
                time.sleep(0.2)
        yield urls
    finally:
        for proc, log in procs.values():
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            log.close()
