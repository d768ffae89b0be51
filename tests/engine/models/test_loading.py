"""Loading the published checkpoint layouts: draft heads (EAGLE `fc`/`layers.0`, EAGLE-3
`midlayer`/`d2t`/`t2d`, MTP) and an hc_mult = 4 target whose hyper-connection weights use
DeepSeek-V4's release names. Written with safetensors, read back with our loaders, and compared
by output."""

import json

import pytest
import torch
from safetensors.torch import save_file

from specdeploy.engine.models.attention import causal_batch
from specdeploy.engine.models.draft import load_draft
from specdeploy.engine.memory.kv import KVPool
from specdeploy.engine.models.llama import load_target
from specdeploy.engine.demo.toy import copy_draft, predictable_target, tiny_config


def _config_json(cfg, **extra):
    return dict(model_type="llama", hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
                num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, vocab_size=cfg.vocab_size,
                rms_norm_eps=cfg.rms_norm_eps, rope_theta=cfg.rope_theta,
                max_position_embeddings=cfg.max_position_embeddings, **extra)


def _save(path, tensors: dict, config: dict, shards: int = 2):
    names = sorted(tensors)
    for i in range(shards):
        part = {n: tensors[n].contiguous() for n in names[i::shards]}
        save_file(part, str(path / f"model-{i + 1:05d}-of-{shards:05d}.safetensors"))
    (path / "config.json").write_text(json.dumps(config))


def _run(model, cfg_layers, kv_heads, head_dim, ids, hidden=None):
    kv = KVPool(cfg_layers, 64, kv_heads, head_dim, torch.float32, "cpu")
    q = ids.shape[1]
    batch = causal_batch(torch.arange(1, q + 1)[None], torch.tensor([q]),
                         torch.zeros(1, 0, dtype=torch.int64), torch.tensor([0]))
    pos = torch.arange(q)[None]
    with torch.no_grad():
        if hidden is None:
            return model.logits(model(ids, pos, batch, kv).hidden)
        return model.logits(model(ids, hidden, pos, batch, kv))


def test_hc_target_with_release_names(tmp_path):
    cfg = tiny_config(hc_mult=4)
    model, _ = predictable_target(cfg, seed=3)
    renamed = {}
    for name, t in model.state_dict().items():
        name = name.replace("attn_hc.", "hc_attn_").replace("ffn_hc.", "hc_ffn_").replace("hc_head.", "hc_head_")
        renamed["model." + name if not name.startswith("lm_head") else name] = t
    _save(tmp_path, renamed, _config_json(cfg, hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6))
    loaded = load_target(str(tmp_path), dtype=torch.float32)
    ids = torch.randint(0, 64, (1, 9))
    assert torch.equal(_run(model, cfg.num_layers, 2, 8, ids), _run(loaded, cfg.num_layers, 2, 8, ids))
    assert loaded.cfg.spec_hidden_size == 4 * cfg.hidden_size


@pytest.mark.parametrize("algorithm,hc_mult", [("EAGLE", 1), ("EAGLE3", 1), ("MTP", 1), ("EAGLE", 4), ("MTP", 4)])
def test_draft_layouts_round_trip(tmp_path, algorithm, hc_mult):
    cfg = tiny_config(hc_mult=hc_mult)
    target, perm = predictable_target(cfg, seed=0)
    kw = {"draft_vocab": torch.arange(0, 64, 2)} if algorithm == "EAGLE3" else {}
    head = copy_draft(algorithm, target, perm, **kw)
    tensors = dict(head.state_dict())
    tensors["embed_tokens.weight"] = target.embed_tokens.weight  # published heads often ship it
    extra = {"draft_vocab_size": 32} if algorithm == "EAGLE3" else {}
    _save(tmp_path, tensors, _config_json(tiny_config(num_layers=1), **extra))
    target.set_feature({"EAGLE": "eagle", "EAGLE3": "eagle3", "MTP": "mtp"}[algorithm])
    loaded = load_draft(str(tmp_path), algorithm, target, dtype=torch.float32)
    ids = torch.randint(0, 64, (1, 6))
    hidden = torch.randn(1, 6, head.input_size)
    ours = _run(head, 1, 2, 8, ids, hidden)
    assert torch.equal(ours, _run(loaded, 1, 2, 8, ids, hidden))
    if algorithm == "EAGLE3":
        assert ours.shape[-1] == 32
        assert torch.equal(loaded.to_target_ids(torch.arange(32)), torch.arange(0, 64, 2))


def test_missing_and_unknown_tensors_are_named(tmp_path):
    cfg = tiny_config()
    target, perm = predictable_target(cfg)
    tensors = dict(copy_draft("EAGLE", target, perm).state_dict())
    del tensors["layers.0.mlp.up_proj.weight"]
    tensors["layers.0.surprise"] = torch.zeros(1)
    _save(tmp_path, tensors, _config_json(tiny_config(num_layers=1)), shards=1)
    with pytest.raises(ValueError, match="surprise"):
        load_draft(str(tmp_path), "EAGLE", target, dtype=torch.float32)
    del tensors["layers.0.surprise"]
    _save(tmp_path, tensors, _config_json(tiny_config(num_layers=1)), shards=1)
    with pytest.raises(ValueError, match="missing tensors.*up_proj"):
        load_draft(str(tmp_path), "EAGLE", target, dtype=torch.float32)


def test_fused_projections_keep_checkpoint_names():
    """q/k/v and gate/up run as one matmul each, but the state dict (what checkpoints are written
    from) holds the separate HF names, and loading it back fills every slice."""
    cfg = tiny_config()
    model, _ = predictable_target(cfg, seed=5)
    state = model.state_dict()
    assert not any("qkv_proj" in n or "gate_up_proj" in n for n in state)
    assert state["layers.2.self_attn.k_proj.weight"].shape == (cfg.num_kv_heads * cfg.head_dim, cfg.hidden_size)
    fresh, _ = predictable_target(cfg, seed=6)
    from specdeploy.engine.models.layers import load_state
    load_state(fresh, state.items())
    for name, tensor in fresh.state_dict().items():
        assert torch.equal(tensor, state[name]), name
    del state["layers.1.self_attn.v_proj.weight"]
    with pytest.raises(ValueError, match=r"missing tensors.*layers\.1\.self_attn\.v_proj\.weight"):
        load_state(fresh, state.items())
