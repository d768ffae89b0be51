"""Tensor-parallel readiness without collectives: two ranks built with tp_size = 2 load their
shards from the full checkpoint tensors; adding their row-parallel partial outputs (what the
later all-reduce will do) or concatenating their vocabulary slices (the later all-gather)
reproduces the single-rank model exactly."""

import torch

from specdeploy.engine.models.attention import causal_batch
from specdeploy.engine.runtime.kv import KVPool
from specdeploy.engine.models.layers import load_state
from specdeploy.engine.models.llama import LlamaModel, rope_tables
from specdeploy.engine.demo.toy import random_target, tiny_config

TP = 2


def test_shards_recombine_to_the_full_model():
    cfg = tiny_config(num_heads=4, num_kv_heads=2, vocab_size=64)
    full = random_target(cfg, seed=4)
    state = full.state_dict()
    ranks = []
    for r in range(TP):
        m = LlamaModel(cfg, tp_rank=r, tp_size=TP).float().eval()
        load_state(m, state.items())
        ranks.append(m)
    d, heads, kv_heads = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    for r, m in enumerate(ranks):
        # The fused q/k/v rows of rank r are its own q, k and v heads, in that order.
        want = torch.cat([state[f"layers.0.self_attn.{n}_proj.weight"][r * h * d // TP:(r + 1) * h * d // TP]
                          for n, h in (("q", heads), ("k", kv_heads), ("v", kv_heads))])
        assert torch.equal(m.layers[0].self_attn.qkv_proj.weight, want)

    ids = torch.randint(0, 64, (2, 7))
    with torch.no_grad():
        emb = full.embed_tokens(ids)
        assert torch.allclose(sum(m.embed_tokens(ids) for m in ranks), emb)

        x = torch.randn(2, 7, cfg.hidden_size)
        layer = 1
        want_mlp = full.layers[layer].mlp(x)
        assert torch.allclose(sum(m.layers[layer].mlp(x) for m in ranks), want_mlp, atol=1e-5)

        # Attention with each rank's KV pool holding its kv heads only.
        batch = causal_batch(torch.arange(1, 8).expand(2, 7) + torch.tensor([[0], [7]]),
                             torch.tensor([7, 5]), torch.zeros(2, 0, dtype=torch.int64),
                             torch.zeros(2, dtype=torch.int64))
        cos, sin = rope_tables(full.inv_freq, torch.arange(7).expand(2, 7))
        pool = KVPool(1, 32, cfg.num_kv_heads, cfg.head_dim, torch.float32, "cpu")
        want = full.layers[layer].self_attn(x, cos, sin, pool.k[0], pool.v[0], batch)
        got = 0
        for r, m in enumerate(ranks):
            shard = KVPool(1, 32, cfg.num_kv_heads, cfg.head_dim, torch.float32, "cpu", r, TP)
            assert shard.k.shape[2] == cfg.num_kv_heads // TP
            got = got + m.layers[layer].self_attn(x, cos, sin, shard.k[0], shard.v[0], batch)
        valid = torch.arange(7)[None, :] < torch.tensor([[7], [5]])
        assert torch.allclose(got[valid], want[valid], atol=1e-5)

        h = torch.randn(3, cfg.hidden_size)
        assert torch.allclose(torch.cat([m.logits(h) for m in ranks], -1), full.logits(h), atol=1e-5)
