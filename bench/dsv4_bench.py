"""DeepSeek-V4 on the device: a reduced-depth DeepSeek-V4-Flash (its real width, heads, experts
and vocabulary from manifests/models/deepseek-v4-flash/config.json; 5 decoder layers: one
sliding-window, two compressed sparse, two heavily compressed, plus its MTP layer; random bf16
weights made on the device), served by the engine's Runner with CUDA graphs:

    decode      target-only Runner.step() at batch 1 and 16 after a `--context`-token prompt
    mtp         the speculative step with the MTP draft, chains of 1 and 3 steps and a tree
                (3 steps x topk 2, 6 nodes), at batch 1 and 16: step time, its multiple of the
                decode step, accepted tokens per step (random weights: the draft rarely agrees,
                so this measures cost, not speed-up)
    planner     planner truth: Runner(plan=...) for the plan of this config on this GPU (MTP, 3
                steps, 16 requests), the plan's terms against what the engine holds: weights,
                KV pools (compressed entries + recent rows + slot maps), graphs and buffers,
                a prefill of the plan's whole chunk (its peak against activation_workspace: a
                chunk that does not fit is reported as that term's shortfall), the driver's total
    fp4         the routed experts as FP4 codes (the published checkpoint's e2m1 pairs and E8M0
                scales, random): the decode step at batch 1 and 16 against the bf16 experts'
                step, and the dequantization alone (every MoE layer's copies of the experts a
                step's rows use, as the captured step makes them; the Triton kernel, and the
                torch code for comparison): its share of the FP4 step.
                Runs last (the experts stay FP4)

    python3 bench/dsv4_bench.py [--parts decode,mtp,planner,fp4] [--context 4096] [--out DIR]
    python3 bench/dsv4_bench.py --smoke          (CPU, a tiny config, seconds: the code path only)

Prints one SUMMARY line per figure and writes 8_dsv4.json (bench/report.py renders it as section 8
of docs/benchmarks.md: `python3 bench/report.py DIR ...`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # works under python3 -P too

from common import (REPO_ROOT, argv_command, bootstrap_specdeploy, device_memory, environment,  # noqa: E402
                    free_device_memory, log, param_bytes, sync, time_ms, write_json)

bootstrap_specdeploy()

from harness import random_init_, timed_steps  # noqa: E402
from specdeploy.engine.models.deepseek_v4 import V4ModelConfig, build_mtp, build_target  # noqa: E402
from specdeploy.engine.models import deepseek_v4 as v4mod  # noqa: E402
from specdeploy.engine.planner.plan import (GPUS, PREFILL_ALLOCATOR_SLACK, Limits, SpecSettings,  # noqa: E402
                                            custom_gpu, plan_from_configs)
from specdeploy.engine.runtime.runner import Request, Runner  # noqa: E402

FLASH = REPO_ROOT / "manifests" / "models" / "deepseek-v4-flash" / "config.json"
# 5 decoder layers (0: sliding window, 4: CSA, 128: HCA) and the MTP layer's entry (sliding).
REDUCED_RATIOS = [0, 4, 128, 4, 128, 0]
SHAPES = {"chain1": (1, 1, 2), "chain3": (3, 1, 4), "tree3x2": (3, 2, 6)}
PLANNER_TRUTH_GOAL = 0.05


def reduced_flash() -> dict:
    c = json.loads(FLASH.read_text())
    c.pop("quantization_config", None)  # random bf16 weights, not the FP8 / FP4 checkpoint
    c.pop("expert_dtype", None)
    c.update(num_hidden_layers=len(REDUCED_RATIOS) - 1, compress_ratios=REDUCED_RATIOS, num_hash_layers=1)
    return c


def smoke_config() -> dict:
    c = reduced_flash()
    c.update(hidden_size=64, num_attention_heads=4, head_dim=32, qk_rope_head_dim=8, q_lora_rank=32,
             o_groups=2, o_lora_rank=16, index_n_heads=2, index_head_dim=16, index_topk=4,
             n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, vocab_size=512,
             sliding_window=16, compress_ratios=[0, 4, 128, 4, 128, 0], torch_dtype="float32")
    return c


@torch.no_grad()
def random_v4(config: dict, device, dtype, seed: int):
    cfg = V4ModelConfig.from_hf(config)
    target = build_target(cfg, dtype, device)
    random_init_(target, seed)
    head = build_mtp(target, dtype, device)
    random_init_(head, seed + 1)
    gen = torch.Generator(device=device).manual_seed(seed)
    for model in (target, head):
        for name, buf in model.named_buffers():
            if name.endswith("tid2eid"):  # hash routing: a random expert set per token id
                buf.copy_(torch.randint(0, cfg.num_experts, buf.shape, device=device, generator=gen))
    return target, head


def _runner(target, head, spec: SpecSettings, batch: int, context: int, max_new: int, device, graph_mode: str):
    scratch = (spec.num_steps - 1) * spec.topk + spec.num_draft_tokens if head is not None else 1
    runner = Runner(target, head, spec, max_total_tokens=batch * (context + max_new + scratch + 2) + 8,
                    max_running_requests=batch, context_length=context + max_new + spec.num_steps + 8,
                    device=device, cuda_graph_batch_sizes=(batch,), graph_mode=graph_mode)
    gen = torch.Generator().manual_seed(3)
    for i in range(batch):
        prompt = torch.randint(3, target.cfg.vocab_size, (context,), generator=gen).tolist()
        runner.add(Request(f"r{i}", prompt, max_tokens=max_new))
    while runner.num_prefilling:  # prefill, a chunk per step
        runner.step()
    return runner


def step_ms(target, head, spec, batch, context, steps, warmup, device, graph_mode) -> dict:
    max_new = (steps + warmup + 4) * (spec.num_draft_tokens + 1)
    runner = _runner(target, head, spec, batch, context, max_new, device, graph_mode)
    recs = timed_steps(runner, steps, warmup, device, instrumented=False)
    del runner
    free_device_memory()
    if not recs:
        raise RuntimeError("no timed step")
    return {"step_ms": statistics.median(r["whole_ms"] for r in recs), "steps_timed": len(recs),
            "tokens_per_step": sum(r["tokens"] for r in recs) / (len(recs) * batch)}


def run_decode_and_mtp(target, head, args, device, graph_mode, parts) -> list[dict]:
    rows = []
    for batch in args.batches:
        base = step_ms(target, None, SpecSettings("NONE"), batch, args.context, args.steps, args.warmup, device, graph_mode)
        log(f"decode bs={batch:<3} step {base['step_ms']:.2f} ms = {batch / base['step_ms'] * 1e3:.1f} tok/s")
        rows.append({"kind": "decode", "batch": batch, "context": args.context, **base,
                     "tok_s": batch / base["step_ms"] * 1e3})
        if "mtp" not in parts:
            continue
        for name, (s, k, n) in SHAPES.items():
            try:
                r = step_ms(target, head, SpecSettings("MTP", s, k, n), batch, args.context, args.steps,
                            args.warmup, device, graph_mode)
            except Exception as e:  # one shape failing leaves the others standing
                rows.append({"kind": "mtp", "shape": name, "batch": batch, "error": f"{type(e).__name__}: {e}"[:400]})
                log(f"mtp {name} bs={batch} failed: {e}")
                traceback.print_exc()
                free_device_memory()
                continue
            r["x_decode_step"] = r["step_ms"] / base["step_ms"]
            log(f"mtp {name:<7} bs={batch:<3} step {r['step_ms']:.2f} ms = {r['x_decode_step']:.2f}x decode step, "
                f"{r['tokens_per_step']:.2f} tokens/step")
            rows.append({"kind": "mtp", "shape": name, "num_steps": s, "topk": k, "num_draft_tokens": n,
                         "batch": batch, "context": args.context, **r})
    return rows


def planner_truth(config: dict, target, head, args, device) -> dict:
    """The plan's per-GPU terms against what the engine holds once Runner(plan=...) is built and
    a prefill chunk has run."""
    cuda = device.type == "cuda"
    spec = SpecSettings("MTP", 3, 1, 4)
    limits = Limits(max_running_requests=16, context_length=args.context + 64, cuda_graph_max_bs=16)
    gpu = GPUS["h200"] if cuda else custom_gpu(4)
    if cuda:
        total = torch.cuda.get_device_properties(0).total_memory
        gpu = custom_gpu(total / 2**30) if abs(total - gpu.memory_bytes) > 2**30 else gpu
    p = plan_from_configs(config, None, spec, gpu, limits)
    m = p.memory_per_gpu
    weights = param_bytes(target) + param_bytes(head)
    free_device_memory()
    before = device_memory(device)
    t0 = time.perf_counter()
    runner = Runner(target, head, plan=p, device=device, graph_mode="capture" if cuda else "padded")
    sync(device)
    built = device_memory(device)
    kv = runner.target_kv.nbytes + runner.draft_kv.nbytes
    # one prefill chunk: as many prompts as fit the plan's chunk
    gen = torch.Generator().manual_seed(4)
    n_req = max(1, min(16, runner.prefill_chunk_tokens // args.context))
    for i in range(n_req):
        runner.add(Request(f"p{i}", torch.randint(3, target.cfg.vocab_size, (args.context,), generator=gen).tolist(),
                           max_tokens=4))
    chunk = n_req * args.context
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        allocated = torch.cuda.memory_allocated()
    try:
        runner.step()
    except torch.OutOfMemoryError as e:
        peak = torch.cuda.max_memory_allocated() - allocated
        del runner
        free_device_memory()
        raise RuntimeError(
            f"a prefill of the plan's chunk ({n_req} x {args.context} tokens) does not fit: the plan's "
            f"activation_workspace term ({m.activation_workspace_bytes / 2**30:.2f} GiB) under-counts it "
            f"(allocated {peak / 2**30:.2f} GiB beyond the runner before failing: {str(e)[:160]})") from None
    sync(device)
    after = device_memory(device)
    out = {
        "plan": {"max_total_tokens": p.max_total_tokens, "tensor_parallel_size": p.tensor_parallel_size,
                 **{k: getattr(m, k) for k in ("weight_bytes", "cuda_graph_pool_bytes", "activation_workspace_bytes",
                                               "static_buffer_bytes", "per_request_state_bytes", "reserve_bytes",
                                               "kv_cache_bytes", "kv_cache_bytes_per_token", "gpu_memory_bytes")}},
        "measured": {"weights": weights, "kv_pools": kv, "build_s": time.perf_counter() - t0,
                     "prefill_tokens": chunk},
    }
    planned_kv = m.kv_cache_bytes + m.per_request_state_bytes
    out["kv_pools_vs_plan"] = kv / planned_kv
    out["weights_vs_plan"] = weights / m.weight_bytes
    if cuda:
        runner_reserved = built["reserved"] - before["reserved"]
        out["measured"].update(runner_reserved=runner_reserved, graphs_and_buffers=runner_reserved - kv,
                               prefill_peak_reserved=after["max_reserved"] - built["reserved"],
                               driver_used=after["driver_used"], nvidia_smi_used=after["nvidia_smi_used"])
        planned_total = m.gpu_memory_bytes - (m.kv_cache_budget_bytes - m.kv_cache_bytes)
        unusable = m.gpu_memory_bytes - after["driver_total"]
        out["total_vs_plan"] = (after["driver_used"] + unusable) / planned_total
        out["graphs_and_buffers_vs_plan"] = (runner_reserved - kv) / (m.cuda_graph_pool_bytes + m.static_buffer_bytes)
        out["measured"]["prefill_peak_allocated"] = torch.cuda.max_memory_allocated() - allocated
        out["prefill_peak_vs_plan"] = out["measured"]["prefill_peak_reserved"] / m.activation_workspace_bytes
        # the forward's tensors alone against the plan's count of them (the workspace less its
        # allocator slack)
        out["prefill_allocated_vs_plan"] = out["measured"]["prefill_peak_allocated"] / (
            m.activation_workspace_bytes / (1 + PREFILL_ALLOCATOR_SLACK))
        out["within_goal"] = abs(out["total_vs_plan"] - 1) <= PLANNER_TRUTH_GOAL
    del runner
    free_device_memory()
    return out


@torch.no_grad()
def quantize_experts_fp4(models, seed: int) -> int:
    """Every routed expert of `models` as FP4 codes, in place: random e2m1 pairs and E8M0 scale
    bits around 2^-7 (weights of about 0.01, like the bf16 init). Returns the MoE layers."""
    layers = 0
    for model in models:
        for m in model.modules():
            if isinstance(m, v4mod._Experts):
                m.quantize("fp4")
                dev = m.gate_up_proj.device
                gen = torch.Generator(device=dev).manual_seed(seed + layers)
                for name in ("gate_up_proj", "down_proj"):
                    codes, bits = getattr(m, name), getattr(m, name + "_scale")
                    codes.copy_(torch.randint(-128, 128, codes.shape, device=dev, generator=gen, dtype=torch.int8))
                    bits.copy_(torch.randint(118, 124, bits.shape, device=dev, generator=gen, dtype=torch.uint8))
                layers += 1
    return layers


def dequant_ms(experts: list, batch: int, rows_per_token: int, device) -> float:
    """The dequantization a captured decode step of `batch` rows does, alone: per MoE layer the
    path's copies (the rows' experts EXPERT_DEQUANT_CHUNK at a time when fewer rows than experts,
    else every expert EXPERT_DEQUANT_CHUNK at a time), both projections."""
    rows = batch * rows_per_token
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    gen = torch.Generator(device=device).manual_seed(9)
    calls = []
    for m in experts:
        e, chunk = m.num_local, v4mod.EXPERT_DEQUANT_CHUNK
        if v4mod.expert_path(rows, e, True, True, True) == "gathered":
            ids = torch.randint(0, e, (rows,), device=device, generator=gen)
            calls += [(m, ids[r0:r0 + chunk]) for r0 in range(0, rows, chunk)]
        else:
            calls += [(m, slice(c0, min(e, c0 + chunk))) for c0 in range(0, e, chunk)]

    def run():
        for m, sel in calls:
            m.weight("gate_up_proj", sel, dtype)
            m.weight("down_proj", sel, dtype)
    return time_ms(run, device, warmup=2, reps=5)["median_ms"]


def torch_dequant_ms(experts: list, batch: int, rows_per_token: int, device) -> float:
    """dequant_ms through the torch code instead of the Triton kernel (engine/kernels/fp4.py)."""
    saved = v4mod.fused_kernels
    v4mod.fused_kernels = lambda *args, **kwargs: None
    try:
        return dequant_ms(experts, batch, rows_per_token, device)
    finally:
        v4mod.fused_kernels = saved


def run_fp4(target, head, args, device, graph_mode, bf16_rows) -> list[dict]:
    bf16 = {r["batch"]: r["step_ms"] for r in bf16_rows if r.get("kind") == "decode" and "error" not in r}
    for batch in args.batches:  # the bf16 steps, unless the decode part measured them
        if batch not in bf16:
            bf16[batch] = step_ms(target, None, SpecSettings("NONE"), batch, args.context, args.steps, args.warmup,
                                  device, graph_mode)["step_ms"]
    quantize_experts_fp4([target, head], seed=11)
    free_device_memory()
    experts = [m for m in target.modules() if isinstance(m, v4mod._Experts)]
    out = []
    for batch in args.batches:
        fp4 = step_ms(target, None, SpecSettings("NONE"), batch, args.context, args.steps, args.warmup, device, graph_mode)
        alone = dequant_ms(experts, batch, target.cfg.num_experts_per_tok, device)
        torch_alone = torch_dequant_ms(experts, batch, target.cfg.num_experts_per_tok, device)
        row = {"kind": "fp4", "batch": batch, "moe_layers": len(experts), "bf16_step_ms": bf16[batch],
               "fp4_step_ms": fp4["step_ms"], "x_bf16_step": fp4["step_ms"] / bf16[batch],
               "dequant_ms": alone, "dequant_share": alone / fp4["step_ms"], "dequant_torch_ms": torch_alone}
        log(f"fp4 experts bs={batch:<3} step {fp4['step_ms']:.2f} ms ({row['x_bf16_step']:.2f}x bf16), "
            f"dequantization alone {alone:.2f} ms = {row['dequant_share']:.0%} of the step "
            f"(torch code: {torch_alone:.2f} ms)")
        out.append(row)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="CPU, a tiny config: the code path only")
    ap.add_argument("--parts", default="decode,mtp,planner,fp4")
    ap.add_argument("--context", type=int, default=None, help="prompt tokens per request (default 4096; smoke 40)")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    parts = set(args.parts.split(","))
    cuda = torch.cuda.is_available() and not args.smoke
    if not cuda and not args.smoke:
        sys.exit("CUDA only (or --smoke on CPU)")
    device = torch.device("cuda" if cuda else "cpu")
    args.batches = [int(b) for b in args.batches.split(",")] if cuda else [2]
    args.context = args.context or (4096 if cuda else 40)
    args.steps = args.steps or (20 if cuda else 2)
    args.warmup = args.warmup if args.warmup is not None else (3 if cuda else 1)
    config = reduced_flash() if cuda else smoke_config()
    dtype = torch.bfloat16 if cuda else torch.float32
    if not cuda:
        torch.set_num_threads(1)
    graph_mode = "capture" if cuda else "padded"
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
    t0 = time.perf_counter()
    target, head = random_v4(config, device, dtype, seed=0)
    sync(device)
    log(f"random DeepSeek-V4 ({'Flash width' if cuda else 'smoke'}, ratios {config['compress_ratios']}): "
        f"target {param_bytes(target) / 2**30:.1f} GiB + MTP {param_bytes(head) / 2**30:.1f} GiB in "
        f"{time.perf_counter() - t0:.1f} s")
    result = {"environment": environment(), "config": {k: config[k] for k in (
        "hidden_size", "num_attention_heads", "head_dim", "n_routed_experts", "num_experts_per_tok",
        "moe_intermediate_size", "vocab_size", "hc_mult", "sliding_window", "index_topk", "compress_ratios")},
        "context": args.context, "graph_mode": graph_mode, "rows": [], "summary": []}
    with torch.inference_mode():
        if parts & {"decode", "mtp"}:
            result["rows"] = run_decode_and_mtp(target, head, args, device, graph_mode, parts)
        if "planner" in parts:
            try:
                result["planner_truth"] = planner_truth(config, target, head, args, device)
            except Exception as e:
                traceback.print_exc()
                result["planner_truth"] = {"error": f"{type(e).__name__}: {e}"[:600]}
                free_device_memory()
        if "fp4" in parts:  # last: the experts stay FP4
            try:
                result["fp4"] = run_fp4(target, head, args, device, graph_mode, result["rows"])
            except Exception as e:
                traceback.print_exc()
                result["fp4"] = [{"kind": "fp4", "error": f"{type(e).__name__}: {e}"[:400]}]
    for r in result["rows"]:
        if "error" in r:
            result["summary"].append(f"{r['kind']} {r.get('shape', '')} bs={r['batch']}: ERROR {r['error'][:120]}")
        elif r["kind"] == "decode":
            result["summary"].append(f"decode bs={r['batch']}: {r['step_ms']:.2f} ms/step, {r['tok_s']:.1f} tok/s")
        else:
            result["summary"].append(f"mtp {r['shape']} bs={r['batch']}: {r['step_ms']:.2f} ms/step = "
                                     f"{r['x_decode_step']:.2f}x decode, {r['tokens_per_step']:.2f} tok/step")
    for r in result.get("fp4", []):
        if "error" in r:
            result["summary"].append(f"fp4 experts: ERROR {r['error'][:200]}")
        else:
            result["summary"].append(
                f"fp4 experts bs={r['batch']}: {r['fp4_step_ms']:.2f} ms/step = {r['x_bf16_step']:.2f}x the bf16 "
                f"experts' step; dequantization {r['dequant_ms']:.2f} ms = {r['dequant_share']:.0%} of it "
                f"(the torch code's {r['dequant_torch_ms']:.2f} ms)")
    pt = result.get("planner_truth")
    if pt and "error" not in pt:
        line = f"planner truth: KV pools {pt['kv_pools_vs_plan']:.4f}x plan, weights {pt['weights_vs_plan']:.4f}x"
        if "total_vs_plan" in pt:
            line += (f", graphs+buffers {pt['graphs_and_buffers_vs_plan']:.2f}x, prefill of "
                     f"{pt['measured']['prefill_tokens']} tokens: peak reserved {pt['prefill_peak_vs_plan']:.2f}x "
                     f"the workspace, allocated {pt['prefill_allocated_vs_plan']:.2f}x its tensors, "
                     f"total {pt['total_vs_plan']:.4f}x "
                     f"(goal within {PLANNER_TRUTH_GOAL:.0%}: {'met' if pt['within_goal'] else 'NOT met'})")
        result["summary"].append(line)
    elif pt:
        result["summary"].append(f"planner truth: ERROR {pt['error'][:200]}")
    for line in result["summary"]:
        print("SUMMARY", line, flush=True)
    failed = (any("error" in r for r in result["rows"] + result.get("fp4", [])) or "error" in (pt or {}))
    # As a section of the benchmark page (bench/report.py renders it as section 8).
    write_json("8_dsv4.json", {"section": "8", "title": "DeepSeek-V4-Flash, reduced depth: decode, MTP steps, planner truth",
                               "status": "partial" if failed else "ok", "command": argv_command(),
                               "duration_s": time.perf_counter() - t0, "smoke": not cuda, "results": result}, args.out)


if __name__ == "__main__":
    main()
