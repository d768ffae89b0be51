"""Schemathesis against the engine's own OpenAPI schema: every operation, generated bodies, paths
and query strings, valid and invalid; no answer may be a 5xx, and afterwards the server is healthy
with every KV slot and request row back where it started.

The budget: SPECDEPLOY_FUZZ_EXAMPLES cases per operation within SPECDEPLOY_FUZZ_MAX_TIME_S (CI: 45 s,
about 1000 cases; `make fuzz`: 15 minutes). Bodies are generated from the schema
FastAPI derives from the request models, so a field added to the API is fuzzed without touching
this file.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

EXAMPLES_PER_OPERATION = int(os.environ.get("SPECDEPLOY_FUZZ_EXAMPLES", "100"))
MAX_TIME_S = int(os.environ.get("SPECDEPLOY_FUZZ_MAX_TIME_S", "45"))
SEED = os.environ.get("SPECDEPLOY_FUZZ_SEED", "22")
# CI's 45 s reach ~1000 cases on 2 cores; far fewer means the run was starved, not fuzzed.
MIN_CASES = int(os.environ.get("SPECDEPLOY_FUZZ_MIN_CASES", "300"))
CHECKS = ("not_a_server_error", "status_code_conformance", "content_type_conformance",
          "response_schema_conformance", "negative_data_rejection")
# A generated max_tokens may ask for the whole context; keep each case's generation bounded in
# time rather than in tokens, so that a slow case fails instead of stalling CI.
REQUEST_TIMEOUT_S = 60
MAX_RUNNING_REQUESTS = 4


@pytest.fixture(scope="module")
def fuzz_server(model_dirs):
    """An engine of its own (in this process), so its KV pool can be read exactly afterwards."""
    from specdeploy.engine.serving.cli import ServerThread, free_port

    target, draft = model_dirs
    running = ServerThread([
        "engine", "serve", "--target", str(target), "--draft", str(draft), "--algorithm", "EAGLE",
        "--num-steps", "3", "--topk", "1", "--num-draft-tokens", "4", "--dtype", "float32",
        "--served-model-name", "tiny-target", "--context-length", "256",
        "--max-running-requests", str(MAX_RUNNING_REQUESTS), "--max-queued-requests", "8",
        "--max-total-tokens", "2048", "--host", "127.0.0.1", "--port", str(free_port()),
    ]).start(timeout_s=120)
    runner = running.state.scheduler.runner
    running.baseline = (runner.num_free_slots, len(runner.table._free_rows))
    yield running
    running.stop()


def test_schemathesis_finds_no_server_error(fuzz_server, tmp_path):
    """Every operation of /openapi.json, all of schemathesis's phases, within a time budget."""
    report = tmp_path / "report.json"
    cmd = [
        sys.executable, "-m", "schemathesis.cli", "run", f"{fuzz_server.base_url}/openapi.json",
        # never a 5xx; only documented status codes and content types; bodies in the documented
        # shapes (OpenAI's error shape for every error); a body the schema forbids is refused.
        "--checks", ",".join(CHECKS),
        "--max-examples", str(EXAMPLES_PER_OPERATION), "--max-time", str(MAX_TIME_S),
        "--request-timeout", str(REQUEST_TIMEOUT_S), "--workers", "1", "--seed", SEED,
        "--suppress-health-check", "all", "--continue-on-failure",
        "--report", "json", "--report-json-path", str(report), "--output-truncate", "true",
    ]
    result = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=MAX_TIME_S + 120, cwd=tmp_path,
                            env={**os.environ, "NO_COLOR": "1", "SCHEMATHESIS_HOOKS": "fuzz_hooks",
                                 "PYTHONPATH": str(Path(__file__).parent),
                                 "SPECDEPLOY_FUZZ_MODEL": fuzz_server.state.model_name, "SPECDEPLOY_FUZZ_SEED": SEED})
    tail = result.stdout[-8000:] + result.stderr[-2000:]
    assert result.returncode == 0, tail
    summary = json.loads(report.read_text())
    operations, cases = summary["operations"], summary["test_cases"]
    assert operations["tested"] == operations["total"] >= 7, operations  # every endpoint
    assert cases["with_failures"] == 0 and cases["errored"] == 0, cases
    assert cases["generated"] >= MIN_CASES, cases
    print(f"schemathesis: {cases['generated']} cases over {operations['tested']} operations, no failure")


def test_server_healthy_and_at_baseline_after_fuzzing(fuzz_server):
    url = fuzz_server.base_url
    assert httpx.get(f"{url}/health").status_code == 200
    assert httpx.get(f"{url}/ready").status_code == 200
    ok = httpx.post(f"{url}/v1/completions", json={"model": fuzz_server.state.model_name, "prompt": "ok",
                                                    "max_tokens": 2}, timeout=30)
    assert ok.status_code == 200, ok.text
    scheduler = fuzz_server.state.scheduler
    runner = scheduler.runner

    def at_baseline():
        return scheduler.is_idle and (runner.num_free_slots, len(runner.table._free_rows)) == fuzz_server.baseline

    deadline = time.monotonic() + 20
    while not at_baseline() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert (runner.num_free_slots, len(runner.table._free_rows)) == fuzz_server.baseline
    assert len(runner.table._free_rows) == MAX_RUNNING_REQUESTS
