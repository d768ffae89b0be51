"""The adaptive-speculation policy (pure Python): expected tokens from per-depth acceptance,
the choice against measured step costs, NONE where speculation cannot win, exploration through
the decaying prior, and the online cost offset."""

import pytest
from specdeploy.engine.speculative.adaptive import (
    NONE,
    AdaptivePolicy,
    SpecShape,
    bucket_for,
    candidate_shapes,
)

CHAIN1, CHAIN3, TREE = SpecShape(1, 1, 2), SpecShape(3, 1, 4), SpecShape(3, 4, 8)


def costs(table):
    """{label: [cost at bucket 1, 8, 64]} -> costs_s."""
    shapes = {"none": NONE, "1,1,2": CHAIN1, "3,1,4": CHAIN3, "3,4,8": TREE}
    return {(shapes[k], b): c for k, row in table.items() for b, c in zip((1, 8, 64), row)}


# Step costs shaped like the H200's 8B runs: at batch 1 a step costs about the decode step plus
# the draft; at 64 the verify of 4-8 tokens per request costs multiples of a decode step.
COSTS = costs({"none": [5.0, 5.4, 6.0], "1,1,2": [6.0, 6.8, 13.0], "3,1,4": [6.6, 8.0, 24.0],
               "3,4,8": [7.4, 11.0, 40.0]})


def trained(policy, shape, accepted, steps=50):
    for _ in range(steps):
        policy.observe(shape, accepted)
    return policy


def test_shapes_and_buckets():
    assert candidate_shapes(3, 4, 8) == [NONE, CHAIN1, SpecShape(2, 1, 3), CHAIN3, TREE]
    assert candidate_shapes(2, 1, 3) == [NONE, CHAIN1, SpecShape(2, 1, 3)]
    assert SpecShape.parse("3,4,8") == TREE and SpecShape.parse("none") == NONE
    assert SpecShape.parse("3") == CHAIN3 and CHAIN3.label == "3,1,4" and NONE.label == "none"
    with pytest.raises(ValueError):
        SpecShape.parse("3,4")
    assert [bucket_for(b, [1, 8, 64]) for b in (1, 2, 8, 9, 64, 100)] == [1, 8, 8, 64, 64, 64]
    with pytest.raises(ValueError, match="NONE"):
        AdaptivePolicy([CHAIN1], {(CHAIN1, 1): 1.0})
    with pytest.raises(ValueError, match="missing"):
        AdaptivePolicy([NONE, CHAIN1], {(NONE, 1): 1.0})


def test_expected_tokens_follow_the_pooled_acceptance():
    policy = AdaptivePolicy([NONE, CHAIN1, CHAIN3], COSTS, prior_weight=1e-9, half_life_steps=1e9)
    # Two kinds of rows in every step: one accepts all 3 drafts, one none. Pooled
    # P(accepted >= d) is 1/2 at every depth: E = 1 + 3 * 0.5.
    trained(policy, CHAIN3, [3, 0], steps=10)
    assert policy.acceptance_rates(CHAIN3) == pytest.approx([0.5, 1.0, 1.0])
    assert policy.expected_tokens(CHAIN3) == pytest.approx(2.5)
    # A 1-step chain reads the same depth-1 estimate.
    assert policy.expected_tokens(CHAIN1) == pytest.approx(1.5)
    assert policy.expected_tokens(NONE) == 1.0


def test_speculation_wins_at_batch_1_and_none_at_64():
    policy = trained(AdaptivePolicy([NONE, CHAIN1, CHAIN3, TREE], COSTS), CHAIN3, [2, 3, 3, 1])
    trained(policy, TREE, [3, 3, 3, 2])
    assert policy.choose(1) in (CHAIN3, TREE)
    assert policy.choose(64) == NONE
    crossover = policy.crossover_batch()
    assert crossover == 64
    # Throughput of the choice is never below NONE's at any batch size.
    for b in range(1, 65):
        tps = policy.throughputs(b)
        assert tps[policy.choose(b)] >= tps[NONE]


def test_a_draft_that_is_never_right_means_none():
    policy = trained(AdaptivePolicy([NONE, CHAIN1, CHAIN3], COSTS), CHAIN3, [0, 0, 0, 0], steps=200)
    assert policy.choose(1) == NONE and policy.crossover_batch() == 1


def test_unmeasured_shapes_are_tried_and_stale_estimates_return_to_the_prior():
    policy = AdaptivePolicy([NONE, CHAIN3], COSTS, prior_rate=0.8, half_life_steps=10)
    assert policy.choose(1) == CHAIN3          # the optimistic prior: worth a try
    trained(policy, CHAIN3, [0, 0, 0, 0], steps=100)
    assert policy.choose(1) == NONE            # measured: not worth it
    for _ in range(200):                       # NONE steps: the estimate decays to the prior
        policy.observe(NONE, [0])
    assert policy.choose(1) == CHAIN3
    assert policy.choose(64) == NONE           # where even the prior loses, no probe is paid for


def test_a_tree_is_tried_once_chains_accept_well():
    policy = AdaptivePolicy([NONE, CHAIN3, TREE], COSTS, prior_rate=0.5)
    trained(policy, CHAIN3, [3, 3, 3, 2])      # chains accept ~0.9 per depth: above the prior
    chain_rates = policy.acceptance_rates(CHAIN3)
    assert all(t >= c for t, c in zip(policy.acceptance_rates(TREE), chain_rates))
    assert policy.expected_tokens(TREE) == pytest.approx(policy.expected_tokens(CHAIN3))
    # Measured, the tree keeps its own estimate.
    trained(policy, TREE, [1, 1, 1, 1])
    assert policy.expected_tokens(TREE) < policy.expected_tokens(CHAIN3)


def test_margin_and_online_offset():
    # A shape only just better than NONE is not taken within the margin.
    near = costs({"none": [5.0, 5.0, 5.0], "1,1,2": [8.5, 8.5, 8.5], "3,1,4": [9, 9, 9], "3,4,8": [9, 9, 9]})
    policy = trained(AdaptivePolicy([NONE, CHAIN1], near, margin=0.05), CHAIN1, [1, 1, 1, 0], steps=200)
    assert 1.0 < policy.expected_tokens(CHAIN1) * 5.0 / 8.5 < 1.05
    assert policy.choose(1) == NONE
    # Measured step times add one offset per bucket to every shape (the KV reads and host work
    # the padded start-up replays lack).
    policy = AdaptivePolicy([NONE, CHAIN1], COSTS, cost_smoothing=0.5)
    policy.observe_time(NONE, 1, 7.0)
    assert policy.cost_s(NONE, 1) == pytest.approx(7.0) and policy.cost_s(CHAIN1, 1) == pytest.approx(8.0)
    policy.observe_time(CHAIN1, 1, 6.0)       # gap 0 now: the offset moves halfway
    assert policy.offset_s[1] == pytest.approx(1.0)
    assert policy.cost_s(NONE, 100) == pytest.approx(6.0 * 100 / 64 + policy.offset_s.get(64, 0.0))


def test_snapshot():
    policy = trained(AdaptivePolicy([NONE, CHAIN1, CHAIN3, TREE], COSTS), CHAIN3, [3, 1])
    policy.choose(1)
    snap = policy.snapshot()
    assert snap["shape"] in ("3,1,4", "3,4,8")
    assert len(snap["acceptance_rates"]["chain"]) == 3
    assert snap["steps"]["3,1,4"] == 50 and snap["steps"]["none"] == 0
    assert set(snap["expected_tokens"]) == {"none", "1,1,2", "3,1,4", "3,4,8"}
