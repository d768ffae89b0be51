"""Section 6: planner truth. For each benchmarked configuration, the plan's per-GPU memory
(engine/planner/plan.py, plan_from_configs) against what the engine really holds:

    weights      parameter bytes of the target and head as built      vs plan weight_bytes
    KV pools     the Runner's target + draft pools, sized by the plan   vs plan kv_cache_bytes
    static       what Runner(plan, graph_mode="padded") holds beyond its KV pools: the graphs'
                 static input/hidden-state buffers, slot table, draft state rows
                                                   vs plan static buffers + per-request state
    graph pool   what Runner(plan) (graph_mode "capture": every bucket of target decode, or of
                 the fused speculative step, greedy and sampling; the short-prefill-chunk graphs,
                 engine/runtime/extend_graphs.py) holds beyond the padded runner
                                                   vs plan cuda_graph_pool_bytes
    workspace    peak transient memory of a prefill of PREFILL_CHUNK_TOKENS tokens through the
                 Runner (8 requests of 1K tokens)                       vs plan activation_workspace_bytes
    outside torch  driver-used minus torch-reserved (CUDA context, library workspaces), plus the
                 part of the plan's GPU total the driver never hands out     vs plan reserve
    total        the driver's used memory at the end (nvidia-smi beside it) plus that unusable
                 part                                                   vs the plan's sum of terms

Allocator figures are torch.cuda.memory_reserved() deltas. The engine allocates exactly the
plan's KV pool (Runner(plan=...)), so an over-optimistic plan shows up as an out-of-memory error
here, and an over-cautious one as memory left unused.
"""

from __future__ import annotations

import dataclasses
import time
import traceback

import torch

from common import (LLAMA_31_8B, device_memory, free_device_memory, log, param_bytes)
from harness import (eagle3_head_config, eagle_head_config, mtp_head_config, random_head,
                     random_target)
from specdeploy.engine.planner import plan as plan_mod
from specdeploy.engine.planner.plan import GPUS, Limits, SpecSettings, custom_gpu, plan_from_configs
from specdeploy.engine.runtime.runner import Request, Runner


# Second attempt when the plan's KV pool leaves the engine too little room (see measure()).
RETRY_KV_SHRINK_BYTES = 8 << 30


def configurations(ctx) -> dict:
    t = ctx["target_config"]
    hc4 = ctx["hc4_config"]
    big = (64, 2048, 64) if not ctx.smoke else (4, 96, 4)
    small = (16, 2048, 16) if not ctx.smoke else (2, 96, 2)
    vocab3 = ctx["eagle3_draft_vocab"]
    return {
        "llama8b-none": (t, None, SpecSettings("NONE"), Limits(*big)),
        "llama8b-eagle3-chain": (t, eagle3_head_config(t, vocab3), SpecSettings("EAGLE3", 3, 1, 4), Limits(*small)),
        "llama8b-eagle-tree": (t, eagle_head_config(t), SpecSettings("EAGLE", 3, 4, 8), Limits(*small)),
        "hc4-mtp-chain": (hc4, mtp_head_config(hc4), SpecSettings("MTP", 3, 1, 4), Limits(*small)),
    }


def _gpu(ctx):
    if ctx["gpu"]:
        return GPUS[ctx["gpu"]]
    # CPU smoke: room for the plan's fixed terms (an FP8 target's graph-pool reserve too) plus a
    # small KV pool.
    fixed = plan_mod.RESERVE_BYTES + plan_mod.CUDA_GRAPH_POOL_BASE_BYTES + plan_mod.FP8_LIBRARY_GRAPH_POOL_BYTES
    return custom_gpu((fixed + (96 << 20)) / plan_mod.GIB)


def _term(predicted, measured) -> dict:
    row = {"predicted_bytes": predicted, "measured_bytes": measured}
    if measured is not None and predicted:
        row["measured_over_predicted"] = measured / predicted
    return row


def measure(name: str, config, draft_config, spec: SpecSettings, limits: Limits, ctx) -> dict:
    dev = ctx.device
    cuda = dev.type == "cuda"
    free_device_memory()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    m0 = device_memory(dev)
    plan = plan_from_configs(config, draft_config, spec, _gpu(ctx), limits)
    mem = plan.memory_per_gpu
    log(f"{name}: plan TP {plan.tensor_parallel_size}, max_total_tokens {plan.max_total_tokens}, "
        f"weights {mem.weight_bytes / 1e9:.2f} GB, KV {mem.kv_cache_bytes / 1e9:.2f} GB, "
        f"graph pool {mem.cuda_graph_pool_bytes / 1e9:.2f} GB, workspace {mem.activation_workspace_bytes / 1e9:.2f} GB")
    out = {"config": name, "algorithm": spec.algorithm, "limits": vars(limits) if hasattr(limits, "__dict__") else str(limits),
           "plan": plan.to_dict(), "terms": {}, "notes": []}
    if plan.tensor_parallel_size != 1:
        out["notes"].append(f"plan chose TP {plan.tensor_parallel_size}; one GPU measured")

    target = random_target(config, dev, ctx.dtype)
    head = random_head(spec.algorithm, draft_config, target) if draft_config is not None else None
    weights = param_bytes(target) + (param_bytes(head) if head is not None else 0)
    m1 = device_memory(dev)
    out["terms"]["weights"] = _term(mem.weight_bytes, weights)
    if cuda:
        out["terms"]["weights"]["allocated_delta_bytes"] = m1["allocated"] - m0["allocated"]

    runner_spec = SpecSettings(spec.algorithm, spec.num_steps, spec.topk, spec.num_draft_tokens) \
        if head is not None else SpecSettings("NONE")
    kv = static = runner = None
    t0 = time.perf_counter()
    # The plan's own KV pool first; should the engine not fit beside it, once more with the pool
    # smaller by RETRY_KV_SHRINK_BYTES, so the other terms are still measured (and the shortfall
    # is known to within that step).
    for shrink in (0, RETRY_KV_SHRINK_BYTES if cuda else None):
        if shrink is None:
            break
        if shrink:
            # After the except block below, whose exception (and the frames it holds, with the
            # failed attempt's pools) is gone by now.
            free_device_memory()
        run_plan = plan if not shrink else dataclasses.replace(
            plan, max_total_tokens=plan.max_total_tokens - shrink // mem.kv_cache_bytes_per_token)
        try:
            if cuda:
                # Padded: the graphs' static buffers without any capture.
                padded = Runner(target, head, runner_spec, plan=run_plan, device=dev, graph_mode="padded")
                kv = padded.target_kv.nbytes + (padded.draft_kv.nbytes if padded.draft_kv is not None else 0)
                torch.cuda.synchronize()
                static = torch.cuda.memory_reserved() - m1["reserved"] - kv
                del padded
                free_device_memory()
            # Captures on CUDA, the short-prefill-chunk graphs too, as engine serve does by default
            # (their static buffers counted with their pool, as the plan counts them).
            runner = Runner(target, head, runner_spec, plan=run_plan, device=dev, extend_graphs=True)
            out["kv_shrunk_bytes"] = shrink
            break
        except Exception as e:  # e.g. out of memory: the plan promised more than the GPU has
            out.setdefault("runner_errors", []).append(f"KV shrunk by {shrink} B: {type(e).__name__}: {e}"[:800])
            log(f"{name}: Runner(plan) with KV shrunk by {shrink / 2**30:.0f} GiB failed: {str(e)[:200]}")
            padded = runner = None
    out["runner_build_s"] = time.perf_counter() - t0
    if cuda:
        # Blocks the capture warm-ups left cached are reusable by any later work; the graphs'
        # private pools are not, and stay reserved through empty_cache.
        torch.cuda.synchronize()
        out["cached_after_capture_bytes"] = torch.cuda.memory_reserved()
        torch.cuda.empty_cache()
        out["cached_after_capture_bytes"] -= torch.cuda.memory_reserved()
    m2 = device_memory(dev)
    if runner is not None:
        kv = runner.target_kv.nbytes + (runner.draft_kv.nbytes if runner.draft_kv is not None else 0)
        out["terms"]["kv_pools"] = _term(mem.kv_cache_bytes, kv)
        if cuda:
            out["terms"]["static_buffers"] = _term(mem.static_buffer_bytes + mem.per_request_state_bytes, static)
            graph_bytes = m2["reserved"] - m1["reserved"] - kv - static
            out["terms"]["cuda_graph_pool"] = _term(mem.cuda_graph_pool_bytes, graph_bytes)
            out["terms"]["cuda_graph_pool"]["buckets"] = list(plan.cuda_graph_batch_sizes)
        else:
            out["terms"]["static_buffers"] = _term(mem.static_buffer_bytes + mem.per_request_state_bytes, None)
            out["terms"]["cuda_graph_pool"] = _term(mem.cuda_graph_pool_bytes, None)
            out["notes"].append("no CUDA: static buffers and graph pool not measured")
        # Workspace: one prefill chunk through the Runner.
        try:
            out["terms"]["activation_workspace"] = _term(mem.activation_workspace_bytes,
                                                         _prefill_peak(runner, target, limits, out, cuda))
        except Exception as e:  # out of memory in prefill: the workspace term undercounts
            error = f"{type(e).__name__}: {e}"[:500]
            if isinstance(e, torch.OutOfMemoryError):
                pre = out.get("prefill_attempt", {})
                error = (f"a prefill of the plan's chunk ({pre.get('requests')} x {pre.get('prompt_tokens')} tokens) "
                         f"does not fit: the plan's activation_workspace term "
                         f"({mem.activation_workspace_bytes / 2**30:.2f} GiB) under-counts it (allocated "
                         f"{pre.get('allocated_bytes', 0) / 2**30:.2f} GiB beyond the runner before failing): " + error)[:700]
            out["terms"]["activation_workspace"] = {**_term(mem.activation_workspace_bytes, None), "error": error}
            log(f"{name}: prefill failed: {error[:400]}")
    kv = kv or 0

    m_end = device_memory(dev)
    predicted_total = (mem.weight_bytes + mem.cuda_graph_pool_bytes + mem.activation_workspace_bytes
                       + mem.static_buffer_bytes + mem.per_request_state_bytes + mem.reserve_bytes
                       + mem.kv_cache_bytes)
    if cuda:
        # Outside torch: what the process holds beyond torch's allocator, plus what the plan's GPU
        # total counts but the driver never hands out (the reserve covers both).
        unusable = max(mem.gpu_memory_bytes - m_end["driver_total"], 0)
        outside = m_end["driver_used"] - torch.cuda.memory_reserved() + unusable
        out["terms"]["outside_torch"] = _term(mem.reserve_bytes, outside)
        out["terms"]["outside_torch"]["unusable_bytes"] = unusable
        # Total: the plan's GPU total against what the engine holds plus what it could not have.
        # With a shrunk pool, the engine would have needed the shrink on top of what it holds.
        needed = m_end["driver_used"] + unusable + out.get("kv_shrunk_bytes", 0)
        out["terms"]["total"] = _term(predicted_total, needed)
        out["terms"]["total"]["nvidia_smi_used_bytes"] = m_end["nvidia_smi_used"]
        out["terms"]["total_except_kv"] = _term(predicted_total - mem.kv_cache_bytes,
                                                m_end["driver_used"] + unusable - kv)
        if out.get("kv_shrunk_bytes"):
            out["notes"].append(f"the plan's KV pool did not fit beside the engine: measured with it "
                                f"{out['kv_shrunk_bytes'] / 2**30:.0f} GiB smaller; 'total' adds that back")
        out["memory_snapshots"] = {"start": m0, "weights": m1, "kv": m2, "end": m_end}
        out["gpu_total_bytes_driver"] = m_end["driver_total"]
        out["plan_gpu_memory_bytes"] = mem.gpu_memory_bytes
    else:
        out["terms"]["total"] = _term(predicted_total, None)
        out["notes"].append(f"no CUDA: weights + KV pools {weights + kv} B, process memory not measured")
    del runner, head, target
    free_device_memory()
    return out


def _prefill_peak(runner, target, limits, out: dict, cuda: bool):
    """Peak transient bytes of one prefill chunk (PREFILL_CHUNK_TOKENS tokens as requests of up
    to 1K tokens) through Runner.step()."""
    prompt_len = min(1024, limits.context_length // 2)
    n_req = max(1, min(limits.max_running_requests, plan_mod.PREFILL_CHUNK_TOKENS // prompt_len))
    gen = torch.Generator().manual_seed(5)
    for i in range(n_req):
        runner.add(Request(f"p{i}", torch.randint(3, target.cfg.vocab_size, (prompt_len,), generator=gen).tolist(),
                           max_tokens=4))
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    out["prefill_attempt"] = {"requests": n_req, "prompt_tokens": prompt_len}
    try:
        runner.step()
    except torch.OutOfMemoryError:
        out["prefill_attempt"]["allocated_bytes"] = torch.cuda.max_memory_allocated() - base
        raise
    out["prefill"] = {"requests": n_req, "prompt_tokens": prompt_len, "seconds": time.perf_counter() - t0}
    if not cuda:
        return None
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def run(ctx) -> dict:
    configs = configurations(ctx)
    rows = []
    for name in ctx["planner_configs"]:
        config, draft_config, spec, limits = configs[name]
        try:
            rows.append(measure(name, config, draft_config, spec, limits, ctx))
        except Exception as e:  # an OOM here is itself a planner finding: record it and go on
            rows.append({"config": name, "algorithm": spec.algorithm, "error": f"{type(e).__name__}: {e}"[:800],
                         "traceback": traceback.format_exc()[-2000:]})
            log(f"{name} failed: {rows[-1]['error'][:300]}")
            free_device_memory()
            continue
        terms = rows[-1]["terms"]
        parts = [f"{k} {v['measured_over_predicted']:.3f}" for k, v in terms.items()
                 if "measured_over_predicted" in v]
        log(f"{name}: measured / predicted: " + ", ".join(parts))
    summary = []
    for r in rows:
        total = r.get("terms", {}).get("total", {})
        if "measured_over_predicted" in total:
            summary.append(f"{r['config']} total {total['measured_over_predicted']:.3f}")
        else:
            summary.append(f"{r['config']} {'error' if 'error' in r else 'total n/a'}")
    summary.append("goal within 5%")
    return {"rows": rows, "goal": {"metric": "total measured / predicted", "target": "0.95..1.05"},
            "summary": summary, "gpu_catalog": ctx["gpu"] or "custom (smoke)",
            "shape_source": "random weights, shapes of " + ("Llama-3.1-8B" if ctx["target_config"] is LLAMA_31_8B else "tiny Llama")}
