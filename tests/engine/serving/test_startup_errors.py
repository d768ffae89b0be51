"""`specdeploy engine serve` given what a user gets wrong: exit code 2 and one line naming the cause
(the traceback only with --log-level debug), before the server listens where that can be known
(engine/serving/startup.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch

from specdeploy.engine.serving import startup

MODELS = Path(__file__).resolve().parents[3] / "manifests" / "models"


def serve(*argv: str, env: dict | None = None, timeout_s: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-P", "-m", "specdeploy.cli", "engine", "serve", *argv,
                           "--host", "127.0.0.1", "--port", str(_free_port())],
                          capture_output=True, text=True, timeout=timeout_s,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def errors(result: subprocess.CompletedProcess) -> list[str]:
    return [line for line in result.stderr.splitlines() if " ERROR " in line]


def assert_one_line(result: subprocess.CompletedProcess, code: int, *words: str) -> str:
    assert result.returncode == code, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    lines = errors(result)
    assert len(lines) == 1, result.stderr[-3000:]
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


def test_a_wrong_path_is_one_line_before_the_server_starts():
    result = serve("--target", "/no/such/model")
    assert_one_line(result, 2, "--target /no/such/model", "no such directory")
    assert "Uvicorn running" not in result.stderr


def test_an_unreachable_hub_names_the_url(tmp_path):
    hub = f"http://127.0.0.1:{_free_port()}"    # nothing listens there
    result = serve("--target", "acme/model", env={"HF_ENDPOINT": hub, "HF_HOME": str(tmp_path)})
    assert_one_line(result, 2, f"{hub}/acme/model/resolve/main/config.json", "unreachable")


def test_an_incompatible_pair_is_the_planners_line():
    result = serve("--target", str(MODELS / "qwen3-8b"), "--draft", str(MODELS / "eagle3-llama3.1-instruct-8b"),
                   "--algorithm", "EAGLE3")
    assert_one_line(result, 2, "DraftIncompatible", "128256", "151936")
    assert "Uvicorn running" not in result.stderr


def test_an_incompatible_pair_in_a_given_plan_is_refused_too(tmp_path):
    # The plan names EAGLE (no --algorithm on the command line): the EAGLE-3 head is the wrong kind.
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"algorithm": "EAGLE"}))
    result = serve("--target", str(MODELS / "llama-3.1-8b-instruct"), "--draft",
                   str(MODELS / "eagle3-llama3.1-instruct-8b"), "--plan", str(plan))
    assert_one_line(result, 2, "DraftIncompatible", "EAGLE-3 head", "not EAGLE")


@pytest.fixture
def unsupported_model(tmp_path) -> Path:
    config = json.loads((MODELS / "llama-3.1-8b-instruct" / "config.json").read_text())
    config.update(model_type="falcon", architectures=["FalconForCausalLM"], num_hidden_layers=2, hidden_size=64,
                  intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, vocab_size=300,
                  max_position_embeddings=256, torch_dtype="float32")
    (tmp_path / "falcon").mkdir()
    (tmp_path / "falcon" / "config.json").write_text(json.dumps(config))
    return tmp_path / "falcon"


def test_an_unsupported_architecture_is_one_line_after_the_server_started(unsupported_model):
    result = serve("--target", str(unsupported_model), "--random-weights")
    assert_one_line(result, 2, "model_type 'falcon' is not supported")


def test_debug_logs_the_traceback(unsupported_model):
    result = serve("--target", str(unsupported_model), "--random-weights", "--log-level", "debug")
    assert result.returncode == 2 and "Traceback" in result.stderr


def _request_error(cls, url: str):
    return cls("connection refused", request=httpx.Request("GET", url))


@pytest.mark.parametrize("err,code,words", [
    (_request_error(httpx.ConnectError, "https://hub.local/a/b/resolve/main/model.safetensors"), 2,
     ("https://hub.local/a/b/resolve/main/model.safetensors",)),
    (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB"), 2,
     ("out of memory while loading", "20.00 GiB", "--max-total-tokens")),
    (FileNotFoundError("/models/x has no config.json"), 2, ("/models/x has no config.json",)),
    (ValueError("the plan needs tensor_parallel_size 4 GPUs; this pod sees 1"), 2, ("this pod sees 1",)),
    (RuntimeError("device-side assert triggered"), 1, ("loading failed: RuntimeError", "--log-level debug")),
], ids=["hub", "oom", "path", "gpus", "fault"])
def test_failure_lines(err, code, words):
    got_code, line = startup.failure_line(err)
    assert got_code == code and "\n" not in line
    for word in words:
        assert word in line
