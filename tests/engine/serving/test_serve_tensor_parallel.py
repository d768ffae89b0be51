"""`specdeploy engine serve --tensor-parallel-size 2` on CPU (gloo): the real process starts its
second rank itself, serves through HTTP the same greedy completion as the one-process server,
and a rank killed under it takes the whole server down with a non-zero exit and a log line
naming the rank (never a hang); SIGTERM drains and stops every rank with exit code 0; with
--random-weights a directory of config.json and tokenizer alone serves (real shapes, noise)."""

import os
import shutil
import re
import signal
import subprocess
import sys
import time

import openai
from engine_processes import ready  # tests/support/engine_processes.py

PROMPT = "def main(argv):\n    "


def _log_text(path) -> str:
    return path.read_text(errors="replace")


def test_tensor_parallel_serves_and_a_dead_rank_stops_it(serve_process_command, server, tmp_path):
    one_process = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
    want = one_process.completions.create(model=server.model, prompt=PROMPT, max_tokens=24, temperature=0)

    log_path = tmp_path / "serve.log"
    argv, url, wait_ready = serve_process_command("--tensor-parallel-size", "2")
    with open(log_path, "w") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, OMP_NUM_THREADS="1"))
    try:
        wait_ready(url, timeout_s=240)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        got = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=24, temperature=0)
        assert got.choices[0].text == want.choices[0].text
        assert got.usage.completion_tokens == want.usage.completion_tokens

        text = _log_text(log_path)
        assert "[tp1]" in text  # rank 1 loaded its own shards and logs as itself
        pid = int(re.search(r"started ranks 1\.\.1 \(pids (\d+)\)", text).group(1))
        os.kill(pid, signal.SIGKILL)
        t0 = time.monotonic()
        code = proc.wait(timeout=60)
        assert code != 0
        assert time.monotonic() - t0 < 30
        assert f"tensor-parallel rank 1 (pid {pid}) exited with signal SIGKILL" in _log_text(log_path)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_sigterm_stops_every_rank_with_exit_zero(serve_process_command, tmp_path):
    log_path = tmp_path / "serve.log"
    argv, url, wait_ready = serve_process_command("--tensor-parallel-size", "2")
    with open(log_path, "w") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, OMP_NUM_THREADS="1"))
    try:
        wait_ready(url, timeout_s=240)
        pid = int(re.search(r"started ranks 1\.\.1 \(pids (\d+)\)", _log_text(log_path)).group(1))
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, _log_text(log_path)[-3000:]
        assert "tensor-parallel rank 1: exiting" in _log_text(log_path)
        assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_random_weights_serve_without_a_checkpoint(model_dirs, tmp_path):
    from specdeploy.engine.serving.cli import free_port

    target = tmp_path / "target"
    shutil.copytree(model_dirs[0], target, ignore=shutil.ignore_patterns("*.safetensors"))
    port = free_port()
    argv = [sys.executable, "-P", "-m", "specdeploy.cli", "engine", "serve", "--target", str(target),
            "--algorithm", "NONE", "--random-weights", "--tensor-parallel-size", "2", "--dtype", "float32",
            "--context-length", "128", "--max-running-requests", "2", "--host", "127.0.0.1", "--port", str(port)]
    log_path = tmp_path / "serve.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, OMP_NUM_THREADS="1"))
    try:
        deadline = time.monotonic() + 240
        while not ready(f"http://127.0.0.1:{port}"):
            assert proc.poll() is None, _log_text(log_path)[-3000:]
            assert time.monotonic() < deadline, "not ready in 240 s"
            time.sleep(0.2)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120)
        out = client.completions.create(model=str(target), prompt="def f(x):", max_tokens=8, temperature=0,
                                        extra_body={"ignore_eos": True})
        assert out.usage.completion_tokens == 8
        assert "random weights" in _log_text(log_path)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
