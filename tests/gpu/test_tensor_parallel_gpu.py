"""Tensor parallelism on two GPUs (NCCL): the engine's ranks capture their CUDA graphs with the
collectives inside (the fused speculative step: draft, verify, draft extend; target decode) and
produce the same greedy tokens as one GPU, in float32, with NCCL and with the symmetric-memory
one-shot all-reduce; each rank holds the plan's per-GPU weight and KV bytes. Skips with fewer
than two GPUs."""

import pytest
import torch

if torch.cuda.device_count() < 2:
    pytest.skip("needs two CUDA devices", allow_module_level=True)

from tp_ranks import case_dirs, rank_spec, run_one, run_tp  # noqa: E402

from specdeploy.engine.runtime import distributed  # noqa: E402

CASES = [
    ("none", "NONE", 1, 0, 0, 64),
    ("eagle-tree", "EAGLE", 1, 3, 6, 64),
    ("eagle3-chain", "EAGLE3", 1, 1, 4, 64),
    ("mtp-hc4-tree", "MTP", 4, 3, 6, 64),
]


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp_gpu")
    return [(c, case_dirs(root, c[0], c[1], c[2], c[5])) for c in CASES]


@pytest.mark.parametrize("all_reduce", ["nccl", "symm-mem"])
def test_two_gpus_with_graphs_equal_one_gpu(cases, all_reduce):
    reference = {}
    for (name, algorithm, _, topk, ndt, _), dirs in cases:
        reference[name], runner = run_one(rank_spec(*dirs, algorithm, topk, ndt, 1, device="cuda"))
        del runner
        torch.cuda.empty_cache()
    init_method = distributed.free_init_method()
    specs = [rank_spec(*dirs, c[1], c[3], c[4], 2, init_method, device="cuda", all_reduce=all_reduce)
             for c, dirs in cases]
    for ((name, *_), _), spec, (tokens, held) in zip(cases, specs, run_tp(specs)):
        assert tokens == reference[name], f"{name}: TP 2 ({all_reduce}) differs from one GPU"
        draft = spec.plan["draft"] or {}
        weights = spec.plan["target"]["weight_bytes_per_gpu"] + draft.get("weight_bytes_per_gpu", 0)
        for rank, h in held.items():
            assert h["captured_graphs"] > 0, f"{name}: rank {rank} captured no CUDA graph"
            assert h["weights"] == weights
            assert h["target_kv_per_token"] == spec.plan["target"]["kv_cache_bytes_per_token_per_gpu"]
