"""Section 2: target-only decode on the Llama-3.1-8B shape (random bf16 weights made on the
device), batch 1/4/16/64 at a 1K context, against the HBM roofline and against transformers
generate() eager and static-cache compiled, on the same weights in the same run:

  engine call    GraphedCalls.target_decode: the engine's CUDA graph of the target forward +
                 float32 logits (inputs copied into its static buffers, one replay)
  engine step    Runner.step() in plain decode with its graphs: the call plus the per-step
                 bookkeeping (slots, index tensors, argmax, host sync): what a request sees

Should the engine's graphs fail, the call falls back to the engine's forward captured here
(harness.TargetStep) and the JSON says so.
"""

from __future__ import annotations

import hf_baseline
from common import free_device_memory, log, time_ms
from harness import (EngineDecode, TargetStep, decode_runner, profile_top, runner_decode_ms,
                     use_fast_attention)
from roofline import roofline_rows


def _decode_call(target, b, context):
    """-> (callable, source): the engine's graphed decode call, or the fallback."""
    try:
        return EngineDecode(target, b, context, graph=True), "engine GraphedCalls.target_decode"
    except Exception as e:  # the engine's graphs failing must not cost the roofline comparison
        log(f"engine graphs failed at bs={b} ({type(e).__name__}: {e}); bench-captured forward instead")
        step = TargetStep(target, b, context)
        step.capture()
        return step.replay, f"bench-captured engine forward (GraphedCalls failed: {type(e).__name__}: {e})"[:300]


def run(ctx) -> dict:
    backend = use_fast_attention() if ctx.device.type == "cuda" else "reference"
    target = ctx.target()
    bandwidth = ctx.bandwidth()
    roof = {r["batch"]: r for r in roofline_rows(target, bandwidth, None, ctx["batches"], ctx["context"])}
    ours = []
    for b in ctx["batches"]:
        call, source = _decode_call(target, b, ctx["context"])
        t = time_ms(call, ctx.device, warmup=ctx["warmup"], reps=ctx["reps"])
        del call
        free_device_memory()
        r = roof[b]
        row = {"batch": b, "context": ctx["context"], "source": source, **t,
               "tok_s": b / (t["median_ms"] / 1e3),
               "roofline_tok_s": r["roofline_tok_s"],
               "achieved_bytes_per_s": r["bytes_per_step"] / (t["median_ms"] / 1e3)}
        row["fraction_of_roofline"] = row["tok_s"] / r["roofline_tok_s"]
        try:
            step_ms = runner_decode_ms(target, b, ctx["context"], ctx["runner_steps"], ctx["runner_warmup"],
                                       ctx.device, "capture" if ctx.device.type == "cuda" else "padded")
            row.update(runner_step_ms=step_ms, runner_tok_s=b / (step_ms / 1e3),
                       runner_fraction_of_roofline=b / (step_ms / 1e3) / r["roofline_tok_s"])
        except Exception as e:  # the call's figure stands alone
            row["runner_error"] = f"{type(e).__name__}: {e}"[:300]
        log(f"engine decode bs={b:<3} call {row['tok_s']:8.1f} tok/s ({t['median_ms']:.3f} ms, "
            f"{100 * row['fraction_of_roofline']:.1f}% of roofline {r['roofline_tok_s']:.0f}) | Runner.step "
            f"{row.get('runner_tok_s', float('nan')):8.1f} tok/s ({row.get('runner_step_ms', float('nan')):.3f} ms)")
        ours.append(row)
        free_device_memory()

    # Which kernels the batch-1 decode step spends its time in (eager, so each launch is named).
    eager_b1 = EngineDecode(target, ctx["batches"][0], ctx["context"], graph=False)
    profile = profile_top(eager_b1, ctx.device)
    del eager_b1
    free_device_memory()
    # Where the graphed Runner step spends host time beyond the graph replay (by host time).
    try:
        runner = decode_runner(target, ctx["batches"][0], ctx["context"], 16, ctx.device,
                               "capture" if ctx.device.type == "cuda" else "padded")
        runner_profile = profile_top(runner.step, ctx.device, reps=5, by="host")
        del runner
    except Exception as e:  # evidence, not a result
        runner_profile = {"error": f"{type(e).__name__}: {e}"[:300]}
    free_device_memory()
    ctx.partial({"attention_backend": backend, "bandwidth_bytes_per_s": bandwidth, "ours": ours,
                 "profile_bs1_eager_call": profile, "profile_bs1_runner_step": runner_profile,
                 "transformers": {}, "summary": []})
    hf = {}
    try:
        model = hf_baseline.build_hf_llama(ctx["target_config"], ctx.device, ctx.dtype, engine_target=target)
        # As long as the benchmark's context: rotary errors grow with the position.
        hf["parity"] = hf_baseline.parity(target, model, target.cfg.vocab_size, length=ctx["context"])
        log(f"engine vs transformers logits, same weights: rel L2 {hf['parity']['rel_l2_logits']:.2e}, "
            f"argmax agreement {100 * hf['parity']['argmax_agreement']:.0f}%")
        hf.update(hf_baseline.run(model, ctx.device, batches=ctx.profile.get("hf_batches", ctx["batches"]),
                                  compiled_batches=ctx["hf_compiled_batches"], context=ctx["context"],
                                  new_tokens=ctx["hf_new_tokens"], repeats=ctx["hf_repeats"],
                                  compile=ctx["hf_compile"]))
        del model
    except Exception as e:  # the engine's figures stand without the baseline
        hf["error"] = f"{type(e).__name__}: {e}"[:1000]
        log(f"transformers baseline failed: {hf['error']}")
    free_device_memory()

    b1 = ours[0]
    summary = [f"bs{b1['batch']} call {b1['tok_s']:.0f} tok/s = {100 * b1['fraction_of_roofline']:.0f}% roofline"
               f", Runner.step {b1.get('runner_tok_s', float('nan')):.0f} tok/s (goal >= 90%)"]
    for name in ("eager", "static_compiled"):
        first = next((r for r in hf.get(name, []) if "tok_s" in r), None)
        if first:
            summary.append(f"HF {name} bs{first['batch']} {first['tok_s']:.0f}")
    return {
        "attention_backend": backend,
        "bandwidth_bytes_per_s": bandwidth,
        "ours": ours,
        "profile_bs1_eager_call": profile,
        "profile_bs1_runner_step": runner_profile,
        "transformers": hf,
        "goal": {"metric": "engine decode call tok/s over the HBM roofline at batch 1", "target": 0.9,
                 "value": b1["fraction_of_roofline"], "met": b1["fraction_of_roofline"] >= 0.9},
        "summary": summary,
    }
