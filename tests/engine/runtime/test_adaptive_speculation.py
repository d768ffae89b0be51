"""Adaptive speculation in the runner: whatever shape each step runs (NONE, chains of every
depth, a tree), greedy output equals target-only output token for token, and after plain steps
the draft's catch-up leaves its KV and carried state exactly as a draft extend after every token
would have. The policy itself is tested in tests/unit/test_adaptive_policy.py."""

import pytest
import torch
from scripted_policy import ScriptedPolicy  # tests/support/scripted_policy.py
from specdeploy.engine.demo.toy import copy_draft, predictable_target, tiny_config
from specdeploy.engine.runtime.runner import Request, Runner
from specdeploy.engine.planner.plan import SpecSettings
from specdeploy.engine.speculative.adaptive import (
    NONE,
    SpecShape,
    candidate_shapes,
)

PROMPT_LENS = (5, 12, 1, 9)
MAX_TOKENS = 24
_TARGETS = {}


def target_for(hc_mult: int):
    if hc_mult not in _TARGETS:
        _TARGETS[hc_mult] = predictable_target(tiny_config(hc_mult=hc_mult), seed=0, layer_scale=0.5)
    return _TARGETS[hc_mult]


def requests(lens=PROMPT_LENS, max_tokens=MAX_TOKENS, **kw):
    return [Request(f"r{i}", torch.randint(0, 64, (n,), generator=torch.Generator().manual_seed(i)).tolist(),
                    max_tokens, **kw) for i, n in enumerate(lens)]


def generate(runner: Runner, reqs, stagger: bool = False) -> dict[str, list[int]]:
    """Run to completion; stagger: admit one request per step (batch sizes change while running)."""
    free = runner.num_free_slots
    waiting = list(reqs)
    out = {r.id: [] for r in reqs}
    while waiting and not stagger:
        runner.add(waiting.pop(0))
    while waiting or runner.num_running:
        if waiting:
            runner.add(waiting.pop(0))
        for o in runner.step():
            out[o.req_id] += o.token_ids
    assert runner.num_free_slots == free, "KV slots leaked"
    return out


def adaptive_runner(target, draft, spec, shapes=None, seed=0, weights=None, **kw):
    kw.setdefault("max_total_tokens", 500)
    kw.setdefault("max_running_requests", 4)
    shapes = shapes or candidate_shapes(spec.num_steps, spec.topk, spec.num_draft_tokens)
    runner = Runner(target, draft, spec, adaptive=True, adaptive_shapes=shapes,
                    step_costs_s={(s, 1): 1.0 for s in shapes}, **kw)
    runner.policy = ScriptedPolicy(runner.shapes, seed, weights)
    return runner


# (algorithm, hc_mult, the configured shape (steps, topk, draft tokens))
CASES = [("EAGLE", 1, (3, 1, 4)), ("EAGLE", 1, (3, 3, 6)), ("EAGLE3", 1, (3, 2, 5)),
         ("MTP", 1, (3, 1, 4)), ("EAGLE", 4, (3, 2, 5)), ("MTP", 4, (3, 1, 4))]


@pytest.mark.parametrize("algorithm,hc_mult,shape", CASES)
def test_every_mix_of_shapes_equals_target_only(algorithm, hc_mult, shape):
    target, perm = target_for(hc_mult)
    plain = generate(Runner(target, max_total_tokens=500, max_running_requests=4), requests())
    draft = copy_draft(algorithm, target, perm)
    spec = SpecSettings(algorithm, *shape)
    for seed in (0, 1):
        runner = adaptive_runner(target, draft, spec, seed=seed, catch_up_tokens=3)
        assert generate(runner, requests(), stagger=seed == 1) == plain
        chosen = set(runner.policy.chosen)
        assert NONE in chosen and len(chosen) >= 3, "the schedule did not mix shapes"
        assert runner.num_draft_tokens_accepted > 0


def test_long_runs_of_plain_steps_fill_the_catch_up_buffer():
    """Mostly NONE (the buffer fills and is drained many times), then speculation again."""
    target, perm = target_for(1)
    draft = copy_draft("EAGLE", target, perm)
    spec = SpecSettings("EAGLE", 3, 1, 4)
    plain = generate(Runner(target, max_total_tokens=500, max_running_requests=4), requests(max_tokens=40))
    runner = adaptive_runner(target, draft, spec, weights=[8, 1, 1, 1], catch_up_tokens=2)
    assert generate(runner, requests(max_tokens=40), stagger=True) == plain


def _draft_state(runner: Runner, req_id: str) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(carried hidden [Hc], draft K of every committed position [L, layers, kv_heads, head_dim], L)."""
    seq = runner._running[req_id]
    slots = runner.table.req_to_slot[seq.row, :seq.length]
    return runner.draft_hidden[seq.row].clone(), runner.draft_kv.k[:, slots].transpose(0, 1).clone(), seq.length


@pytest.mark.parametrize("algorithm", ["EAGLE", "EAGLE3", "MTP"])
def test_catch_up_leaves_the_draft_state_a_full_extend_gives(algorithm):
    """A request decoded by plain steps, then caught up, holds the draft KV and carried hidden
    state that prefilling its whole committed sequence gives (one draft extend over it all)."""
    target, perm = target_for(1)
    draft = copy_draft(algorithm, target, perm)
    spec = SpecSettings(algorithm, 3, 1, 4)
    runner = adaptive_runner(target, draft, spec, catch_up_tokens=5)
    runner.policy.choose = lambda b: NONE
    req = requests(lens=(9,), max_tokens=30)[0]
    runner.add(req)
    tokens = []
    for _ in range(8):  # prefill + 7 plain steps: the buffer filled once (5) and holds 2
        tokens += runner.step()[0].token_ids
    seq = runner._running[req.id]
    assert seq.pending == 2
    runner._catch_up([seq])
    hidden, k, length = _draft_state(runner, req.id)
    assert length == len(req.prompt_ids) + len(tokens) - 1

    fresh = Runner(target, draft, spec, max_total_tokens=500, max_running_requests=4)
    committed = req.prompt_ids + tokens[:-1]
    fresh.add(Request("whole", committed, 2))
    first = fresh.step()[0].token_ids
    assert first == [tokens[-1]]  # the same root
    want_hidden, want_k, want_len = _draft_state(fresh, "whole")
    assert want_len == length
    torch.testing.assert_close(k, want_k, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(hidden, want_hidden, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("fused", [True, False])
def test_padded_graph_buffers_and_sampling_rows(fused):
    """The graphs' padded static buffers (every shape's, NONE's decode-with-feature one too, CPU
    replay without capture) with a sampling request in the batch: the greedy rows stay exact and
    seeded sampling is reproducible."""
    target, perm = target_for(1)
    draft = copy_draft("EAGLE", target, perm)
    spec = SpecSettings("EAGLE", 3, 2, 5)
    plain = generate(Runner(target, max_total_tokens=500, max_running_requests=4), requests())

    def batch():
        reqs = requests()
        reqs[2].temperature, reqs[2].top_p, reqs[2].seed = 0.8, 0.9, 5
        return reqs

    outs = []
    for _ in range(2):
        runner = adaptive_runner(target, draft, spec, graph_mode="padded", cuda_graph_batch_sizes=(1, 2, 4),
                                 fused_spec_step=fused)
        outs.append(generate(runner, batch()))
    assert outs[0] == outs[1]
    assert {k: v for k, v in outs[0].items() if k != "r2"} == {k: v for k, v in plain.items() if k != "r2"}


def test_measured_costs_and_the_real_policy():
    """Without given costs the runner times every shape at every bucket at start-up; the real
    policy then runs (on CPU the choice is whatever the timings say) and stays lossless, and its
    snapshot names the shape and the acceptance."""
    target, perm = target_for(1)
    draft = copy_draft("EAGLE", target, perm)
    runner = Runner(target, draft, SpecSettings("EAGLE", 2, 1, 3), max_total_tokens=500,
                    max_running_requests=2, adaptive=True)
    assert set(runner.policy.base_costs_s) == {(s, b) for s in runner.shapes for b in (1, 2)}
    assert all(c > 0 for c in runner.policy.base_costs_s.values())
    plain = generate(Runner(target, max_total_tokens=500, max_running_requests=2), requests(lens=(5, 7)))
    assert generate(runner, requests(lens=(5, 7))) == plain
    snap = runner.policy.snapshot()
    assert snap["shape"] in {s.label for s in runner.shapes}
    assert sum(snap["steps"].values()) > 0


def test_adaptive_settings_are_checked():
    target, perm = target_for(1)
    draft = copy_draft("EAGLE", target, perm)
    with pytest.raises(ValueError, match="needs a draft"):
        Runner(target, max_total_tokens=100, max_running_requests=2, adaptive=True)
    with pytest.raises(ValueError, match="not a valid"):
        Runner(target, draft, SpecSettings("EAGLE", 2, 1, 3), max_total_tokens=100, max_running_requests=2,
               adaptive=True, adaptive_shapes=[NONE, SpecShape(2, 1, 5)], step_costs_s={})
    # Admission reserves for the deepest shape any step may run.
    runner = Runner(target, draft, SpecSettings("EAGLE", 2, 1, 3), max_total_tokens=100,
                    max_running_requests=2, adaptive=True,
                    adaptive_shapes=[NONE, SpecShape(2, 1, 3), SpecShape(4, 2, 6)],
                    step_costs_s={(s, 1): 1.0 for s in (NONE, SpecShape(2, 1, 3), SpecShape(4, 2, 6))})
    assert runner.slots_needed(10, 10) == 20 + 3 * 2 + 6
    assert runner.max_sequence_tokens == runner.context_length - 5


def test_prefix_cache_keeps_only_positions_whose_draft_kv_is_written():
    """A request that ends after plain steps still has entries the draft has not run over: the
    prefix cache must not hand their draft K/V to the next request. A second request whose prompt
    runs past the first one's prompt into its output then holds the draft state of a full prefill."""
    target, perm = target_for(1)
    draft = copy_draft("EAGLE", target, perm)
    spec = SpecSettings("EAGLE", 3, 1, 4)
    runner = adaptive_runner(target, draft, spec, catch_up_tokens=8, prefix_cache=True)
    runner.policy.choose = lambda b: NONE
    first = requests(lens=(9,), max_tokens=12)[0]
    out = generate(runner, [first])["r0"]
    second = Request("b", first.prompt_ids + out[:10], 3)
    runner.add(second)
    got = runner.step()[0]
    assert got.num_cached_tokens > len(first.prompt_ids)  # the hit reaches into the output
    hidden, k, length = _draft_state(runner, "b")

    fresh = Runner(target, draft, spec, max_total_tokens=500, max_running_requests=4)
    fresh.add(Request("b", second.prompt_ids, 3))
    assert fresh.step()[0].token_ids == got.token_ids
    want_hidden, want_k, _ = _draft_state(fresh, "b")
    torch.testing.assert_close(k, want_k, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(hidden, want_hidden, atol=2e-5, rtol=1e-4)
