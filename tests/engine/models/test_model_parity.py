"""Our Llama-family model against transformers on tiny random configs, float32.

Tolerance: max |logit difference| < 1e-4 (logits are O(1) for these random models). The HF
model is saved as several safetensors shards and loaded by our loader, so the weight-name
mapping and the sharded reader are covered as well.
"""

import logging

import pytest
import torch
import transformers

from specdeploy.engine.models.attention import causal_batch
from specdeploy.engine.memory.kv import KVPool, SlotTable
from specdeploy.engine.models.llama import load_target

TOL = 1e-4

BASE = dict(vocab_size=97, hidden_size=64, intermediate_size=112, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)

CONFIGS = {
    "llama3": ("LlamaConfig", "LlamaForCausalLM", dict(
        rope_theta=500000.0, head_dim=24,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=32))),
    "llama_tied_bias": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=True,
                                                                attention_bias=True, mlp_bias=True)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=False)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32, tie_word_embeddings=False)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=None)),
}


def make_hf(kind: str, tmp_path, seed: int = 0):
    cfg_cls, model_cls, extra = CONFIGS[kind]
    torch.manual_seed(seed)
    cfg = getattr(transformers, cfg_cls)(**BASE, **extra)
    hf = getattr(transformers, model_cls)(cfg).float().eval()
    with torch.no_grad():  # random biases/norm weights so that they matter
        for name, p in hf.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.normal_(0.0, 0.5 if "bias" in name else 0.1).add_(1.0 if "norm" in name else 0.0)
    hf.save_pretrained(tmp_path, max_shard_size="40KB")
    return hf


def run_ours(model, ids: list[list[int]]):
    """Prefill several prompts of different lengths in one padded batch; logits [B, Q, V]."""
    cfg = model.cfg
    kv = KVPool(cfg.num_layers, 512, cfg.num_kv_heads, cfg.head_dim, torch.float32, "cpu")
    table = SlotTable(512, 4, 128, "cpu")
    q = max(map(len, ids))
    lens = torch.tensor([len(x) for x in ids])
    slots = torch.zeros(len(ids), q, dtype=torch.int64)
    tokens = torch.zeros(len(ids), q, dtype=torch.int64)
    for b, x in enumerate(ids):
        slots[b, :len(x)] = table.alloc(len(x))
        tokens[b, :len(x)] = torch.tensor(x)
    empty = torch.zeros(len(ids), 0, dtype=torch.int64)
    batch = causal_batch(slots, lens, empty, torch.zeros(len(ids), dtype=torch.int64))
    positions = torch.arange(q).expand(len(ids), q)
    with torch.no_grad():
        out = model(tokens, positions, batch, kv)
        return model.logits(out.hidden), (kv, table, slots)


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_logits_match_transformers(kind, tmp_path):
    hf = make_hf(kind, tmp_path)
    assert len(list(tmp_path.glob("*.safetensors"))) > 1, "checkpoint should be sharded"
    ours = load_target(str(tmp_path), dtype=torch.float32, device="cpu")
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 97, (n,), generator=g).tolist() for n in (11, 5, 8)]
    logits, _ = run_ours(ours, prompts)
    for b, p in enumerate(prompts):
        with torch.no_grad():
            ref = hf(torch.tensor([p])).logits[0]
        diff = (logits[b, :len(p)] - ref).abs().max().item()
        assert diff < TOL, f"{kind} prompt {b}: max abs diff {diff}"


def test_decode_with_kv_matches_full_forward(tmp_path):
    """Token-by-token decoding over the slot pool equals the full forward (llama3 rope)."""
    hf = make_hf("llama3", tmp_path)
    ours = load_target(str(tmp_path), dtype=torch.float32, device="cpu")
    seq = torch.randint(0, 97, (14,), generator=torch.Generator().manual_seed(3)).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([seq])).logits[0]
    _, (kv, table, slots) = run_ours(ours, [seq[:6]])
    committed = slots[0].tolist()
    for t in range(6, len(seq)):
        slot = table.alloc(1)
        committed.append(int(slot))
        batch = causal_batch(slot.view(1, 1), torch.tensor([1]), torch.tensor([committed[:-1]]),
                             torch.tensor([t]))
        with torch.no_grad():
            out = ours(torch.tensor([[seq[t]]]), torch.tensor([[t]]), batch, kv)
            diff = (ours.logits(out.hidden)[0, 0] - ref[t]).abs().max().item()
        assert diff < TOL, f"position {t}: {diff}"


def test_bad_config_is_refused(tmp_path):
    from specdeploy.engine.models.llama import ModelConfig
    with pytest.raises(ValueError, match="not supported"):
        ModelConfig.from_hf(dict(BASE, model_type="gpt2", num_hidden_layers=1))
    with pytest.raises(ValueError, match="lacks 'hidden_size'"):
        ModelConfig.from_hf({"model_type": "llama"})


def test_default_eagle3_aux_layers():
    from specdeploy.engine.models.llama import default_aux_layers
    assert default_aux_layers(32) == (1, 15, 28)   # Llama-3.1-8B
    assert default_aux_layers(8) == (1, 3, 4)
    with pytest.raises(ValueError, match="at least 5"):
        default_aux_layers(4)


def test_loading_logs_one_progress_line_per_shard(tmp_path, caplog):
    make_hf("llama3", tmp_path)
    shards = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert len(shards) > 1
    with caplog.at_level(logging.INFO, logger="specdeploy.engine.load"):
        load_target(str(tmp_path), torch.float32)
    lines = [r.getMessage() for r in caplog.records if r.name == "specdeploy.engine.load"]
    assert [line.split()[1] for line in lines] == shards
    assert lines[-1].startswith(f"weights: {shards[-1]} read ({len(shards)}/{len(shards)},")
