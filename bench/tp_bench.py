"""Tensor-parallel benchmark: the Llama-3.3-70B shape with random bf16 weights on N GPUs (default
2), one process per GPU as the engine runs them (engine/runtime/distributed.py), every rank
making the same calls so the collectives pair up; rank 0 records. In one run:

  bandwidth   device copy bandwidth of each GPU (read + write), the decode roofline's ceiling
  decode      the engine's graphed target decode (GraphedCalls.target_decode, all-reduces inside
              the graph) at batch 1/16/64, 1K context: tok/s and its fraction of the roofline
              (weights and KV one rank reads per step / bandwidth)
  spec        the fused speculative step (one graph: draft, verify, draft extend) of an EAGLE-3
              head of the 70B shape, chain (3, 1, 4) and tree (3, 4, 8), greedy: its time as a
              multiple of one decode step at the same batch
  all-reduce  [T, 8192] bf16 all-reduces captured 50 to a graph, NCCL against the symmetric-memory
              one-shot kernel, T = 1 .. 512 (decode and verify message sizes)
  decode-symm the decode again with --all-reduce symm-mem
  memory      what rank 0 holds (weights, KV per token, graph pools) against the plan's per-GPU
              terms for the same deployment (engine/planner/plan.py)

    python3 bench/tp_bench.py [--tp 2] [--out /tmp/tp_bench.json]
    python3 bench/tp_bench.py --smoke        # tiny model, gloo on CPU: the script's own check
NVLink multicast stays off (the engine's init sets NCCL_NVLS_ENABLE=0 and its peers).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO_ROOT, bootstrap_specdeploy, copy_bandwidth_bytes_per_s, time_ms  # noqa: E402
from common import log as say  # noqa: E402

bootstrap_specdeploy(REPO_ROOT)

import torch  # noqa: E402

# yuhuili/EAGLE3-LLaMA3.3-Instruct-70B's shape: one layer of the target's width, 32K draft vocabulary.
EAGLE3_70B = {"hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 1,
              "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 128,
              "draft_vocab_size": 32000}
SHAPES = {"chain (3,1,4)": (3, 1, 4), "tree (3,4,8)": (3, 4, 8)}
ALL_REDUCE_ROWS = (1, 4, 16, 64, 128, 256, 512)
ALL_REDUCES_PER_GRAPH = 50


def _configs(smoke: bool) -> tuple[dict, dict]:
    target = json.loads((REPO_ROOT / "manifests/models/llama-3.3-70b-instruct/config.json").read_text())
    draft = {**target, "architectures": ["LlamaForCausalLMEagle3"], **EAGLE3_70B}
    if smoke:
        small = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 5, "num_attention_heads": 4,
                 "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 512}
        target = {**target, **small}
        draft = {**draft, **small, "num_hidden_layers": 1, "draft_vocab_size": 256}
    return target, draft


def _random_(module, generator) -> None:
    """Random weights in place, on the device: N(0, 0.02) matrices, norms 1, d2t 0, t2d all."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=generator)


def _build(target_config, draft_config, algorithm, rank, tp, device, dtype):
    from specdeploy.engine.models.draft import build_draft
    from specdeploy.engine.models.layers import rope_inv_freq
    from specdeploy.engine.models.llama import LlamaModel, ModelConfig

    cfg = ModelConfig.from_hf(target_config)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # allocate in bf16 directly: a float32 70B shard would not fit
    try:
        with torch.device(device):
            target = LlamaModel(cfg, tp_rank=rank, tp_size=tp).eval()
        target.inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling).to(device)
        g = torch.Generator(device=device).manual_seed(rank)
        _random_(target, g)
        draft = None
        if algorithm != "NONE":
            dcfg = ModelConfig.from_hf(draft_config, allow_any_type=True)
            draft = build_draft(algorithm, dcfg, target, dtype, device,
                                draft_vocab_size=draft_config["draft_vocab_size"])
            _random_(draft, g)
    finally:
        torch.set_default_dtype(previous)
    return target, draft


def _bytes(module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def _decode_inputs(b, context, device):
    # Request i holds slots 1 + i * context .. (i + 1) * context; the new token goes after them.
    base = torch.arange(b, device=device)[:, None] * (context + 16) + 1
    prefix = base + torch.arange(context, device=device)
    lens = torch.full((b,), context, device=device)
    return dict(ids=torch.zeros(b, 1, dtype=torch.int64, device=device), positions=lens[:, None],
                out_slots=base + context, prefix_slots=prefix, prefix_lens=lens)


def _spec_inputs(b, context, steps, topk, n, hidden, device, dtype):
    base = torch.arange(b, device=device)[:, None] * (context + 16) + 1
    lens = torch.full((b,), context, device=device)
    extra = base + context + torch.arange(16, device=device)
    return dict(roots=torch.zeros(b, dtype=torch.int64, device=device), lens=lens,
                prefix_slots=base + torch.arange(context, device=device),
                hidden=torch.zeros(b * topk, hidden, dtype=dtype, device=device),
                scratch=extra[:, :(steps - 1) * topk], tree_slots=extra[:, (steps - 1) * topk:(steps - 1) * topk + n],
                temperature=torch.zeros(b, device=device), top_k=torch.zeros(b, dtype=torch.int64, device=device),
                top_p=torch.ones(b, device=device),
                uniforms=torch.full((b, n + 1 + steps), 0.5, device=device), sampling=False)


def _runner(target, draft, spec, batches, context, device):
    from specdeploy.engine.runtime.runner import Runner

    from specdeploy.engine.runtime.graphs import GraphedCalls

    # The runner's pools with the calls graphed one kind at a time (the runner itself captures
    # whole steps by request row, which take no inputs of a call's own): what is timed here.
    slots = max(batches) * (context + 16) + 1
    runner = Runner(target, draft, spec, max_total_tokens=slots, max_running_requests=max(batches),
                    context_length=context + 64, device=device, graph_mode="off")
    runner.calls = GraphedCalls(runner.calls, tuple(batches), context + 64, capture=device.type == "cuda")
    return runner


def _all_reduce_ms(tp_group, rows, hidden, device, reps):
    out = {}
    for t in rows:
        x = torch.randn(t, hidden, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32, device=device)
        if device.type == "cuda":
            graph = torch.cuda.CUDAGraph()
            for _ in range(3):
                tp_group.all_reduce(x.clone())
            torch.cuda.synchronize()
            with torch.cuda.graph(graph):
                for _ in range(ALL_REDUCES_PER_GRAPH):
                    y = tp_group.all_reduce(x.clone())
            del y
            ms = time_ms(graph.replay, device, warmup=3, reps=reps)["median_ms"] / ALL_REDUCES_PER_GRAPH
        else:
            ms = time_ms(lambda: tp_group.all_reduce(x.clone()), device, warmup=2, reps=reps)["median_ms"]
        out[t] = 1e3 * ms  # microseconds
    return out


def bench_rank(rank: int, args, init_method: str) -> dict | None:
    from specdeploy.engine.planner.plan import GPUS, Limits, SpecSettings, custom_gpu, plan_from_configs
    from specdeploy.engine import parallel

    cuda = not args.smoke
    device = torch.device(f"cuda:{rank}" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    tp = parallel.init_tp(rank, args.tp, init_method, device)

    def log(msg: str) -> None:  # every rank measures the same; rank 0 speaks for them
        if rank == 0:
            say(msg)

    target_config, draft_config = _configs(args.smoke)
    batches, context, reps = ((1, 16, 64), args.context, args.reps) if cuda else ((1, 2), 16, 3)
    result: dict = {"tp": args.tp, "device": torch.cuda.get_device_name(device) if cuda else "cpu",
                    "context": context}

    bandwidth = copy_bandwidth_bytes_per_s(device=device) if cuda else 1e10
    result["bandwidth_bytes_per_s"] = bandwidth
    log(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s (rank 0's GPU)")

    target, draft = _build(target_config, draft_config, "EAGLE3", rank, args.tp, device, dtype)
    weights = {"target": _bytes(target), "draft": _bytes(draft)}
    kv_per_token = (2 * target.cfg.num_layers * target.layers[0].self_attn.local_kv_heads * target.cfg.head_dim
                    * torch.empty(0, dtype=dtype).element_size())

    # Decode (target only), then the speculative step of each shape at the same batch sizes.
    runner = _runner(target, None, None, batches, context, device)
    decode = {}
    for b in batches:
        inputs = _decode_inputs(b, context, device)
        ms = time_ms(lambda inputs=inputs: runner.calls.target_decode(**inputs), device, warmup=3, reps=reps)["median_ms"]
        step_bytes = weights["target"] + b * context * kv_per_token
        decode[b] = {"ms": ms, "tok_s": b / (ms / 1e3), "roofline_tok_s": b / (step_bytes / bandwidth)}
        decode[b]["fraction_of_roofline"] = decode[b]["tok_s"] / decode[b]["roofline_tok_s"]
        log(f"decode bs={b}: {ms:.3f} ms, {decode[b]['tok_s']:.0f} tok/s, "
            f"{100 * decode[b]['fraction_of_roofline']:.0f}% of roofline")
    graph_pool = {"decode": torch.cuda.memory_reserved(device) if cuda else 0}
    del runner
    result["decode"] = decode

    spec_results = {}
    for label, (steps, topk, n) in SHAPES.items():
        runner = _runner(target, draft, SpecSettings("EAGLE3", steps, topk, n), batches, context, device)
        rows = {}
        for b in batches:
            inputs = _spec_inputs(b, context, steps, topk, n, draft.carried_size, device, dtype)
            ms = time_ms(lambda inputs=inputs: runner.calls.spec_step(**inputs), device, warmup=3, reps=reps)["median_ms"]
            rows[b] = {"ms": ms, "multiple_of_decode": ms / decode[b]["ms"]}
            log(f"EAGLE-3 {label} bs={b}: {ms:.3f} ms = {rows[b]['multiple_of_decode']:.2f} x decode")
        spec_results[label] = rows
        if cuda:
            graph_pool[label] = torch.cuda.memory_reserved(device)
        del runner
    result["spec_step"] = spec_results

    result["all_reduce_us"] = {"nccl": _all_reduce_ms(tp, ALL_REDUCE_ROWS, target.cfg.hidden_size, device, reps)}
    if cuda:
        tp.enable_symm_mem()
        result["all_reduce_us"]["symm-mem"] = _all_reduce_ms(tp, ALL_REDUCE_ROWS, target.cfg.hidden_size, device, reps)
        runner = _runner(target, None, None, batches, context, device)
        result["decode_symm_mem"] = {}
        for b in batches:
            inputs = _decode_inputs(b, context, device)
            ms = time_ms(lambda inputs=inputs: runner.calls.target_decode(**inputs), device, warmup=3, reps=reps)["median_ms"]
            result["decode_symm_mem"][b] = {"ms": ms, "tok_s": b / (ms / 1e3)}
            log(f"decode (symm-mem all-reduce) bs={b}: {ms:.3f} ms, {b / (ms / 1e3):.0f} tok/s")
        del runner
    for t, us in result["all_reduce_us"]["nccl"].items():
        other = result["all_reduce_us"].get("symm-mem", {}).get(t)
        log(f"all-reduce [{t}, {target.cfg.hidden_size}]: nccl {us:.1f} us" + (f", symm-mem {other:.1f} us" if other else ""))

    # What the plan says one GPU holds for this deployment (EAGLE-3 chain, the measured batches).
    gpu = GPUS["h200"] if cuda else custom_gpu(64)
    plan = plan_from_configs(target_config, draft_config, SpecSettings("EAGLE3", 3, 1, 4), gpu,
                             Limits(max(batches), context + 64, max(batches)), gpus_per_node=args.tp,
                             tensor_parallel_size=args.tp)
    result["memory"] = {
        "weights_target": {"held": weights["target"], "plan": plan.target.weight_bytes_per_gpu},
        "weights_draft": {"held": weights["draft"], "plan": plan.draft.weight_bytes_per_gpu},
        "kv_per_token_target": {"held": kv_per_token, "plan": plan.target.kv_cache_bytes_per_token_per_gpu},
        "reserved_after_graphs": graph_pool,
        "plan_cuda_graph_pool_bytes": plan.memory_per_gpu.cuda_graph_pool_bytes,
    }
    for key in ("weights_target", "weights_draft", "kv_per_token_target"):
        m = result["memory"][key]
        log(f"{key}: held {m['held'] / 2**20:.1f} MiB, plan {m['plan'] / 2**20:.1f} MiB")
    parallel.destroy_tp()
    return result if rank == 0 else None


def _worker(rank: int, args, init_method: str) -> None:
    bench_rank(rank, args, init_method)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--smoke", action="store_true", help="tiny model, gloo on CPU")
    parser.add_argument("--out", default="/tmp/tp_bench.json")
    args = parser.parse_args()
    if not args.smoke and torch.cuda.device_count() < args.tp:
        print(f"needs {args.tp} GPUs, sees {torch.cuda.device_count()}", file=sys.stderr)
        return 2
    from specdeploy.engine.runtime import distributed

    init_method = distributed.free_init_method()
    workers = distributed.Workers(_worker, args.tp, lambda rank: (args, init_method))
    result = bench_rank(0, args, init_method)
    workers.stop(timeout_s=120)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    say(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
