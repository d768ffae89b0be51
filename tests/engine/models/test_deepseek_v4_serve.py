"""`specdeploy engine serve` on a DeepSeek-V4 model directory (published tensor names, its MTP
layer under mtp.0.*, a tokenizer): served through the openai client, MTP speculation answers what
the target alone answers."""

from __future__ import annotations

import copy
from pathlib import Path

import openai
import pytest

from specdeploy.engine.demo import train
from specdeploy.engine.serving.cli import ServerThread, free_port

from v4_tiny import TINY, engine_model, hf_model, random_mtp, save_published

pytest.importorskip("transformers.models.deepseek_v4")


def save_model_dir(root: Path, **overrides) -> Path:
    texts = list(train.read_corpus(train.corpus_files(200_000, roots=[Path(train.__file__).parent])))
    tok = train.train_tokenizer(texts, vocab_size=160)
    config = {**copy.deepcopy(TINY), "vocab_size": tok.get_vocab_size(), "eos_token_id": 0, "bos_token_id": 0,
              **overrides}
    hf = hf_model(config)
    save_published(root, config, hf, random_mtp(engine_model(config, hf)))
    train.save_tokenizer(tok, root)
    return root


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return save_model_dir(tmp_path_factory.mktemp("v4"))


MTP = ("--algorithm", "MTP", "--num-steps", "2", "--topk", "2", "--num-draft-tokens", "4")


def serve_argv(model_dir: Path, *extra: str) -> list[str]:
    return ["engine", "serve", "--target", str(model_dir), *extra, "--dtype", "float32",
            "--served-model-name", "v4", "--context-length", "96", "--max-running-requests", "2",
            "--max-total-tokens", "512", "--host", "127.0.0.1", "--port", str(free_port())]


def texts_from(base_url: str) -> list[str]:
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
    texts = []
    for prompt in ("def main():", "import torch\n", "x" * 40):
        out = client.completions.create(model="v4", prompt=prompt, max_tokens=12, temperature=0,
                                        extra_body={"ignore_eos": True})
        assert out.usage.completion_tokens == 12
        texts.append(out.choices[0].text)
    return texts


def complete(model_dir: Path, *algorithm: str):
    """-> (the texts, the server's runner)."""
    running = ServerThread(serve_argv(model_dir, *algorithm)).start(timeout_s=180)
    try:
        return texts_from(running.base_url), running.state.scheduler.runner
    finally:
        running.stop()


def test_serve_deepseek_v4_with_its_mtp_layer(model_dir):
    target_only, _ = complete(model_dir, "--algorithm", "NONE")
    speculative, runner = complete(model_dir, *MTP)
    assert runner.num_draft_tokens_proposed > 0
    assert speculative == target_only
    adaptive, runner = complete(model_dir, *MTP, "--adaptive-speculation")  # step costs measured at start-up
    assert runner.policy is not None and runner.draft_kv.lags
    assert adaptive == target_only


def test_split_prefill_and_decode_servers_answer_as_one(model_dir):
    """`--role prefill` and `--role decode` behind `specdeploy router`: the kept rows of every
    target and MTP pool and the carried hc_mult x hidden_size streams move through Mooncake (TCP,
    staged); greedy MTP text is the target-only text, and both servers end idle."""
    import httpx

    from specdeploy.engine.serving.disagg.router import RouterThread

    target_only, _ = complete(model_dir, "--algorithm", "NONE")
    host = ("--transfer-host", "127.0.0.1")
    prefill = ServerThread(serve_argv(model_dir, *MTP, "--role", "prefill", *host)).start(timeout_s=180)
    decode = ServerThread(serve_argv(model_dir, *MTP, "--role", "decode", *host)).start(timeout_s=180)
    router = RouterThread([prefill.base_url], [decode.base_url], free_port()).start()
    try:
        assert texts_from(router.base_url) == target_only
        width = httpx.get(f"{decode.base_url}/disagg/info", timeout=10).json()["metadata_width"]
        assert width == 4 * TINY["hidden_size"]  # the hc_mult 4 streams, not hidden_size
        for url in (prefill.base_url, decode.base_url):
            s = httpx.get(f"{url}/disagg/status", timeout=10).json()
            assert s["running"] == 0 and s["free_slots"] == s["capacity_slots"]
            assert s["staging_free_bytes"] == s["staging_bytes"]
        assert decode.state.scheduler.runner.num_draft_tokens_accepted > 0
    finally:
        router.stop()
        decode.stop()
        prefill.stop()


def test_tensor_parallel_split_roles_answer_as_one(tmp_path):
    """Both roles at --tensor-parallel-size 2 (gloo; each server a process of its own with its
    second rank): the routed experts are split over the ranks, the pools are every rank's own
    (attention is replicated), so each rank's copy of the kept rows travels in rank 0's region and
    comes back to its rank on the decode side. Greedy MTP text is the one-process target-only
    text."""
    import httpx
    from engine_processes import serving  # tests/support/engine_processes.py

    from specdeploy.engine.serving.disagg.router import RouterThread

    model_dir = save_model_dir(tmp_path, n_routed_experts=4)  # the experts split over two ranks
    target_only, _ = complete(model_dir, "--algorithm", "NONE")
    flags = (*MTP, "--transfer-host", "127.0.0.1", "--tensor-parallel-size", "2")
    argvs = {role: serve_argv(model_dir, *flags, "--role", role) for role in ("prefill", "decode")}
    with serving(argvs, tmp_path) as urls:
        router = RouterThread([urls["prefill"]], [urls["decode"]], free_port()).start()
        try:
            assert texts_from(router.base_url) == target_only
        finally:
            router.stop()
        status = httpx.get(f"{urls['prefill']}/disagg/status", timeout=10).json()
        assert status["transfers"] == 3 and status["free_slots"] == status["capacity_slots"]
    for role in argvs:
        assert "[tp1]" in (tmp_path / f"{role}.log").read_text(errors="replace")  # rank 1 ran its share
