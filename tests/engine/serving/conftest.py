"""A real engine server on loopback for the tests in this folder.

The model pair is tiny and random but built so drafts are often accepted (engine/demo/toy.py), with a
byte-level BPE tokenizer trained in a second on this package's own sources. Both are saved as
HF-style directories, so the server loads them through the same path as `specdeploy engine serve`.
"""

from __future__ import annotations

import dataclasses
import socket
import time
from pathlib import Path

import httpx
import openai
import pytest

from specdeploy.engine.demo import train
from specdeploy.engine.demo.toy import copy_draft, predictable_target, tiny_config

MODEL_NAME = "tiny-target"
CONTEXT_LENGTH = 256
MAX_RUNNING_REQUESTS = 4
MAX_QUEUED_REQUESTS = 4
MAX_TOTAL_TOKENS = 2048


def hf_config(cfg) -> dict:
    """config.json for an engine ModelConfig."""
    return {"architectures": ["LlamaForCausalLM"], "model_type": cfg.model_type, "torch_dtype": "float32",
            "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
            "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_layers,
            "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
            "head_dim": cfg.head_dim, "max_position_embeddings": cfg.max_position_embeddings,
            "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta,
            "tie_word_embeddings": cfg.tie_word_embeddings}


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("models")
    texts = list(train.read_corpus(train.corpus_files(300_000, roots=[Path(train.__file__).parent])))
    tok = train.train_tokenizer(texts, vocab_size=320)
    cfg = tiny_config(vocab_size=tok.get_vocab_size(), max_position_embeddings=CONTEXT_LENGTH)
    target, perm = predictable_target(cfg, seed=0)
    draft = copy_draft("EAGLE", target, perm)
    target_dir, draft_dir = root / "target", root / "draft"
    train.save_model(target, hf_config(cfg), target_dir)
    train.save_tokenizer(tok, target_dir)
    train.save_model(draft, hf_config(dataclasses.replace(cfg, num_layers=draft.cfg.num_layers)), draft_dir,
                     prefix="")
    return target_dir, draft_dir


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_argv(target_dir: Path, draft_dir: Path, port: int, *extra: str) -> list[str]:
    return ["engine", "serve", "--target", str(target_dir), "--draft", str(draft_dir), "--algorithm", "EAGLE",
            "--num-steps", "3", "--topk", "1", "--num-draft-tokens", "4", "--dtype", "float32",
            "--served-model-name", MODEL_NAME, "--context-length", str(CONTEXT_LENGTH),
            "--max-running-requests", str(MAX_RUNNING_REQUESTS),
            "--max-queued-requests", str(MAX_QUEUED_REQUESTS),
            "--max-total-tokens", str(MAX_TOTAL_TOKENS), "--host", "127.0.0.1", "--port", str(port),
            "--log-interval-s", "1", *extra]


def wait_ready(base_url: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{base_url}/ready", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{base_url} did not become ready in {timeout_s} s")


@dataclasses.dataclass(frozen=True)
class Server:
    url: str
    model: str
    vocab_size: int
    context_length: int
    max_running_requests: int
    max_queued_requests: int

    def metrics(self) -> dict[str, float]:
        return metric_samples(self.url)


@pytest.fixture(scope="session")
def server(model_dirs) -> Server:
    """The engine server in this process (uvicorn in a thread), built as `specdeploy engine serve` builds it."""
    from specdeploy.engine.serving.cli import ServerThread
    from specdeploy.engine.serving.tokenizer import Tokenizer

    running = ServerThread(serve_argv(*model_dirs, free_port())).start(timeout_s=120)
    yield Server(url=running.base_url, model=MODEL_NAME,
                 vocab_size=Tokenizer.from_dir(model_dirs[0]).vocab_size, context_length=CONTEXT_LENGTH,
                 max_running_requests=MAX_RUNNING_REQUESTS, max_queued_requests=MAX_QUEUED_REQUESTS)
    running.stop()


@pytest.fixture
def start_server(model_dirs):
    """Start another in-process server with extra `engine serve` flags: -> its base URL. It stops
    when the test ends."""
    from specdeploy.engine.serving.cli import ServerThread

    started = []

    def start(*extra: str) -> str:
        running = ServerThread(serve_argv(*model_dirs, free_port(), *extra)).start(timeout_s=120)
        started.append(running)
        return running.base_url

    yield start
    for running in started:
        running.stop()


@pytest.fixture
def client(server) -> openai.OpenAI:
    # No retries: the tests look at every status code the server gives.
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture
def async_client(server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def metric_samples(base_url: str) -> dict[str, float]:
    """{'name{label=value,...}': value} of every sample /metrics exposes."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for family in text_string_to_metric_families(httpx.get(f"{base_url}/metrics").text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
            out[f"{s.name}{{{labels}}}"] = s.value
    return out


@pytest.fixture(scope="session")
def serve_process_command(model_dirs):
    """-> a function of extra flags giving (argv of `specdeploy engine serve` for the tiny pair on
    a free port, run as a subprocess; its base URL; a function waiting until it is ready)."""
    import sys

    def command(*extra: str):
        port = free_port()
        argv = [sys.executable, "-P", "-m", "specdeploy.cli", *serve_argv(*model_dirs, port, *extra)]
        return argv, f"http://127.0.0.1:{port}", wait_ready
    return command


@pytest.fixture(scope="session")
def engine_process(model_dirs):
    """Start `specdeploy engine serve` as a subprocess: -> (Popen, base_url). The caller stops it."""
    import subprocess
    import sys

    started = []

    def start(*extra: str):
        port = free_port()
        argv = [sys.executable, "-P", "-m", "specdeploy.cli", *serve_argv(*model_dirs, port, *extra)]
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        started.append(proc)
        base_url = f"http://127.0.0.1:{port}"
        wait_ready(base_url)
        return proc, base_url

    yield start
    for proc in started:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="session")
def serve_command(model_dirs):
    """`engine serve` arguments for the test models on a free loopback port, plus extra flags."""
    return lambda *extra: serve_argv(*model_dirs, free_port(), *extra)
