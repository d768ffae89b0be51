"""Tensor-parallel test cases, shared by the CPU tests (gloo) and the GPU tests (NCCL): tiny
checkpoints for every draft algorithm, the RankSpec each rank builds from, and the ranks
themselves. Ranks 1..N-1 are processes the tests spawn, which import this module by name.

`run_tp(specs)` runs every spec in turn on one set of ranks (rank 0 is the calling process) and
returns, per case, the tokens rank 0 produced and the bytes each rank holds."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from specdeploy.engine import parallel
from specdeploy.engine.demo.toy import copy_draft, predictable_target, random_requests, run_to_completion, tiny_config
from specdeploy.engine.planner.plan import Limits, SpecSettings, custom_gpu, plan_from_configs
from specdeploy.engine.planner.weights import load_model_path
from specdeploy.engine.runtime import distributed
from specdeploy.engine.serving.boot import RankSpec, build_runner

MAX_TOTAL_TOKENS = 400
PROMPT_LENS = (5, 12, 1, 9)
MAX_TOKENS = 16


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
        save_file({n: tensors[n].contiguous() for n in names[i::2]},
                  str(path / f"model-{i + 1:05d}-of-00002.safetensors"))
    (path / "config.json").write_text(json.dumps(config))


def case_dirs(root: Path, name: str, algorithm: str, hc_mult: int, vocab: int,
              fp8: bool = False) -> tuple[Path, Path | None]:
    """Target (and draft) checkpoints of one case under root/name; fp8: the target's linears
    stored as per-channel FP8 (e4m3 codes + weight_scale, compressed-tensors' layout)."""
    from specdeploy.engine.models import fp8 as fp8_format

    cfg = tiny_config(hc_mult=hc_mult, vocab_size=vocab)
    target, perm = predictable_target(cfg, seed=0, layer_scale=0.5)
    target_dir = root / name / "target"
    state = {("model." + n if not n.startswith("lm_head") else n): t for n, t in target.state_dict().items()}
    config = _config(cfg)
    if fp8:
        fmt = fp8_format.FP8Format("channel", "weight_scale")
        state = fp8_format.quantize_state_dict(state, fmt)
        config["quantization_config"] = fp8_format.quantization_config(fmt)
    _save(target_dir, state, config)
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


def rank_spec(target_dir: Path, draft_dir: Path | None, algorithm: str, topk: int, num_draft_tokens: int,
              tp: int, init_method: str = "", device: str = "cpu", all_reduce: str = "nccl",
              adaptive: bool = False) -> RankSpec:
    """What `engine serve` would hand every rank for this case: the plan made for TP `tp`."""
    target_config, target_bytes = load_model_path(target_dir)
    draft_config, draft_bytes = load_model_path(draft_dir) if draft_dir else (None, None)
    settings = (SpecSettings("NONE", 0, 0, 0) if algorithm == "NONE"
                else SpecSettings(algorithm, 3, topk, num_draft_tokens))
    plan = plan_from_configs(target_config, draft_config, settings, custom_gpu(4), Limits(4, 512, 4),
                             target_weight_bytes=target_bytes, draft_weight_bytes=draft_bytes,
                             gpus_per_node=tp, tensor_parallel_size=tp)
    plan = dataclasses.replace(plan, max_total_tokens=MAX_TOTAL_TOKENS)
    return RankSpec(target_dir=str(target_dir), draft_dir=str(draft_dir) if draft_dir else None,
                    plan=plan.to_dict(), dtype="float32", device=device, seed=0, tp_size=tp, init_method=init_method, all_reduce=all_reduce, adaptive=adaptive)


def requests():
    return random_requests(PROMPT_LENS, MAX_TOKENS, 64)


def held_bytes(runner) -> dict:
    """Bytes this rank holds: parameters and persistent buffers (each once), KV per slot."""
    modules = [runner.target] + ([runner.draft] if runner.draft is not None else [])
    seen, weights = set(), 0
    for m in modules:
        persistent = m.state_dict().keys()
        for t in list(m.parameters()) + [b for n, b in m.named_buffers() if n in persistent]:
            if id(t) not in seen:
                seen.add(id(t))
                weights += t.numel() * t.element_size()
    # slots: the KV pool's rows, or (pools of their own: DeepSeek-V4) the slot maps' length
    slots = runner.target_kv.k.shape[1] if hasattr(runner.target_kv, "k") else runner.target_kv.slot_pos.numel()
    return {"weights": weights, "target_kv_per_token": runner.target_kv.nbytes // slots,
            "draft_kv_per_token": runner.draft_kv.nbytes // slots if runner.draft_kv is not None else 0,
            "captured_graphs": captured_graphs(runner)}


def captured_graphs(runner) -> int:
    """CUDA graphs the runner captured (0 on CPU, where the calls run eagerly)."""
    from specdeploy.engine.runtime.graphs import GraphedCalls, _Graphed

    calls = runner.calls
    if not isinstance(calls, GraphedCalls):
        return 0
    graphed = [v for v in vars(calls).values() if isinstance(v, _Graphed)]
    for v in vars(calls).values():
        if isinstance(v, dict):
            graphed += [g for g in v.values() if isinstance(g, _Graphed)]
    return sum(len(g.graphs) for g in graphed)


def rank_main(rank: int, specs: list[RankSpec], results) -> None:
    """Ranks 1..N-1: every case in turn, reporting what each holds, following rank 0's steps."""
    torch.set_num_threads(1)
    first = specs[0]
    tp = parallel.init_tp(rank, first.tp_size, first.init_method, first.rank_device(rank), first.all_reduce,
                             timeout_s=120)
    for spec in specs:
        runner, _ = build_runner(spec, rank)
        results.put((rank, held_bytes(runner)))
        distributed.follow(runner, tp)
    parallel.destroy_tp()


def run_tp(specs: list[RankSpec]) -> list[tuple[dict, dict]]:
    """Every spec on one set of ranks (this process is rank 0) -> per spec (tokens per request
    id, {rank: held_bytes}). A rank that dies fails the call (AssertionError)."""
    import torch.multiprocessing as mp

    first = specs[0]
    results = mp.get_context("spawn").Queue()
    deaths: list[str] = []
    workers = distributed.Workers(rank_main, first.tp_size, lambda rank: (specs, results), on_death=deaths.append)
    out = []
    try:
        group = parallel.init_tp(0, first.tp_size, first.init_method, first.rank_device(0), first.all_reduce,
                                    timeout_s=120)
        for spec in specs:
            runner, _ = build_runner(spec, 0)
            held = {0: held_bytes(runner)}
            leader = distributed.LeaderRunner(runner, group, on_fatal=deaths.append)
            tokens = run_to_completion(leader, requests())
            leader.close()
            for _ in range(first.tp_size - 1):
                rank, h = results.get(timeout=120)
                held[rank] = h
            out.append((tokens, held))
        assert not deaths, deaths
        return out
    finally:
        parallel.destroy_tp()
        workers.stop(timeout_s=30)


def run_one(spec: RankSpec):
    """TP 1: (tokens, runner) in this process."""
    runner, _ = build_runner(spec)
    return run_to_completion(runner, requests()), runner
