"""The published-layout replicas (tests/support/published_models.py) served on the GPU by
`specdeploy engine serve` (CUDA graphs captured): the float16 / float32 pytorch_model.bin heads
cast onto the device tensor by tensor, speculative greedy text equal to target-only greedy text in
float32, and the default dtype (bfloat16) serving the same pairs."""

import socket

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
openai = pytest.importorskip("openai", reason="serves through the official client (pip install openai)")
for _server_module in ("fastapi", "uvicorn"):
    pytest.importorskip(_server_module, reason="needs the engine's server (pip install 'specdeploy[engine]')")

from published_models import (  # noqa: E402
    eagle3_llama31_instruct_8b,
    eagle_llama31_instruct_8b,
    llama_31_8b_instruct,
)

PROMPTS = ("The capital of France is", "def fibonacci(n):", "1, 2, 3,", "Once upon a time")


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    root = tmp_path_factory.mktemp("published")
    llama = llama_31_8b_instruct(root / "llama")
    return {"llama": llama, "eagle3": eagle3_llama31_instruct_8b(root / "eagle3", llama),
            "eagle": eagle_llama31_instruct_8b(root / "eagle", llama)}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _texts(replicas, draft, algorithm, dtype):
    from specdeploy.engine.serving.cli import ServerThread

    argv = ["engine", "serve", "--target", str(replicas["llama"]), "--algorithm", algorithm, "--dtype", dtype,
            "--context-length", "512", "--max-running-requests", "4", "--max-total-tokens", "8192",
            "--served-model-name", "replica", "--host", "127.0.0.1", "--port", str(_port())]
    if draft:
        argv += ["--draft", str(replicas[draft]), "--num-steps", "3", "--topk", "1", "--num-draft-tokens", "4"]
    running = ServerThread(argv).start(timeout_s=300)
    try:
        client = openai.OpenAI(base_url=f"{running.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
        outs = [client.completions.create(model="replica", prompt=p, max_tokens=48, temperature=0,
                                          extra_body={"ignore_eos": True}) for p in PROMPTS]
        assert [o.usage.completion_tokens for o in outs] == [48] * len(PROMPTS)
        return [o.choices[0].text for o in outs]
    finally:
        running.stop()


@pytest.mark.parametrize(("draft", "algorithm"), [("eagle3", "EAGLE3"), ("eagle", "EAGLE")])
def test_published_heads_are_lossless_on_the_gpu(replicas, draft, algorithm):
    assert _texts(replicas, draft, algorithm, "float32") == _texts(replicas, None, "NONE", "float32")


@pytest.mark.parametrize(("draft", "algorithm"), [("eagle3", "EAGLE3"), ("eagle", "EAGLE")])
def test_published_heads_serve_in_bfloat16(replicas, draft, algorithm):
    """The default dtype on a GPU: the float16 / float32 heads cast to bfloat16 while loading,
    every request served to its full length (bfloat16 greedy text may differ from float32's)."""
    _texts(replicas, draft, algorithm, "auto")
