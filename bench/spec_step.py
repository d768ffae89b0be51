"""Section 3: the cost of one speculative step, by phase, as a multiple of one target decode step.

The engine's Runner runs real speculative steps (draft -> tree -> verify -> accept -> draft
extend -> commit) on random-weight models in three modes:

    fused     the engine's default: the whole iteration is one CUDA graph (one launch, one sync)
    split     one CUDA graph per model call, tree building and acceptance eager in between
    off       no graphs

A fused step is timed whole. In the split and eager modes CUDA events around each model call
split the step (harness.instrument):

    draft     calls.draft_multi_step: the draft head's num_steps x topk candidates
    verify    calls.target_verify: the target over the tree, logits and features
    extend    calls.draft_extend: the draft over the accepted tokens with the target's features
    overhead  the rest of the step: tree building, acceptance, slot bookkeeping, host syncs

Configurations: chain (steps 3, topk 1, draft tokens 4) and tree (steps 3, topk 4, draft tokens
8), and section 5's deeper tree (steps 5, topk 4, draft tokens 16; fused only, no goal); EAGLE
and EAGLE-3 heads on the Llama-3.1-8B shape (hc_mult 1); EAGLE and MTP heads on the same shape
with hc_mult 4 (EAGLE-3 is defined for hc_mult 1 only). Batch 1, 1K context.

"One target decode step" is the Runner's own plain-decode step in the same graph mode (what a
target-only request pays per token); the bare graphed decode call is shown beside it. Goals
(chain <= 1.35x, tree <= 1.6x) are judged on the fused mode against the graphed decode step.
"""

from __future__ import annotations

import statistics

import torch

from common import free_device_memory, log, time_ms
from harness import (EngineDecode, eagle3_head_config, eagle_head_config, mtp_head_config, profile_top,
                     random_head, random_target, runner_decode_ms, timed_steps, use_fast_attention)
from specdeploy.engine.planner.plan import PREFILL_CHUNK_TOKENS
from specdeploy.engine.runtime.runner import Request, Runner
from specdeploy.engine.planner.plan import SpecSettings

SHAPES = {"chain": (3, 1, 4), "tree": (3, 4, 8), "tree-deep": (5, 4, 16)}
GOALS = {"chain": 1.35, "tree": 1.6}
# The deeper tree of section 5 (no goal of its own): measured fused only, for the projection of
# section 5's acceptance onto this shape.
FUSED_ONLY = {"tree-deep"}


# mode -> (Runner graph_mode on CUDA, on CPU (graphs' static buffers, no capture), fused step)
MODES = {"fused": ("capture", "padded", True), "split": ("capture", "padded", False),
         "off": ("off", "off", True)}


def spec_step_phases(target, head, shape: str, batch: int, context: int, steps: int, warmup: int,
                     device, mode: str, profile: bool = False) -> dict:
    num_steps, topk, num_draft = SHAPES[shape]
    cuda_mode, cpu_mode, fused = MODES[mode]
    graph_mode = cuda_mode if device.type == "cuda" else cpu_mode
    # + the profiled steps, + the steps in which requests prefilled first decode while the later
    # ones prefill (a chunk of PREFILL_CHUNK_TOKENS per step)
    max_new = (steps + warmup + 6 + -(-batch * context // PREFILL_CHUNK_TOKENS)) * (num_draft + 1)
    scratch = (num_steps - 1) * topk + num_draft
    runner = Runner(target, head, SpecSettings(head.algorithm, num_steps, topk, num_draft),
                    max_total_tokens=batch * (context + max_new + scratch + 2) + 8,
                    max_running_requests=batch, context_length=context + max_new + num_steps + 8,
                    device=device, cuda_graph_batch_sizes=(batch,), graph_mode=graph_mode,
                    fused_spec_step=fused)
    gen = torch.Generator().manual_seed(11)
    for i in range(batch):
        prompt = torch.randint(3, target.cfg.vocab_size, (context,), generator=gen).tolist()
        runner.add(Request(f"r{i}", prompt, max_tokens=max_new))
    runner.step()  # prefill + draft extend over the prompt, a chunk of prefill_chunk_tokens per step
    while runner.num_prefilling:
        runner.step()
    # A fused step has no phases to mark: it is timed whole.
    split = not (fused and graph_mode != "off")
    recs = timed_steps(runner, steps, warmup, device, instrumented=split)
    if not recs:
        raise RuntimeError("no timed speculative step (a request finished during warm-up)")
    prof = profile_top(runner.step, device, reps=3, top=16) if profile else None
    keys = ("whole_ms", "draft_ms", "verify_ms", "extend_ms", "overhead_ms", "tree_ms", "accept_ms", "decode_ms")
    out = {k: statistics.median(r[k] for r in recs) if k in recs[0] else None for k in keys}
    out["steps_timed"] = len(recs)
    out["accept_length"] = sum(r["tokens"] for r in recs) / (len(recs) * batch)
    if prof is not None:
        out["profile"] = prof
    return out


def _graph_call_ms(target, batch, context, ctx) -> float:
    call = EngineDecode(target, batch, context, graph=True)
    ms = time_ms(call, ctx.device, warmup=ctx["warmup"], reps=ctx["reps"])["median_ms"]
    del call
    free_device_memory()
    return ms


def run(ctx) -> dict:
    backend = use_fast_attention() if ctx.device.type == "cuda" else "reference"
    batch, context = ctx["spec_batch"], ctx["context"]
    rows = []
    targets = [("hc1", ctx["target_config"], ("EAGLE", "EAGLE3")),
               ("hc4", ctx["hc4_config"], ("EAGLE", "MTP"))]
    # Without CUDA the graphs' static-buffer path runs eagerly (code exercised, not timed).
    modes = tuple(MODES)
    base_modes = {"fused": "capture" if ctx.device.type == "cuda" else "padded", "off": "off"}
    for label, config, algorithms in targets:
        target = ctx.target() if label == "hc1" else random_target(config, ctx.device, ctx.dtype, seed=5)
        base = {m: runner_decode_ms(target, batch, context, ctx["runner_steps"], ctx["runner_warmup"],
                                    ctx.device, gm) for m, gm in base_modes.items()}
        base["split"] = base["fused"]  # plain decode has one graph either way
        call_ms = _graph_call_ms(target, batch, context, ctx)
        log(f"{label}: target decode: Runner.step " + ", ".join(f"{m} {v:.2f} ms" for m, v in base.items())
            + f"; graphed call {call_ms:.2f} ms")
        for algorithm in algorithms:
            if algorithm == "EAGLE":
                head_config = eagle_head_config(config)
            elif algorithm == "EAGLE3":
                head_config = eagle3_head_config(config, ctx["eagle3_draft_vocab"])
            else:
                head_config = mtp_head_config(config)
            head = random_head(algorithm, head_config, target)
            for shape in SHAPES:
                for mode in (("fused",) if shape in FUSED_ONLY else modes):
                    row = {"target": label, "hc_mult": target.cfg.hc_mult, "algorithm": algorithm,
                           "shape": shape, "graph_mode": mode, "num_steps": SHAPES[shape][0],
                           "topk": SHAPES[shape][1], "num_draft_tokens": SHAPES[shape][2], "batch": batch,
                           "context": context, "target_layers": target.cfg.num_layers,
                           "target_hidden": target.cfg.hidden_size,
                           "decode_step_ms": base[mode], "graph_call_ms": call_ms}
                    try:
                        # Profiles: the first head's chain step, fused and split.
                        first = label == "hc1" and algorithm == algorithms[0] and shape == "chain" \
                            and mode != "off"
                        row.update(spec_step_phases(target, head, shape, batch, context, ctx["spec_steps"],
                                                    ctx["spec_warmup"], ctx.device, mode, profile=first))
                    except Exception as e:  # one configuration failing leaves the others standing
                        row["error"] = f"{type(e).__name__}: {e}"[:500]
                        log(f"{label} {algorithm} {shape} {mode} failed: {row['error']}")
                        rows.append(row)
                        free_device_memory()
                        continue
                    row["x_decode_step"] = row["whole_ms"] / base[mode]
                    row["x_graph_call"] = row["whole_ms"] / call_ms
                    row["goal"] = GOALS.get(shape)
                    row["goal_met"] = (row["x_decode_step"] <= GOALS[shape]
                                       if mode == modes[0] and shape in GOALS else None)
                    phases = "" if row["draft_ms"] is None else (
                        f" | draft {row['draft_ms']:.2f} verify {row['verify_ms']:.2f} extend {row['extend_ms']:.2f} "
                        f"overhead {row['overhead_ms']:.2f} (tree {row['tree_ms']:.2f}, accept {row['accept_ms']:.2f})")
                    log(f"{label} {algorithm:<6} {shape:<5} {mode:<7} step {row['whole_ms']:.2f} ms = "
                        f"{row['x_decode_step']:.2f}x decode step ({row['x_graph_call']:.2f}x graphed call)" + phases)
                    rows.append(row)
                    free_device_memory()
            del head
            free_device_memory()
        del target
        free_device_memory()
    ok = [r for r in rows if "whole_ms" in r and r["graph_mode"] == modes[0]]
    summary = [f"{r['target']} {r['algorithm']} {r['shape']} {r['x_decode_step']:.2f}x" for r in ok]
    summary.append("goals chain<=1.35x tree<=1.6x")
    return {"attention_backend": backend, "rows": rows, "goals": GOALS, "summary": summary}
