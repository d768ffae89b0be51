"""End to end through the runner: with sampling, the second generated token (produced by the
first speculative iteration: an accepted draft or the bonus token) is distributed as the
target's own sampling distribution. The exact marginal is computed from the target:
P(t2) = sum_t1 P(t1 | prompt) P(t2 | prompt, t1), both after temperature / top-p."""

import pytest
import torch

from specdeploy.engine.models.attention import causal_batch
from specdeploy.engine.memory.kv import KVPool
from specdeploy.engine.runtime.runner import Request, Runner
from specdeploy.engine.planner.plan import SpecSettings
from specdeploy.engine.demo.toy import copy_draft, predictable_target, run_to_completion, tiny_config
from specdeploy.engine.speculative.verify import warp_probs

PROMPT = [3, 17, 42, 8]
DRAWS = 3000


def next_token_probs(model, seq, temperature, top_p):
    cfg = model.cfg
    kv = KVPool(cfg.num_layers, len(seq) + 1, cfg.num_kv_heads, cfg.head_dim, torch.float32, "cpu")
    batch = causal_batch(torch.arange(1, len(seq) + 1)[None], torch.tensor([len(seq)]),
                         torch.zeros(1, 0, dtype=torch.int64), torch.tensor([0]))
    with torch.no_grad():
        out = model(torch.tensor([seq]), torch.arange(len(seq))[None], batch, kv)
        logits = model.logits(out.hidden[:, -1])
    return warp_probs(logits, torch.tensor([temperature]), torch.tensor([0]), torch.tensor([top_p]))[0]


@pytest.mark.parametrize("algorithm,topk,n,top_p", [("EAGLE3", 1, 4, 1.0), ("EAGLE", 2, 5, 0.9)])
def test_second_token_follows_the_target(algorithm, topk, n, top_p):
    target, perm = predictable_target(tiny_config(), seed=0, layer_scale=0.3)
    draft = copy_draft(algorithm, target, perm)
    temperature = 4.0  # the toy target's logits are sharp: spread them so many tokens occur
    p1 = next_token_probs(target, PROMPT, temperature, top_p)
    expected = sum(p1[t] * next_token_probs(target, PROMPT + [t], temperature, top_p)
                   for t in torch.nonzero(p1).flatten().tolist())
    runner = Runner(target, draft, SpecSettings(algorithm, 3, topk, n), max_total_tokens=DRAWS * 20,
                    max_running_requests=DRAWS, seed=5)
    reqs = [Request(f"r{i}", PROMPT, 2, temperature=temperature, top_p=top_p) for i in range(DRAWS)]
    out = run_to_completion(runner, reqs)
    second = torch.tensor([toks[1] for toks in out.values()])
    freq = torch.bincount(second, minlength=64).float() / DRAWS
    rate = runner.num_draft_tokens_accepted / runner.num_draft_tokens_proposed
    assert 0.1 < rate < 0.9, rate  # second tokens come both from accepted drafts and from bonuses
    # max std of a frequency from 3000 draws is 0.009: 0.04 is over 4 standard deviations.
    assert (freq - expected).abs().max() < 0.04, (freq - expected).abs().max()
