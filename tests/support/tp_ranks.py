"""Tensor-parallel ranks 1..N-1 for the CPU tests (spawned processes import this by name):
each builds its runner from every RankSpec in turn, reports what it holds, and follows rank 0."""

from __future__ import annotations

from pathlib import Path

import torch

from specdeploy.engine.runtime import distributed
from specdeploy.engine.serving.cli import build_runner


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
    slots = runner.target_kv.k.shape[1]
    return {"weights": weights, "target_kv_per_token": runner.target_kv.nbytes // slots,
            "draft_kv_per_token": runner.draft_kv.nbytes // slots if runner.draft_kv is not None else 0}


def rank_main(rank: int, specs, results) -> None:
    torch.set_num_threads(1)
    tp = distributed.init_tp(rank, specs[0].tp_size, specs[0].init_method, "cpu", timeout_s=120)
    for spec in specs:
        runner, _ = build_runner(spec, rank)
        results.put((rank, Path(spec.target_dir).parent.name, held_bytes(runner)))
        distributed.follow(runner, tp)
    distributed.destroy_tp()
