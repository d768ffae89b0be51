"""`specdeploy engine serve` on a DeepSeek-V4 model directory (published tensor names, its MTP
layer under mtp.0.*, a tokenizer): served through the openai client, MTP speculation answers what
the target alone answers."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import openai
import pytest
from safetensors.torch import save_file

from specdeploy.engine.demo import train
from specdeploy.engine.serving.cli import ServerThread, free_port

from v4_tiny import TINY, engine_model, hf_model, published, random_mtp

pytest.importorskip("transformers.models.deepseek_v4")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("v4")
    texts = list(train.read_corpus(train.corpus_files(200_000, roots=[Path(train.__file__).parent])))
    tok = train.train_tokenizer(texts, vocab_size=160)
    config = {**copy.deepcopy(TINY), "vocab_size": tok.get_vocab_size(), "eos_token_id": 0, "bos_token_id": 0}
    hf = hf_model(config)
    mtp = random_mtp(engine_model(config, hf))
    tensors = {published(k): v.contiguous() for k, v in hf.state_dict().items()}
    tensors.update({"mtp.0." + published(k.removeprefix("layers.0.")): v.contiguous()
                    for k, v in mtp.state_dict().items() if not k.startswith("layers.0.mlp.experts.")})
    experts = mtp.layers[0].mlp.experts
    i = config["moe_intermediate_size"]
    for e in range(experts.gate_up_proj.shape[0]):
        tensors[f"mtp.0.ffn.experts.{e}.w1.weight"] = experts.gate_up_proj[e, :i].contiguous()
        tensors[f"mtp.0.ffn.experts.{e}.w3.weight"] = experts.gate_up_proj[e, i:].contiguous()
        tensors[f"mtp.0.ffn.experts.{e}.w2.weight"] = experts.down_proj[e].contiguous()
    # the target's routed experts per expert, as published
    for name in [n for n in tensors if n.endswith("ffn.experts.gate_up_proj") and not n.startswith("mtp.")]:
        stacked, down = tensors.pop(name), tensors.pop(name.replace("gate_up_proj", "down_proj"))
        base = name.removesuffix("gate_up_proj")
        for e in range(stacked.shape[0]):
            tensors[f"{base}{e}.w1.weight"] = stacked[e, :i].contiguous()
            tensors[f"{base}{e}.w3.weight"] = stacked[e, i:].contiguous()
            tensors[f"{base}{e}.w2.weight"] = down[e].contiguous()
    save_file(tensors, str(root / "model.safetensors"))
    (root / "config.json").write_text(json.dumps(config))
    train.save_tokenizer(tok, root)
    return root


def complete(model_dir: Path, *algorithm: str) -> tuple[list[str], int]:
    running = ServerThread([
        "engine", "serve", "--target", str(model_dir), *algorithm, "--dtype", "float32",
        "--served-model-name", "v4", "--context-length", "96", "--max-running-requests", "2",
        "--max-total-tokens", "512", "--host", "127.0.0.1", "--port", str(free_port())]).start(timeout_s=180)
    try:
        client = openai.OpenAI(base_url=f"{running.base_url}/v1", api_key="unused", max_retries=0)
        texts = []
        for prompt in ("def main():", "import torch\n"):
            out = client.completions.create(model="v4", prompt=prompt, max_tokens=12, temperature=0,
                                            extra_body={"ignore_eos": True})
            assert out.usage.completion_tokens == 12
            texts.append(out.choices[0].text)
        return texts, running.state.scheduler.runner.num_draft_tokens_proposed
    finally:
        running.stop()


def test_serve_deepseek_v4_with_its_mtp_layer(model_dir):
    target_only, _ = complete(model_dir, "--algorithm", "NONE")
    speculative, proposed = complete(model_dir, "--algorithm", "MTP", "--num-steps", "2", "--topk", "2",
                                     "--num-draft-tokens", "4")
    assert proposed > 0
    assert speculative == target_only
