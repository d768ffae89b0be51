"""Checkpoints as they are published, served: tiny replicas of meta-llama/Llama-3.1-8B-Instruct
(4 bfloat16 safetensors shards + index), Qwen/Qwen3-8B (5 shards), yuhuili/EAGLE3-LLaMA3.1-Instruct-8B
(float16 pytorch_model.bin with d2t/t2d) and yuhuili/EAGLE-LLaMA3.1-Instruct-8B (float32
pytorch_model.bin carrying the target's embedding), written by tests/support/published_models.py.

Each target/draft pair goes through `specdeploy engine serve` and the `openai` client: greedy text
equals transformers' own greedy generation on the same files (with generation_config.json's eos
list ending the turn), speculative equals target-only, and a request without sampling fields
gets generation_config.json's defaults.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import openai
import pytest
import torch
from published_models import (
    EAGLE3_DRAFT_VOCAB,
    eagle3_llama31_instruct_8b,
    eagle_llama31_instruct_8b,
    llama_31_8b_instruct,
    qwen3_8b,
)

PROMPTS = ("The capital of France is", "def fibonacci(n):", "1, 2, 3,")
CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hello."}]
MAX_TOKENS = 20


@pytest.fixture(scope="module")
def replicas(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("published")
    llama = llama_31_8b_instruct(root / "Llama-3.1-8B-Instruct")
    return {
        "llama": llama,
        "qwen3": qwen3_8b(root / "Qwen3-8B"),
        "eagle3": eagle3_llama31_instruct_8b(root / "EAGLE3-LLaMA3.1-Instruct-8B", llama),
        "eagle": eagle_llama31_instruct_8b(root / "EAGLE-LLaMA3.1-Instruct-8B", llama),
    }


# ---- the files are the published ones -------------------------------------------------------

EAGLE3_TENSORS = {
    "fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d",
    "midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight", "midlayer.post_attention_layernorm.weight",
    *(f"midlayer.self_attn.{p}_proj.weight" for p in "qkvo"),
    *(f"midlayer.mlp.{p}_proj.weight" for p in ("gate", "up", "down")),
}
EAGLE_TENSORS = {
    "embed_tokens.weight", "fc.weight", "fc.bias", "layers.0.post_attention_layernorm.weight",
    *(f"layers.0.self_attn.{p}_proj.weight" for p in "qkvo"),
    *(f"layers.0.mlp.{p}_proj.weight" for p in ("gate", "up", "down")),
}


def _safetensors_dtypes(directory: Path) -> dict[str, str]:
    from safetensors import safe_open

    index = json.loads((directory / "model.safetensors.index.json").read_text())
    out = {}
    for file in sorted(set(index["weight_map"].values())):
        header_len = int.from_bytes((directory / file).read_bytes()[:8], "little")
        header = json.loads((directory / file).read_bytes()[8:8 + header_len])
        out.update({n: e["dtype"] for n, e in header.items() if n != "__metadata__"})
        with safe_open(str(directory / file), "pt") as f:
            assert set(f.keys()) == {n for n, v in index["weight_map"].items() if v == file}
    return out


@pytest.mark.parametrize(("name", "shards", "extra"), [("llama", 4, ()), ("qwen3", 5, ("self_attn.q_norm", "self_attn.k_norm"))])
def test_target_layouts(replicas, name, shards, extra):
    directory = replicas[name]
    dtypes = _safetensors_dtypes(directory)
    assert sorted(p.name for p in directory.glob("*.safetensors")) == [
        f"model-{i:05d}-of-{shards:05d}.safetensors" for i in range(1, shards + 1)]
    assert set(dtypes.values()) == {"BF16"}
    assert {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"} <= dtypes.keys()
    for part in ("input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.o_proj",
                 "mlp.gate_proj", "mlp.down_proj", *extra):
        assert f"model.layers.5.{part}.weight" in dtypes
    assert not any("rotary_emb" in n for n in dtypes)


def test_head_layouts(replicas):
    eagle3 = torch.load(replicas["eagle3"] / "pytorch_model.bin", weights_only=True)
    assert set(eagle3) == EAGLE3_TENSORS
    assert {str(t.dtype) for n, t in eagle3.items() if n not in ("d2t", "t2d")} == {"torch.float16"}
    assert eagle3["d2t"].dtype == torch.int64 and eagle3["t2d"].dtype == torch.bool
    assert eagle3["lm_head.weight"].shape[0] == EAGLE3_DRAFT_VOCAB == eagle3["d2t"].shape[0]
    assert int(eagle3["t2d"].sum()) == EAGLE3_DRAFT_VOCAB
    config = json.loads((replicas["eagle3"] / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["draft_vocab_size"] == EAGLE3_DRAFT_VOCAB
    eagle = torch.load(replicas["eagle"] / "pytorch_model.bin", weights_only=True)
    assert set(eagle) == EAGLE_TENSORS
    assert {t.dtype for t in eagle.values()} == {torch.float32}
    assert not list(replicas["eagle"].glob("*.safetensors"))


# ---- the engine reads them as transformers does ---------------------------------------------

def _transformers(directory: Path):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32).eval()


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_engine_logits_equal_transformers_on_the_replica(replicas, name):
    from specdeploy.engine.models.attention import causal_batch
    from specdeploy.engine.models.llama import load_target
    from specdeploy.engine.memory.kv import KVPool

    model = load_target(str(replicas[name]), torch.float32)
    ids = torch.tensor([[5, 17, 42, 99, 3, 250, 7, 64]])
    cfg = model.cfg
    kv = KVPool(cfg.num_layers, 64, cfg.num_kv_heads, cfg.head_dim, torch.float32, "cpu")
    q = ids.shape[1]
    batch = causal_batch(torch.arange(1, q + 1)[None], torch.tensor([q]),
                         torch.zeros(1, 0, dtype=torch.int64), torch.tensor([0]))
    with torch.no_grad():
        ours = model.logits(model(ids, torch.arange(q)[None], batch, kv).hidden)
        theirs = _transformers(replicas[name])(ids).logits.float()
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


def test_heads_keep_their_own_rotary_base(replicas):
    """A head is run with the rotary frequencies its config.json gives: the EAGLE-3 head names no
    rope_theta (10000, as it was trained), the EAGLE-1 head 500000 without llama3 scaling; the
    target's are 500000 with llama3 scaling."""
    from specdeploy.engine.models.draft import load_draft
    from specdeploy.engine.models.layers import rope_inv_freq
    from specdeploy.engine.models.llama import load_target

    target = load_target(str(replicas["llama"]), torch.float32, feature_kind="eagle3")
    eagle3 = load_draft(str(replicas["eagle3"]), "EAGLE3", target, torch.float32)
    torch.testing.assert_close(eagle3.inv_freq, rope_inv_freq(8, 10000.0, None))
    target = load_target(str(replicas["llama"]), torch.float32, feature_kind="eagle")
    eagle = load_draft(str(replicas["eagle"]), "EAGLE", target, torch.float32)
    torch.testing.assert_close(eagle.inv_freq, rope_inv_freq(8, 500000.0, None))
    assert not torch.allclose(target.inv_freq, eagle.inv_freq)


# ---- served -------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve_argv(target: Path, draft: Path | None, algorithm: str, port: int) -> list[str]:
    argv = ["engine", "serve", "--target", str(target), "--algorithm", algorithm, "--dtype", "float32",
            "--context-length", "256", "--max-running-requests", "2", "--max-total-tokens", "2048",
            "--served-model-name", "replica", "--host", "127.0.0.1", "--port", str(port)]
    if draft is not None:
        argv += ["--draft", str(draft), "--num-steps", "3", "--topk", "1", "--num-draft-tokens", "4"]
    return argv


class _Served:
    """One `specdeploy engine serve`: in this process (ServerThread, the same code path), or as
    the console script in a subprocess (`process=True`)."""

    def __init__(self, argv: list[str], process: bool):
        port = int(argv[argv.index("--port") + 1])
        self.url = f"http://127.0.0.1:{port}"
        self.proc = self.thread = None
        if process:
            script = Path(sys.executable).with_name("specdeploy")
            command = [str(script)] if script.exists() else [sys.executable, "-P", "-m", "specdeploy.cli"]
            self.proc = subprocess.Popen([*command, *argv], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            self._wait()
        else:
            from specdeploy.engine.serving.cli import ServerThread

            self.thread = ServerThread(argv).start(timeout_s=180)
        self.client = openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=120)

    def _wait(self, timeout_s: float = 180.0) -> None:
        import time

        import httpx

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"engine serve exited {self.proc.returncode}:\n{self.proc.stdout.read()}")
            try:
                if httpx.get(f"{self.url}/ready", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"{self.url} not ready in {timeout_s} s")

    def stop(self) -> str:
        if self.thread is not None:
            self.thread.stop()
            return ""
        self.proc.terminate()
        out, _ = self.proc.communicate(timeout=60)
        return out

    def complete(self, prompt: str, **kw) -> openai.types.Completion:
        return self.client.completions.create(model="replica", prompt=prompt, max_tokens=MAX_TOKENS,
                                              temperature=0, **kw)

    def chat(self, **kw):
        return self.client.chat.completions.create(model="replica", messages=CHAT, max_tokens=MAX_TOKENS,
                                                   temperature=0, **kw)


def _greedy_reference(directory: Path) -> tuple[dict[str, str], tuple[str, str]]:
    """transformers' greedy text on the replica: each prompt for MAX_TOKENS tokens (no eos), and
    the chat turn ended by generation_config.json's eos list -> (texts, (chat text, reason))."""
    from specdeploy.engine.serving.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(directory)
    model = _transformers(directory)
    texts = {}
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = tok.encode(prompt)
            out = model.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)
            texts[prompt] = tok.decode(out[0, len(ids):].tolist())
        ids = tok.encode_chat(CHAT)
        # generation_config.json (read by transformers itself) supplies the eos list.
        out = model.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False)[0, len(ids):].tolist()
    ended = bool(out) and out[-1] in tok.eos_token_ids
    chat = tok.decode(out[:-1] if ended else out)
    return texts, (chat, "stop" if ended else "length")


PAIRS = [
    # (target, draft, algorithm, as a subprocess through the console script)
    ("llama", "eagle3", "EAGLE3", True),
    ("llama", "eagle", "EAGLE", False),
    ("llama", None, "NONE", False),
    ("qwen3", None, "NONE", False),
]


@pytest.mark.parametrize(("target", "draft", "algorithm", "process"), PAIRS,
                         ids=[f"{t}+{d or 'none'}" for t, d, _, _ in PAIRS])
def test_pairs_serve_what_transformers_generates(replicas, target, draft, algorithm, process):
    texts, (chat_text, chat_reason) = _greedy_reference(replicas[target])
    served = _Served(_serve_argv(replicas[target], replicas[draft] if draft else None, algorithm, _free_port()), process)
    try:
        for prompt in PROMPTS:
            got = served.complete(prompt, extra_body={"ignore_eos": True})
            assert got.choices[0].text == texts[prompt], prompt
            assert got.usage.completion_tokens == MAX_TOKENS
        chat = served.chat()
        assert chat.choices[0].message.content == chat_text
        assert chat.choices[0].finish_reason == chat_reason
        streamed = "".join(c.choices[0].delta.content or "" for c in served.chat(stream=True) if c.choices)
        assert streamed == chat_text
    finally:
        log = served.stop()
    if process:
        assert "tokenizer:" in log and "(generation_config.json)" in log, log[-2000:]
    if target == "llama":
        # The replica's turns end with <|eot_id|> (the model is steered so), and the server stops there.
        assert chat_reason == "stop"


def test_requests_without_sampling_fields_get_generation_config_defaults(replicas):
    from specdeploy.engine.serving.server import ChatBody, sampling_params
    from specdeploy.engine.serving.tokenizer import Tokenizer

    llama, qwen = Tokenizer.from_dir(replicas["llama"]), Tokenizer.from_dir(replicas["qwen3"])
    assert llama.eos_token_ids == {257, 264, 265}      # <|end_of_text|>, <|eom_id|>, <|eot_id|>
    assert qwen.eos_token_ids == {258, 256}            # <|im_end|>, <|endoftext|>
    body = ChatBody(model="replica", messages=CHAT)
    p = sampling_params(body, 8, llama)
    assert (p.temperature, p.top_p, p.top_k) == (0.6, 0.9, 0)
    p = sampling_params(body, 8, qwen)
    assert (p.temperature, p.top_p, p.top_k) == (0.6, 0.95, 20)
    p = sampling_params(ChatBody(model="replica", messages=CHAT, temperature=0.0, top_k=5), 8, qwen)
    assert (p.temperature, p.top_p, p.top_k) == (0.0, 0.95, 5)   # what the request names wins
