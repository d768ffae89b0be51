"""Tensor parallelism over gloo on CPU: the engine's own multi-process path (RankSpec,
build_runner, the ranks in lockstep) at TP 2 and 4 gives the same greedy tokens as TP 1 in
float32, target-only and for each draft algorithm, chain and tree, hc_mult 1 and 4; and each
rank holds exactly the weight and KV bytes the plan's per-GPU terms say.

The models are saved as checkpoints and loaded per rank (each rank reads only its slices). One
set of worker processes per TP size runs every case in turn: rank 0 is this test process,
ranks 1..N-1 are spawned children running tests/helpers/tp_ranks.py. TP 4 with 2 KV heads replicates each
KV head on two ranks; a vocabulary of 66 at TP 4 is padded to 68 rows.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from specdeploy.engine.demo.toy import copy_draft, predictable_target, random_requests, run_to_completion, tiny_config
from specdeploy.engine.planner.plan import Limits, SpecSettings, custom_gpu, plan_from_configs
from specdeploy.engine.planner.weights import load_model_path
from specdeploy.engine.runtime import distributed
from specdeploy.engine.serving.cli import RankSpec, build_runner
from tp_ranks import held_bytes, rank_main

MAX_TOTAL_TOKENS = 400
PROMPT_LENS = (5, 12, 1, 9)
MAX_TOKENS = 16

# (name, algorithm, hc_mult, topk, num_draft_tokens, vocab)
CASES = [
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


def _config(cfg, **extra) -> dict:
    return dict(architectures=["LlamaForCausalLM"], model_type="llama", torch_dtype="float32",
                hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
                num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, vocab_size=cfg.vocab_size,
                rms_norm_eps=cfg.rms_norm_eps, rope_theta=cfg.rope_theta,
                max_position_embeddings=cfg.max_position_embeddings, hc_mult=cfg.hc_mult, **extra)


def _save(path: Path, tensors: dict, config: dict) -> None:
    path.mkdir(parents=True)
    names = sorted(tensors)
    for i in range(2):  # two shards, as large checkpoints come
        save_file({n: tensors[n].contiguous() for n in names[i::2]}, str(path / f"model-{i + 1:05d}-of-00002.safetensors"))
    (path / "config.json").write_text(json.dumps(config))


def _case_dirs(root: Path, name, algorithm, hc_mult, vocab) -> tuple[Path, Path | None]:
    cfg = tiny_config(hc_mult=hc_mult, vocab_size=vocab)
    target, perm = predictable_target(cfg, seed=0, layer_scale=0.5)
    target_dir = root / name / "target"
    _save(target_dir, {("model." + n if not n.startswith("lm_head") else n): t
                       for n, t in target.state_dict().items()}, _config(cfg))
    if algorithm == "NONE":
        return target_dir, None
    kwargs, extra = {}, {}
    if algorithm == "EAGLE3":  # a reduced draft vocabulary: a quarter of the tokens is missing
        kwargs["draft_vocab"] = torch.arange(vocab)[torch.arange(vocab) % 4 != 3]
        extra["draft_vocab_size"] = len(kwargs["draft_vocab"])
    if algorithm == "MTP":
        extra["num_nextn_predict_layers"] = 1
    head = copy_draft(algorithm, target, perm, **kwargs)
    draft_dir = root / name / "draft"
    _save(draft_dir, dict(head.state_dict()), _config(dataclasses.replace(cfg, num_layers=1), **extra))
    return target_dir, draft_dir


def _spec(target_dir: Path, draft_dir: Path | None, algorithm, topk, ndt, tp: int, init_method="") -> RankSpec:
    target_config, target_bytes = load_model_path(target_dir)
    draft_config, draft_bytes = load_model_path(draft_dir) if draft_dir else (None, None)
    settings = SpecSettings("NONE", 0, 0, 0) if algorithm == "NONE" else SpecSettings(algorithm, 3, topk, ndt)
    plan = plan_from_configs(target_config, draft_config, settings, custom_gpu(4), Limits(4, 512, 4),
                             target_weight_bytes=target_bytes, draft_weight_bytes=draft_bytes,
                             gpus_per_node=tp, tensor_parallel_size=tp)
    plan = dataclasses.replace(plan, max_total_tokens=MAX_TOTAL_TOKENS)
    return RankSpec(str(target_dir), str(draft_dir) if draft_dir else None, plan.to_dict(), "float32", "cpu",
                    seed=0, tp_size=tp, init_method=init_method)


def _requests():
    return random_requests(PROMPT_LENS, MAX_TOKENS, 64)


@pytest.fixture(scope="module")
def case_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp")
    return {c[0]: (_case_dirs(root, c[0], c[1], c[2], c[5]), c) for c in CASES}


@pytest.fixture(scope="module")
def reference(case_dirs):
    """TP 1: the same specs, one process."""
    out = {}
    for name, ((target_dir, draft_dir), (_, algorithm, _, topk, ndt, _)) in case_dirs.items():
        runner, _ = build_runner(_spec(target_dir, draft_dir, algorithm, topk, ndt, 1))
        out[name] = run_to_completion(runner, _requests())
        if runner.draft is not None:
            rate = runner.num_draft_tokens_accepted / runner.num_draft_tokens_proposed
            assert 0.1 < rate < 0.95, f"{name}: acceptance {rate:.2f}, the test would not see both outcomes"
    return out


@pytest.mark.parametrize("tp", [2, 4])
def test_tensor_parallel_equals_tp1(tp, case_dirs, reference):
    import torch.multiprocessing as mp

    init_method = distributed.free_init_method()
    specs = [_spec(*dirs, c[1], c[3], c[4], tp, init_method) for dirs, c in case_dirs.values()]
    results = mp.get_context("spawn").Queue()
    deaths = []
    workers = distributed.Workers(rank_main, tp, lambda rank: (specs, results), on_death=deaths.append)
    try:
        group = distributed.init_tp(0, tp, init_method, "cpu", timeout_s=120)
        for spec, name in zip(specs, case_dirs):
            runner, _ = build_runner(spec, 0)
            held = {0: held_bytes(runner)}
            leader = distributed.LeaderRunner(runner, group, on_fatal=deaths.append)
            got = run_to_completion(leader, _requests())
            leader.close()
            assert got == reference[name], f"{name}: TP {tp} differs from TP 1"
            for _ in range(tp - 1):
                rank, case, h = results.get(timeout=120)
                assert case == name
                held[rank] = h
            planned = spec.plan
            weights = planned["target"]["weight_bytes_per_gpu"] + (planned["draft"] or {}).get("weight_bytes_per_gpu", 0)
            for rank, h in held.items():
                assert h["weights"] == weights, f"{name}: rank {rank} holds {h['weights']} B, plan {weights}"
                assert h["target_kv_per_token"] == planned["target"]["kv_cache_bytes_per_token_per_gpu"]
                if planned["draft"]:
                    assert h["draft_kv_per_token"] == planned["draft"]["kv_cache_bytes_per_token_per_gpu"]
            # A model is split, not copied: every rank holds less than the whole checkpoint.
            whole = planned["target"]["weight_bytes"] + (planned["draft"] or {}).get("weight_bytes", 0)
            assert max(h["weights"] for h in held.values()) < whole * 0.75
        assert not deaths, deaths
    finally:
        distributed.destroy_tp()
        workers.stop(timeout_s=30)
