"""The exact embedding of a small target and its EAGLE head into a larger shape
(engine/demo/embed.py): on a tiny instance, in float32, the big model's logits over the small
vocabulary equal the small model's and the extra tokens' logits are exactly 0; the big head's
draft logits equal the small head's; and the engine, run on the embedded pair, emits the small
pair's tokens with the same acceptance, step by step."""

import pytest
import torch

from specdeploy.engine.demo import embed
from specdeploy.engine.demo.toy import copy_draft, predictable_target, random_requests, run_to_completion, tiny_config
from specdeploy.engine.models.attention import causal_batch
from specdeploy.engine.memory.kv import KVPool
from specdeploy.engine.runtime.runner import Runner
from specdeploy.engine.planner.plan import SpecSettings

# Every dimension grows: hidden 32 -> 64, MLP 64 -> 96, 6 -> 9 layers, 4 -> 8 query heads of
# 8 -> 16 dims, query groups 2 -> 4, vocabulary 64 -> 80.
BIG = {"hidden_size": 64, "intermediate_size": 96, "num_layers": 9, "num_heads": 8, "num_kv_heads": 2,
       "head_dim": 16, "vocab_size": 80}


def prefill(model, ids, features=None):
    c = model.cfg
    b, t = ids.shape
    kv = KVPool(c.num_layers, b * t + 1, c.num_kv_heads, c.head_dim, torch.float32, "cpu")
    slots = torch.arange(1, b * t + 1).view(b, t)
    batch = causal_batch(slots, torch.full((b,), t), torch.zeros(b, 0, dtype=torch.int64), torch.zeros(b, dtype=torch.int64))
    positions = torch.arange(t).expand(b, t)
    with torch.no_grad():
        if features is None:
            return model(ids, positions, batch, kv)
        return model(ids, features, positions, batch, kv)


@pytest.fixture(scope="module")
def pair():
    small, perm = predictable_target(tiny_config(rms_norm_eps=1e-5), seed=3, layer_scale=0.5)
    head = copy_draft("EAGLE", small, perm)
    big = embed.embed_target(small, BIG)
    return small, head, big, embed.embed_eagle_head(head, big)


def test_target_logits_are_the_small_models(pair):
    small, _, big, _ = pair
    assert embed.layer_positions(6, 9) == [0, 1, 3, 4, 6, 7]
    assert big.cfg.rms_norm_eps == pytest.approx(1e-5 * 32 / 64)
    ids = torch.randint(0, 64, (3, 17), generator=torch.Generator().manual_seed(0))
    want = small.logits(prefill(small, ids).hidden)
    got = big.logits(prefill(big, ids).hidden)                            # [3, 17, 80]
    torch.testing.assert_close(got[..., :64], want, atol=2e-5, rtol=1e-5)
    assert torch.equal(got[..., 64:], torch.zeros_like(got[..., 64:]))
    assert embed.real_logits_below_zero(got, 64) == 0
    # The extra layers do run (random q/k/v and MLP), and write nothing.
    extra = big.layers[2]
    assert extra.self_attn.qkv_proj.weight.abs().sum() > 0 and extra.self_attn.o_proj.weight.abs().sum() == 0


def test_eagle_head_logits_are_the_small_heads(pair):
    small, head, big, big_head = pair
    small.set_feature("eagle")
    big.set_feature("eagle")
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    f_small, f_big = prefill(small, ids).feature, prefill(big, ids).feature
    torch.testing.assert_close(f_big[..., :32], f_small, atol=2e-5, rtol=1e-5)
    assert torch.equal(f_big[..., 32:], torch.zeros_like(f_big[..., 32:]))
    want = head.logits(prefill(head, ids[:, 1:], f_small[:, :-1]))
    got = big_head.logits(prefill(big_head, ids[:, 1:], f_big[:, :-1]))
    torch.testing.assert_close(got[..., :64], want, atol=2e-5, rtol=1e-5)
    small.set_feature(None)
    big.set_feature(None)


def test_the_engine_runs_the_embedded_pair_as_the_small_one(pair):
    small, head, big, big_head = pair
    spec = SpecSettings("EAGLE", 3, 1, 4)
    outs, rates = [], []
    for target, draft in ((small, head), (big, big_head)):
        runner = Runner(target, draft, spec, max_total_tokens=400, max_running_requests=3)
        outs.append(run_to_completion(runner, random_requests((6, 11, 3), 16, 64)))
        rates.append(runner.num_draft_tokens_accepted / runner.num_draft_tokens_proposed)
    assert outs[0] == outs[1]
    assert rates[0] == rates[1] and 0.1 < rates[0] < 0.95


def test_shapes_that_cannot_hold_the_small_model_are_refused():
    small, _ = predictable_target(tiny_config(), seed=0)
    with pytest.raises(ValueError, match="hidden_size"):
        embed.embedded_config(small.cfg, {**BIG, "hidden_size": 16})
    with pytest.raises(ValueError, match="head_dim"):
        embed.embedded_config(small.cfg, {**BIG, "head_dim": 12})
    with pytest.raises(ValueError, match="query groups"):
        embed.embedded_config(small.cfg, {**BIG, "num_kv_heads": 8})
