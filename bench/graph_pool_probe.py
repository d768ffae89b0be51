"""Where a CUDA-graph pool's memory goes: one Runner per configuration, captured with the
allocator's history on, then its private pools broken down (per call kind and bucket: reserved
growth during capture; per segment: live and free bytes; the live blocks by allocating frame;
during capture: frees requested but not completed).

    python3 bench/graph_pool_probe.py [--out DIR]        (CUDA only)
"""

from __future__ import annotations

import collections
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # works under python3 -P too

from common import (LLAMA_31_8B, bootstrap_specdeploy, cuda_probe_args, free_device_memory, log,  # noqa: E402
                    write_json)

bootstrap_specdeploy()

from harness import mtp_head_config, eagle_head_config, random_head, random_target  # noqa: E402
from specdeploy.engine.runtime.runner import Runner  # noqa: E402
from specdeploy.engine.planner.plan import SpecSettings  # noqa: E402

BUCKETS = (1, 2, 4, 8, 16)
# A small hc_mult 4 target (Llama-shaped, 2048 wide, 8 layers): what the pool holds beyond the
# activations shows at any size.
HC4_TARGET = {**LLAMA_31_8B, "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 8,
              "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
              "vocab_size": 32000, "bos_token_id": 1, "eos_token_id": 2, "hc_mult": 4}


def _frame(block) -> str:
    for f in block.get("frames", []):
        name = f.get("filename", "")
        if "specdeploy" in name or "/engine/" in name:
            return f"{Path(name).name}:{f.get('line')} {f.get('name')}"
    return "?"


def probe(name: str, config: dict, algorithm: str, fused: bool) -> dict:
    free_device_memory()
    target = random_target(config, torch.device("cuda"), torch.bfloat16)
    head_config = mtp_head_config(config) if algorithm == "MTP" else eagle_head_config(config)
    head = random_head(algorithm, head_config, target)
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(max_entries=400_000)
    before = torch.cuda.memory_reserved()
    runner = Runner(target, head, SpecSettings(algorithm, 3, 1, 4), max_total_tokens=200_000,
                    max_running_requests=max(BUCKETS), context_length=2048, device="cuda",
                    cuda_graph_batch_sizes=BUCKETS, fused_spec_step=fused)
    torch.cuda.synchronize()
    after = torch.cuda.memory_reserved()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    calls = runner.calls
    kinds = {}
    for attr in ("spec_step_graphs", "draft_multi_step_graphs"):
        for key, g in (getattr(calls, attr, None) or {}).items():
            kinds[f"{attr}[{key}]"] = g.capture_bytes
    for attr in ("target_verify_graph", "draft_extend_graph", "target_decode_graph"):
        g = getattr(calls, attr, None)
        if g is not None and g.capture_bytes:
            kinds[attr] = g.capture_bytes
    for shape, steps in runner._row_steps.items():  # the whole-step graphs by request row
        for sampling, g in steps.graphs.items():
            kinds[f"row_step[{shape.label}, {'sampling' if sampling else 'greedy'}]"] = g.capture_bytes
    private = [s for s in snap["segments"] if tuple(s.get("segment_pool_id", (0, 0))) != (0, 0)]
    seg_sizes = collections.Counter(s["total_size"] for s in private)
    live_by_frame = collections.Counter()
    for s in private:
        for b in s["blocks"]:
            if b["state"] == "active_allocated":
                live_by_frame[_frame(b)] += b["size"]
    # Trace: allocations in private pools, frees requested vs completed.
    actions = collections.Counter()
    alloc_by_frame = collections.Counter()
    for trace in snap.get("device_traces", []):
        for ev in trace:
            actions[ev["action"]] += 1
            if ev["action"] == "segment_alloc":
                alloc_by_frame[_frame(ev)] += ev["size"]
    row = {
        "config": name, "fused": fused, "reserved_growth_bytes": after - before,
        "capture_bytes_by_kind": kinds,
        "private_segments": len(private),
        "private_total_bytes": sum(s["total_size"] for s in private),
        "private_active_bytes": sum(s["active_size"] for s in private),
        "private_allocated_bytes": sum(s["allocated_size"] for s in private),
        "segment_sizes": {str(k): v for k, v in sorted(seg_sizes.items())},
        "live_by_frame": dict(live_by_frame.most_common(15)),
        "segment_alloc_by_frame": dict(alloc_by_frame.most_common(25)),
        "trace_actions": dict(actions),
    }
    log(f"{name} fused={fused}: growth {row['reserved_growth_bytes'] / 2**20:.0f} MiB, private "
        f"{row['private_total_bytes'] / 2**20:.0f} MiB in {len(private)} segments, active "
        f"{row['private_active_bytes'] / 2**20:.0f} MiB; by kind "
        + ", ".join(f"{k} {sum(v.values()) / 2**20:.0f}" for k, v in kinds.items()))
    for k, v in list(alloc_by_frame.most_common(8)):
        log(f"   segment allocs {v / 2**20:8.1f} MiB  {k}")
    del runner, head, target
    return row


def main() -> None:
    args = cuda_probe_args(__doc__)
    hc1 = {**HC4_TARGET, "hc_mult": 1}
    rows = [probe("hc4-mtp", HC4_TARGET, "MTP", True), probe("hc1-mtp", hc1, "MTP", True),
            probe("hc4-mtp", HC4_TARGET, "MTP", False)]
    if args.out:
        write_json("graph_pool_probe.json", rows, args.out)


if __name__ == "__main__":
    main()
