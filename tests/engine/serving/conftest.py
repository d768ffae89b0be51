"""A real engine server on loopback for the tests in this folder.

The model pair is tiny and random but built so drafts are often accepted (engine/demo/toy.py), with a
byte-level BPE tokenizer trained in a second on this package's own sources. Both are saved as
HF-style directories, so the server loads them through the same path as `specdeploy engine serve`.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import openai
import pytest
from engine_server import (CONTEXT_LENGTH, MAX_QUEUED_REQUESTS, MAX_RUNNING_REQUESTS, MODEL_NAME, Server, free_port,
                           hf_config, serve_argv, wait_ready)

from specdeploy.engine.demo import train
from specdeploy.engine.demo.toy import copy_draft, predictable_target, tiny_config


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
