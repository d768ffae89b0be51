"""Sampling controls and log-probabilities through the runner, float32 on CPU: a speculative
runner gives target-only decoding's tokens and log-probabilities under penalties, logit bias and
min_tokens (every tree node processed with the drafted tokens on its path), target-only decoding
matches a reference loop over full forwards, and under sampling the second token follows the
penalized target distribution."""

from __future__ import annotations

import pytest
import torch

from specdeploy.engine.demo.toy import copy_draft, predictable_target, tiny_config
from specdeploy.engine.models.attention import causal_batch
from specdeploy.engine.memory.kv import KVPool
from specdeploy.engine.runtime.runner import Request, Runner
from specdeploy.engine.planner.plan import SpecSettings
from specdeploy.engine.runtime.sampling import LogitControls
from specdeploy.engine.speculative.logits import penalize
from specdeploy.engine.speculative.verify import warp_probs

PROMPTS = [[5, 5, 9], [3, 17, 42, 8, 16, 12], [60, 1, 2, 3, 4, 5]]


@pytest.fixture(scope="module")
def pair():
    target, perm = predictable_target(tiny_config(), seed=0)
    return target, perm


def full_logits(model, seq: list[int]) -> torch.Tensor:
    """logits [len(seq), V] of one forward over seq (the reference: no cache, no tree)."""
    cfg = model.cfg
    kv = KVPool(cfg.num_layers, len(seq) + 1, cfg.num_kv_heads, cfg.head_dim, torch.float32, "cpu")
    batch = causal_batch(torch.arange(1, len(seq) + 1)[None], torch.tensor([len(seq)]),
                         torch.zeros(1, 0, dtype=torch.int64), torch.tensor([0]))
    with torch.no_grad():
        out = model(torch.tensor([seq]), torch.arange(len(seq))[None], batch, kv)
        return model.logits(out.hidden[0])


def processed(logits: torch.Tensor, prompt: list[int], generated: list[int], c: LogitControls) -> torch.Tensor:
    """The controls applied to one row by hand (the reference the runner is held to)."""
    v = logits.shape[-1]
    counts = torch.bincount(torch.tensor(generated, dtype=torch.int64), minlength=v).float()[None] \
        if generated else torch.zeros(1, v)
    seen = counts > 0
    if c.repetition_penalty != 1.0:
        seen[0, prompt] = True
    out = penalize(logits[None].float(), counts, seen, torch.tensor([c.presence_penalty]),
                   torch.tensor([c.frequency_penalty]), torch.tensor([c.repetition_penalty]))[0]
    for tok, b in c.logit_bias.items():
        out[tok] += b
    if len(generated) < c.min_tokens:
        out[sorted(c.min_tokens_banned)] = float("-inf")
    return out


def reference_greedy(model, prompt, max_tokens, c: LogitControls):
    gen, lps = [], []
    for _ in range(max_tokens):
        raw = full_logits(model, prompt + gen)[-1]
        tok = int(processed(raw, prompt, gen, c).argmax())
        lps.append(float(torch.log_softmax(raw, -1)[tok]))
        gen.append(tok)
    return gen, lps


def run(runner, reqs):
    for r in reqs:
        runner.add(r)
    toks = {r.id: [] for r in reqs}
    lps = {r.id: [] for r in reqs}
    prompt_lps = {}
    while runner.num_running:
        for o in runner.step():
            toks[o.req_id] += o.token_ids
            lps[o.req_id] += [lp for lp, _ in (o.logprobs or [])]
            if o.prompt_logprobs is not None:
                prompt_lps[o.req_id] = o.prompt_logprobs
    return toks, lps, prompt_lps


CONTROLS = [
    LogitControls(frequency_penalty=1.5, presence_penalty=0.5, logprobs=3),
    LogitControls(repetition_penalty=1.8, logit_bias={7: 2.0, 9: -100.0}, logprobs=0),
    LogitControls(presence_penalty=2.0, min_tokens=6, min_tokens_banned=frozenset({11, 12}), logprobs=1),
]


def requests(max_tokens=12):
    return [Request(f"r{i}", p, max_tokens, controls=c) for i, (p, c) in enumerate(zip(PROMPTS, CONTROLS))]


def test_target_only_matches_the_reference_loop(pair):
    target, _ = pair
    runner = Runner(target, max_total_tokens=512, max_running_requests=4)
    toks, lps, _ = run(runner, requests())
    for r in requests():
        want, want_lps = reference_greedy(target, r.prompt_ids, r.max_tokens, r.controls)
        assert toks[r.id] == want
        assert lps[r.id] == pytest.approx(want_lps, abs=1e-4)
    # The controls change the output (else nothing above was tested).
    plain = Runner(target, max_total_tokens=512, max_running_requests=4)
    out, _, _ = run(plain, [Request(r.id, r.prompt_ids, r.max_tokens) for r in requests()])
    assert all(out[r.id] != toks[r.id] for r in requests())


@pytest.mark.parametrize("algorithm,topk,n", [("EAGLE", 1, 4), ("EAGLE", 2, 6), ("EAGLE3", 2, 5)])
def test_speculative_equals_target_only_under_controls(pair, algorithm, topk, n):
    target, perm = pair
    ref = Runner(target, max_total_tokens=512, max_running_requests=4)
    want, want_lps, _ = run(ref, requests())
    spec = Runner(target, copy_draft(algorithm, target, perm), SpecSettings(algorithm, 3, topk, n),
                  max_total_tokens=512, max_running_requests=4)
    got, got_lps, _ = run(spec, requests())
    assert spec.num_draft_tokens_accepted > 0  # drafts were accepted under the controls
    assert got == want
    for r in requests():
        assert got_lps[r.id] == pytest.approx(want_lps[r.id], abs=1e-4)


def test_top_logprobs_and_prompt_logprobs(pair):
    target, perm = pair
    prompt = PROMPTS[2]
    c = LogitControls(logprobs=4, prompt_logprobs=2)
    spec = Runner(target, copy_draft("EAGLE", target, perm), SpecSettings("EAGLE", 3, 1, 4),
                  max_total_tokens=512, max_running_requests=4, prefix_cache=True)
    toks, _, prompt_lps = run(spec, [Request("a", prompt, 5, controls=c)])
    full = torch.log_softmax(full_logits(target, prompt + toks["a"]), -1)
    got = prompt_lps["a"]
    assert len(got) == len(prompt) - 1
    for j, (lp, top) in enumerate(got):
        assert lp == pytest.approx(float(full[j, prompt[j + 1]]), abs=1e-4)
        ids = full[j].topk(2).indices.tolist()
        assert [t for t, _ in top] == ids
    # A second request with the same prompt still gets every prompt position (no cache reuse).
    _, _, again = run(spec, [Request("b", prompt, 2, controls=c)])
    assert [lp for lp, _ in again["b"]] == pytest.approx([lp for lp, _ in got], abs=1e-5)


def test_sampled_second_token_follows_the_penalized_target():
    draws = 3000
    target, perm = predictable_target(tiny_config(), seed=0, layer_scale=0.3)
    draft = copy_draft("EAGLE", target, perm)
    prompt, temperature = [3, 17, 42, 8], 4.0
    c = LogitControls(frequency_penalty=3.0, repetition_penalty=1.3)

    def probs(generated):
        raw = full_logits(target, prompt + generated)[-1]
        return warp_probs(processed(raw, prompt, generated, c)[None], torch.tensor([temperature]),
                          torch.tensor([0]), torch.tensor([1.0]))[0]

    p1 = probs([])
    expected = sum(p1[t] * probs([t]) for t in torch.nonzero(p1).flatten().tolist())
    runner = Runner(target, draft, SpecSettings("EAGLE", 3, 1, 4), max_total_tokens=draws * 20,
                    max_running_requests=draws, seed=5)
    toks, _, _ = run(runner, [Request(f"r{i}", prompt, 2, temperature=temperature, controls=c)
                              for i in range(draws)])
    second = torch.tensor([t[1] for t in toks.values()])
    freq = torch.bincount(second, minlength=64).float() / draws
    rate = runner.num_draft_tokens_accepted / runner.num_draft_tokens_proposed
    assert 0.05 < rate < 0.95, rate
    # A frequency's std from 3000 draws is at most 0.009: 0.04 is over 4 standard deviations.
    assert (freq - expected).abs().max() < 0.04


@pytest.mark.parametrize("mode", ["overlap", "launch_ahead", "adaptive"])
def test_controls_under_overlap_launch_ahead_and_adaptive_shapes(pair, mode):
    """The pipelined decode loops wait for a step with controls before launching the next (its
    tokens feed the next step's penalties); adaptive plain steps process their logits too."""
    from specdeploy.engine.speculative.adaptive import candidate_shapes
    from scripted_policy import ScriptedPolicy

    target, perm = pair
    want, want_lps, _ = run(Runner(target, max_total_tokens=512, max_running_requests=4), requests())
    spec = SpecSettings("EAGLE", 3, 1, 4)
    kw = dict(max_total_tokens=512, max_running_requests=4)
    if mode == "adaptive":
        shapes = candidate_shapes(3, 1, 4)
        runner = Runner(target, copy_draft("EAGLE", target, perm), spec, adaptive=True, adaptive_shapes=shapes,
                        step_costs_s={(s, 1): 1.0 for s in shapes}, **kw)
        runner.policy = ScriptedPolicy(runner.shapes, 0, None)
    else:
        runner = Runner(target, copy_draft("EAGLE", target, perm), spec, **{mode: True}, **kw)
    # A request without controls rides along (it takes the eager steps too, unchanged).
    reqs = requests() + [Request("plain", [9, 8, 7], 12)]
    got, got_lps, _ = run(runner, reqs)
    ref_plain, _, _ = run(Runner(target, max_total_tokens=512, max_running_requests=4), [Request("plain", [9, 8, 7], 12)])
    assert {k: v for k, v in got.items() if k != "plain"} == want
    assert got["plain"] == ref_plain["plain"]
    for r in requests():
        assert got_lps[r.id] == pytest.approx(want_lps[r.id], abs=1e-4)
