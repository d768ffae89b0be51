"""Tensor parallelism over gloo on CPU: the engine's own multi-process path (RankSpec,
build_runner, the ranks in lockstep) at TP 2 and 4 gives the same greedy tokens as TP 1 in
float32, target-only and for each draft algorithm, chain and tree, hc_mult 1 and 4, an FP8
(per-channel) target, and adaptive speculation (every rank decodes in rank 0's choice of shape); and each rank holds exactly the weight and KV bytes the plan's per-GPU
terms say (FP8: the plan counts weights / TP, so only the split is checked).

The models are saved as checkpoints and loaded per rank (each rank reads only its slices). One
set of ranks per TP size runs every case in turn (tests/support/tp_ranks.py): rank 0 is this
test process. TP 4 with 2 KV heads replicates each KV head on two ranks; a vocabulary of 66 at
TP 4 is padded to 68 rows. TP 4 runs the cases that differ from TP 2 in what a rank holds
(replicated KV heads, padding) and one of each draft kind (adaptive: TP 2), to keep it short.
"""

from __future__ import annotations

import pytest
from tp_ranks import case_dirs, rank_spec, run_one, run_tp

from specdeploy.engine.runtime import distributed

# (name, algorithm, hc_mult, topk, num_draft_tokens, vocab[, fp8])
CASES = [
    ("eagle-adaptive", "EAGLE", 1, 3, 6, 64),
    ("none-fp8", "NONE", 1, 0, 0, 64, True),
    ("none", "NONE", 1, 0, 0, 64),
    ("none-hc4", "NONE", 4, 0, 0, 64),
    ("none-padded-vocab", "NONE", 1, 0, 0, 66),
    ("eagle-chain", "EAGLE", 1, 1, 4, 64),
    ("eagle-tree", "EAGLE", 1, 3, 6, 64),
    ("eagle3-chain", "EAGLE3", 1, 1, 4, 64),
    ("eagle3-tree", "EAGLE3", 1, 2, 5, 64),
    ("mtp-chain", "MTP", 1, 1, 4, 64),
    ("eagle-hc4-tree", "EAGLE", 4, 2, 5, 64),
    ("mtp-hc4-chain", "MTP", 4, 1, 4, 64),
    ("mtp-hc4-tree", "MTP", 4, 3, 6, 64),
]


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp")
    return [(c, case_dirs(root, c[0], c[1], c[2], c[5], *c[6:])) for c in CASES]


@pytest.fixture(scope="module")
def reference(cases):
    """TP 1: the same specs, one process."""
    out = {}
    for (name, algorithm, _, topk, ndt, *_), dirs in cases:
        out[name], runner = run_one(rank_spec(*dirs, algorithm, topk, ndt, 1, adaptive="adaptive" in name))
        if runner.draft is not None and runner.policy is None:
            rate = runner.num_draft_tokens_accepted / runner.num_draft_tokens_proposed
            assert 0.1 < rate < 0.95, f"{name}: acceptance {rate:.2f}, the test would not see both outcomes"
    return out


TP4_CASES = {"none-padded-vocab", "eagle-tree", "eagle3-chain", "mtp-hc4-tree"}


@pytest.mark.parametrize("tp", [2, 4])
def test_tensor_parallel_equals_tp1(tp, cases, reference):
    init_method = distributed.free_init_method()
    if tp == 4:
        cases = [(c, dirs) for c, dirs in cases if c[0] in TP4_CASES]
    specs = [rank_spec(*dirs, c[1], c[3], c[4], tp, init_method, adaptive="adaptive" in c[0]) for c, dirs in cases]
    for ((name, *_), _), spec, (tokens, held) in zip(cases, specs, run_tp(specs)):
        assert tokens == reference[name], f"{name}: TP {tp} differs from TP 1"
        planned = spec.plan
        draft = planned["draft"] or {}
        weights = planned["target"]["weight_bytes_per_gpu"] + draft.get("weight_bytes_per_gpu", 0)
        assert sorted(held) == list(range(tp))
        for rank, h in held.items():
            if "fp8" not in name:
                assert h["weights"] == weights, f"{name}: rank {rank} holds {h['weights']} B, the plan {weights}"
            assert h["target_kv_per_token"] == planned["target"]["kv_cache_bytes_per_token_per_gpu"]
            assert h["draft_kv_per_token"] == draft.get("kv_cache_bytes_per_token_per_gpu", 0)
        # A model is split, not copied: every rank holds well under the whole checkpoint.
        whole = planned["target"]["weight_bytes"] + draft.get("weight_bytes", 0)
        assert max(h["weights"] for h in held.values()) < whole * 0.75
