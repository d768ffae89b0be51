"""DeepSeek-V4 at tensor parallel 2 over gloo on CPU (the engine's own multi-process path,
RankSpec / build_runner / the ranks in lockstep): attention, embeddings and shared experts
replicated, the routed experts split between the ranks (expert parallelism inside the TP group,
one all-reduce per MoE layer). Greedy tokens equal TP 1's in float32, target-only and with MTP
speculation; each rank holds half the routed experts and the same KV pools."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
from tp_ranks import held_bytes, rank_spec, run_one, run_tp
from v4_tiny import TINY, engine_model, hf_model, random_mtp, save_published

from specdeploy.engine.runtime import distributed

pytest.importorskip("transformers.models.deepseek_v4")

CONFIG = {**copy.deepcopy(TINY), "vocab_size": 64, "n_routed_experts": 4}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("v4tp") / "target"
    hf = hf_model(CONFIG)
    save_published(root, CONFIG, hf, random_mtp(engine_model(CONFIG, hf)))
    return root


CASES = [("NONE", 0, 0), ("MTP", 1, 4), ("MTP", 2, 5)]


def _expert_bytes(runner) -> int:
    models = [runner.target] + ([runner.draft] if runner.draft is not None else [])
    return sum(p.numel() * p.element_size() for m in models for n, p in m.named_parameters()
               if ".mlp.experts." in n)


def test_tp2_equals_tp1(model_dir):
    reference = []
    for a, k, n in CASES:
        tokens, runner = run_one(rank_spec(model_dir, model_dir if a != "NONE" else None, a, k, n, 1))
        reference.append((tokens, held_bytes(runner)["weights"], _expert_bytes(runner)))
    init_method = distributed.free_init_method()
    specs = [rank_spec(model_dir, model_dir if a != "NONE" else None, a, k, n, 2, init_method) for a, k, n in CASES]
    for (algorithm, *_), (want, weights_tp1, experts_tp1), (tokens, held) in zip(CASES, reference, run_tp(specs)):
        assert tokens == want, algorithm
        assert held[0]["target_kv_per_token"] == held[1]["target_kv_per_token"]  # replicated pools
        # each rank holds everything but the other half of the routed experts
        assert held[0]["weights"] == held[1]["weights"] == weights_tp1 - experts_tp1 // 2
