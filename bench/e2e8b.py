"""Section 7: end to end at the 8B cost, and speculation that never loses.

Section 5's trained target (55 M parameters) and EAGLE head are launch-bound: a step of them
costs kernel launches, not bytes, so their speed-up says little about an 8B deployment. Here the
same trained pair is embedded exactly into Llama-3.1-8B-shaped models (engine/demo/embed.py:
zero-padded width, extra query and KV heads, extra layers whose output projections are zero,
RMSNorm weights and eps rescaled for the padded width, the vocabulary padded to 128256 with
zero rows): the function is the small model's, every step reads the 8B's 15 GB. Measured:

  1. parity: the embedded target's logits against the small target's on held-out text (bf16),
     and how often every real logit is below the padded tokens' exact 0 (greedy would leave the
     small vocabulary there; expected never);
  2. batch 1, end to end (prefill + decode per request, held-out prompts, greedy): engine
     target-only, EAGLE chain (3,1,4), tree (3,4,8) and deep tree (5,4,16), adaptive speculation
     (choosing among no speculation, chains of 1-5 steps and both trees), and transformers
     (eager, and static cache with its own torch.compile) on the same embedded weights;
  3. the batch sweep: target-only, the fixed chain and tree, and adaptive speculation at batch
     1..64 on one runner each (graphs captured for every bucket), decode tokens per second of
     whole batches (after every request's first token; best of two runs) and end to end; the
     crossover batch of each fixed shape (the smallest batch at which it decodes slower than
     target-only) and adaptive / target-only at every batch.

With `--sections 5,7` the pair is section 5's; alone, this section trains one the same way.
"""

from __future__ import annotations

import time

import torch

import acceptance
import hf_baseline
from common import free_device_memory, log, sync
from harness import use_fast_attention
from specdeploy.engine.demo import embed
from specdeploy.engine.models import attention as attention_mod
from specdeploy.engine.models.llama import default_dtype
from specdeploy.engine.runtime.runner import Request, Runner
from specdeploy.engine.planner.plan import SpecSettings
from specdeploy.engine.speculative.adaptive import SpecShape

SIZES = {
    "device": {"shape": embed.LLAMA_31_8B_SHAPE, "batches": (1, 2, 4, 8, 16, 32, 64), "repeats": 3,
               "sweep_new_tokens": 64, "sweep_repeats": 3, "hf_compile": True, "parity_windows": 4, "parity_len": 256},
    # A small "big" shape for CPU: every dimension of section 5's smoke target grows.
    "smoke": {"shape": {"hidden_size": 128, "intermediate_size": 256, "num_layers": 4, "num_heads": 8,
                        "num_kv_heads": 4, "head_dim": 32, "vocab_size": 400},
              "batches": (1, 2), "repeats": 3, "sweep_new_tokens": 6, "sweep_repeats": 3, "hf_compile": False, "parity_windows": 2, "parity_len": 16},
}
SHAPES = {"chain": (3, 1, 4), "tree": (3, 4, 8), "tree-deep": (5, 4, 16)}
# What the adaptive runner may choose: no speculation, chains of 1-5 steps and both trees.
ADAPTIVE_SHAPES = [SpecShape(0)] + [SpecShape(s, 1, s + 1) for s in range(1, 6)] + \
    [SpecShape(*SHAPES["tree"]), SpecShape(*SHAPES["tree-deep"])]


def _pair(ctx, result: dict) -> dict:
    """Section 5's trained pair, or one trained here with section 5's recipe and budgets."""
    if ctx.trained_pair is not None:
        result["trained_in"] = "section 5 of this run"
        return ctx.trained_pair
    s = dict(acceptance.SIZES["smoke" if ctx.smoke else "device"])
    for key in acceptance.BUDGET_KEYS:
        if key in ctx.profile:
            s[key] = ctx.profile[key]
    attention_mod.set_backend("reference")  # training needs autograd through attention
    train_result = {}
    pair = acceptance.train_pair(ctx, s, train_result)
    acceptance.to_inference(pair["target"], ctx.dtype)
    pair["head"].to(ctx.dtype)
    held = pair["held"]
    starts = torch.linspace(0, held.numel() - s["prompt_len"] - 1, s["prompts"] + 1).long().tolist()
    prompts = [held[st:st + s["prompt_len"]].tolist() for st in starts]
    pair.update(warm=prompts[0], prompts=prompts[1:], new_tokens=s["new_tokens"], prompt_len=s["prompt_len"],
                outputs={})
    result["trained_in"] = "the cache" if train_result.get("pair_cache", {}).get("hit") else "this section"
    result["training"] = {k: train_result[k] for k in ("recipe", "target_training", "head_training", "pair_cache")
                          if k in train_result}
    return pair


@torch.no_grad()
def parity(small, big, held: torch.Tensor, windows: int, length: int) -> dict:
    """Logits of the embedded target against the small one's on held-out windows (bf16)."""
    dev = big.embed_tokens.weight.device
    starts = torch.linspace(0, held.numel() - length - 1, windows).long().tolist()
    ids = torch.stack([held[s:s + length] for s in starts]).to(dev)
    small.set_feature(None)
    big.set_feature(None)
    want = hf_baseline.engine_logits(small, ids)                          # [W, T, Vs]
    got = hf_baseline.engine_logits(big, ids)                             # [W, T, Vb]
    vs = want.shape[-1]
    real = got[..., :vs]
    return {"positions": ids.numel(),
            "rel_l2_logits": ((real - want).norm() / want.norm()).item(),
            "argmax_agreement": (real.argmax(-1) == want.argmax(-1)).float().mean().item(),
            "padded_logits_max_abs": got[..., vs:].abs().max().item(),
            "positions_all_real_logits_below_zero": embed.real_logits_below_zero(got, vs)}


def _runner(target, draft, shape, *, batches, context_length: int, device, adaptive: bool = False):
    """A runner for these batch sizes, graphs captured for exactly them (each graph of an 8B
    target takes a while to capture; the adaptive runner captures every shape's)."""
    max_bs = max(batches)
    kw = {"max_total_tokens": max_bs * (context_length + 24), "max_running_requests": max_bs,
          "context_length": context_length, "device": device}
    if device.type == "cuda":
        kw["cuda_graph_batch_sizes"] = tuple(batches)
    if draft is None:
        target.set_feature(None)
        return Runner(target, **kw)
    if adaptive:
        kw["adaptive_shapes"] = ADAPTIVE_SHAPES
    return Runner(target, draft, SpecSettings("EAGLE", *shape), adaptive=adaptive, **kw)


def batch_tok_s(runner: Runner, prompts, new_tokens: int, device, tag: str) -> dict:
    """All prompts admitted at once, stepped to the end: generated tokens over wall time (tok_s),
    and the tokens after every request's first over the time after the last first token
    (decode_tok_s: the prefill, the same work for every configuration, left out)."""
    sync(device)
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        runner.add(Request(f"{tag}{i}", p, max_tokens=new_tokens))
    outputs = {f"{tag}{i}": [] for i in range(len(prompts))}
    steps, t_decode = 0, None
    while runner.num_running:
        for o in runner.step():
            outputs[o.req_id] += o.token_ids
        steps += 1
        if t_decode is None and all(outputs.values()):
            sync(device)
            t_decode = time.perf_counter()
    sync(device)
    t1 = time.perf_counter()
    tokens = sum(len(v) for v in outputs.values())
    decode_tokens = tokens - len(prompts)
    return {"batch": len(prompts), "tokens": tokens, "seconds": t1 - t0, "steps": steps,
            "tok_s": tokens / (t1 - t0), "decode_tok_s": decode_tokens / max(t1 - t_decode, 1e-9),
            "outputs": [outputs[f"{tag}{i}"] for i in range(len(prompts))]}


def median_run(runs: list[dict], key: str = "tok_s") -> dict:
    """The run whose `key` is the median (of an odd count; the lower middle of an even one), with
    every run's figure, the min and the max beside it: headline figures are medians of >= 3 runs."""
    ordered = sorted(runs, key=lambda r: r[key])
    mid = dict(ordered[(len(ordered) - 1) // 2])
    mid.update({f"{key}_runs": [r[key] for r in runs], f"{key}_min": ordered[0][key], f"{key}_max": ordered[-1][key],
                "runs": len(runs)})
    return mid


def _spread(systems: dict, name: str, base: str = "engine target-only") -> list[float] | None:
    """Min and max of a system's speed-up over the baseline, run k against run k."""
    a, b = systems.get(name, {}).get("tok_s_runs"), systems.get(base, {}).get("tok_s_runs")
    if not a or not b:
        return None
    ratios = [x / y for x, y in zip(a, b)]
    return [min(ratios), max(ratios)]


def _sweep_one(name, big, draft, shape, adaptive, z, ctx_len, dev, prompts) -> dict:
    """One configuration over every batch size of the sweep, on one runner."""
    t0 = time.perf_counter()
    runner = _runner(big, draft, shape, batches=z["batches"], context_length=ctx_len, device=dev, adaptive=adaptive)
    build_s = time.perf_counter() - t0
    batch_tok_s(runner, prompts[:1], 8, dev, "w")
    rows = []
    for b in z["batches"]:
        before = _shape_counts(runner)
        # The median of `sweep_repeats` runs, as for every configuration (min and max beside it).
        runs = [batch_tok_s(runner, prompts[:b], z["sweep_new_tokens"], dev, f"b{b}r{k}-")
                for k in range(z["sweep_repeats"])]
        r = median_run(runs, "decode_tok_s")
        r["decode_tok_s_runs"] = [x["decode_tok_s"] for x in runs]
        r.pop("outputs")
        if adaptive:
            after = _shape_counts(runner)
            r["shape_steps"] = {k: after[k] - before.get(k, 0) for k in after if after[k] - before.get(k, 0)}
        rows.append(r)
        log(f"sweep {name:<12} batch {b:<3} {r['tok_s']:9.1f} tok/s, decode {r['decode_tok_s']:9.1f} tok/s"
            + (f"  shapes {r['shape_steps']}" if adaptive else ""))
    out = {"build_s": build_s, "rows": rows}
    if adaptive:
        pol = runner.policy
        out["start_up_costs_ms"] = {f"{s.label}@{b}": 1e3 * c for (s, b), c in pol.base_costs_s.items()}
        out["policy"] = pol.snapshot()
    return out


def _sweep_table(sweep: dict, batches) -> tuple[list[dict], dict]:
    """Per batch: target-only decode tok/s and each configuration's multiple of it (None where a
    configuration failed); the crossover batch of each fixed shape."""
    base = {r["batch"]: r for r in sweep.get("target-only", {}).get("rows", [])}
    table = []
    for b in batches:
        if b not in base:
            continue
        row = {"batch": b, "target_only_tok_s": base[b]["decode_tok_s"], "target_only_e2e_tok_s": base[b]["tok_s"]}
        for name in ("chain", "tree", "adaptive"):
            r = next((x for x in sweep.get(name, {}).get("rows", []) if x["batch"] == b), None)
            row[f"{name}_tok_s"] = r and r["decode_tok_s"]
            row[f"{name}_x"] = r and r["decode_tok_s"] / base[b]["decode_tok_s"]
            row[f"{name}_e2e_x"] = r and r["tok_s"] / base[b]["tok_s"]
            if name == "adaptive":
                row["adaptive_shapes"] = r and r.get("shape_steps")
        table.append(row)
    crossover = {name: next((row["batch"] for row in table if row[f"{name}_x"] is not None and row[f"{name}_x"] < 1.0),
                            None) for name in ("chain", "tree")}
    return table, crossover


def _shape_counts(runner: Runner) -> dict:
    return dict((s.label, n) for s, n in runner.policy.steps_by_shape.items()) if runner.policy else {}


def run(ctx) -> dict:
    z = dict(SIZES["smoke" if ctx.smoke else "device"])
    dev, dtype = ctx.device, ctx.dtype
    result = {"sizes": {k: v for k, v in z.items()}}
    pair = _pair(ctx, result)
    small, small_head = pair["target"], pair["head"]
    prompts, warm, n_new = pair["prompts"], pair["warm"], pair["new_tokens"]

    t0 = time.perf_counter()
    with default_dtype(dtype):
        big = embed.embed_target(small, z["shape"], dtype=dtype, device=dev)
        big_head = embed.embed_eagle_head(small_head, big)
    sync(dev)
    count = sum(p.numel() for p in big.parameters())
    result["embedding"] = {
        "seconds": time.perf_counter() - t0, "shape": z["shape"], "small": {
            k: getattr(small.cfg, k) for k in ("hidden_size", "intermediate_size", "num_layers", "num_heads",
                                                "num_kv_heads", "head_dim", "vocab_size")},
        "target_params": count, "target_weight_bytes": count * big.embed_tokens.weight.element_size(),
        "head_params": sum(p.numel() for p in big_head.parameters()),
        "small_layers_at": embed.layer_positions(small.cfg.num_layers, big.cfg.num_layers)}
    log(f"embedded: {count / 1e9:.2f} B target parameters, {result['embedding']['head_params'] / 1e6:.0f} M head, "
        f"{result['embedding']['seconds']:.1f} s")
    result["parity"] = parity(small, big, pair["held"], z["parity_windows"], z["parity_len"])
    log(f"parity: logits rel L2 {result['parity']['rel_l2_logits']:.2e}, argmax agrees "
        f"{100 * result['parity']['argmax_agreement']:.1f}%, all real logits < 0 at "
        f"{result['parity']['positions_all_real_logits_below_zero']} positions")
    ctx.partial(result)

    result["attention_backend"] = use_fast_attention() if dev.type == "cuda" else "reference"
    ctx_len = pair["prompt_len"] + max(n_new, z["sweep_new_tokens"]) + 32

    # Batch 1, end to end, on the prompts section 5 used.
    systems = {}
    for name, draft, shape, adaptive in [("engine target-only", None, None, False),
                                         ("engine EAGLE chain", big_head, SHAPES["chain"], False),
                                         ("engine EAGLE tree", big_head, SHAPES["tree"], False),
                                         ("engine EAGLE tree-deep", big_head, SHAPES["tree-deep"], False),
                                         ("engine EAGLE adaptive", big_head, SHAPES["tree-deep"], True)]:
        try:
            runner = _runner(big, draft, shape, batches=(1,), context_length=ctx_len, device=dev, adaptive=adaptive)
            acceptance.engine_generate(runner, [warm], n_new, dev, "w")
            r = systems[name] = median_run([acceptance.engine_generate(runner, prompts, n_new, dev, f"p{k}-")
                                            for k in range(z["repeats"])])
        except Exception as e:  # target-only is the baseline of everything: its failure ends the section
            if draft is None:
                raise
            result.setdefault("errors", {})[name] = f"{type(e).__name__}: {e}"[:500]
            log(f"{name}: FAILED {result['errors'][name][:200]}")
            continue
        if adaptive:
            r["shape_steps"] = _shape_counts(runner)
        log(f"{name:<28} {r['tok_s']:8.1f} tok/s  accept length {r['accept_length']:.2f}")
        del runner
        free_device_memory()
        ctx.partial({**result, "batch1_so_far": {k: v["tok_s"] for k, v in systems.items()}})

    # The batch sweep: one runner per configuration, every batch size on it.
    held = pair["held"]
    max_bs = max(z["batches"])
    plen = pair["prompt_len"]
    starts = torch.linspace(0, held.numel() - plen - 1, max_bs + 1).long().tolist()[1:]
    sweep_prompts = [held[st:st + plen].tolist() for st in starts]
    sweep = {}
    for name, draft, shape, adaptive in [("target-only", None, None, False),
                                         ("chain", big_head, SHAPES["chain"], False),
                                         ("tree", big_head, SHAPES["tree"], False),
                                         ("adaptive", big_head, SHAPES["tree-deep"], True)]:
        try:
            sweep[name] = _sweep_one(name, big, draft, shape, adaptive, z, ctx_len, dev, sweep_prompts)
        except Exception as e:  # one configuration's failure (say, out of memory) costs its column only
            sweep[name] = {"error": f"{type(e).__name__}: {e}"[:500]}
            log(f"sweep {name}: FAILED {sweep[name]['error'][:200]}")
        free_device_memory()
        ctx.partial({**result, "sweep_so_far": sweep})

    sweep_table, crossover = _sweep_table(sweep, z["batches"])
    result.update(sweep=sweep, sweep_table=sweep_table, crossover_batch=crossover)

    # transformers on the same embedded weights (the slowest rows: last; a failure there costs
    # only its rows, not the engine's figures above).
    ctx.partial({**result, "batch1_so_far": {k: v["tok_s"] for k, v in systems.items()}})
    hf = None
    try:
        hf = hf_baseline.build_hf_llama(embed.config_json(big.cfg), dev, dtype, engine_target=big)
        hf.generation_config.eos_token_id = None
        result["hf_parity"] = hf_baseline.parity(big, hf, small.cfg.vocab_size)
        acceptance.hf_generate(hf, [warm], n_new, dev)
        systems["transformers"] = acceptance.hf_generate(hf, prompts, n_new, dev)
        log(f"{'transformers':<28} {systems['transformers']['tok_s']:8.1f} tok/s")
    except Exception as e:
        result["hf_error"] = f"{type(e).__name__}: {e}"[:500]
        log(f"transformers: FAILED {result['hf_error'][:200]}")
    if (hf is not None and "transformers" in systems and z["hf_compile"] and ctx.profile.get("hf_compile", True)
            and dev.type == "cuda"):
        hf.generation_config.cache_implementation = "static"
        hf.generation_config.disable_compile = False
        t0 = time.perf_counter()
        try:
            acceptance.hf_generate(hf, [warm], n_new, dev)
            systems["transformers static + compile"] = acceptance.hf_generate(hf, prompts, n_new, dev)
            systems["transformers static + compile"]["wall_s_including_compile"] = time.perf_counter() - t0
            log(f"{'transformers static + compile':<28} {systems['transformers static + compile']['tok_s']:8.1f} tok/s")
        except Exception as e:  # a compile failure is a table cell, not a lost section
            result["hf_compile_error"] = f"{type(e).__name__}: {e}"[:500]
    del hf
    free_device_memory()

    small_outputs = pair.get("outputs", {})
    table = []
    hf_tok_s = systems["transformers"]["tok_s"] if "transformers" in systems else None
    best_hf = max((v["tok_s"] for k, v in systems.items() if k.startswith("transformers")), default=None)
    for name, r in systems.items():
        row = {"system": name, "tok_s": r["tok_s"], "tokens": r["tokens"], "seconds": r["seconds"],
               "tok_s_min": r.get("tok_s_min"), "tok_s_max": r.get("tok_s_max"), "runs": r.get("runs", 1),
               "speedup_vs_engine_target_only": r["tok_s"] / systems["engine target-only"]["tok_s"],
               "speedup_vs_transformers": r["tok_s"] / hf_tok_s if hf_tok_s else None,
               "speedup_vs_best_transformers": r["tok_s"] / best_hf if best_hf else None,
               "same_output_as_engine_target_only": acceptance._agreement(
                   r["outputs"], systems["engine target-only"]["outputs"]),
               "same_output_as_small_target": acceptance._agreement(
                   r["outputs"], small_outputs["engine target-only"]) if "engine target-only" in small_outputs else None}
        if "accept_length" in r and name != "engine target-only":
            row["accept_length"] = r["accept_length"]
        if "shape_steps" in r:
            row["shape_steps"] = r["shape_steps"]
        if "wall_s_including_compile" in r:
            row["wall_s_including_compile"] = r["wall_s_including_compile"]
        table.append(row)
    spec_rows = [row for row in table if row["system"].startswith("engine EAGLE")]
    nothing = {"system": "none ran", "speedup_vs_engine_target_only": 0.0}
    best = max(spec_rows, key=lambda row: row["tok_s"], default=nothing)
    adaptive_b1 = next((row for row in table if row["system"] == "engine EAGLE adaptive"), nothing)
    measured = [row for row in sweep_table if row["adaptive_x"] is not None]
    worst = min(measured, key=lambda row: row["adaptive_x"]) if measured else {"adaptive_x": 0.0, "batch": None}
    result.update({
        "prompts": len(prompts), "prompt_len": pair["prompt_len"], "new_tokens": n_new, "rows": table,
        "goals": [
            {"metric": "best speculative vs engine target-only, batch 1, 8B cost, end to end", "target": 2.5,
             "value": best["speedup_vs_engine_target_only"], "system": best["system"],
             "range": _spread(systems, best["system"]), "runs": z["repeats"],
             "met": best["speedup_vs_engine_target_only"] >= 2.5},
            {"metric": "adaptive vs engine target-only, batch 1, 8B cost", "target": 2.0,
             "value": adaptive_b1["speedup_vs_engine_target_only"],
             "range": _spread(systems, "engine EAGLE adaptive"), "runs": z["repeats"],
             "met": adaptive_b1["speedup_vs_engine_target_only"] >= 2.0},
            {"metric": f"adaptive vs target-only decode, worst batch of {z['batches'][0]}-{z['batches'][-1]}",
             "target": 1.0, "value": worst["adaptive_x"], "batch": worst["batch"], "runs": z["sweep_repeats"],
             "met": worst["adaptive_x"] >= 1.0}],
        "summary": [f"{row['system'].replace('engine ', '')} {row['tok_s']:.0f} tok/s"
                    + (f" acc {row['accept_length']:.2f}" if "accept_length" in row else "") for row in table]
                   + [f"best {best['speedup_vs_engine_target_only']:.2f}x at batch 1 (goal 2.5x)",
                      f"adaptive/target-only min {worst['adaptive_x']:.2f}x (batch {worst['batch']})",
                      f"crossover chain {crossover['chain']} tree {crossover['tree']}"],
    })
    del big, big_head
    free_device_memory()
    return result
