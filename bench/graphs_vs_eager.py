"""Section 4: CUDA graphs against eager at batch 1 and 16, on the 8B shape at a 1K context.

The same decode step four ways: the engine's decode call eager (ModelCalls.target_decode) and
graphed (GraphedCalls.target_decode: inputs copied into static buffers, one graph replay); and the
whole Runner.step() in plain decode with graph_mode "off" and "capture" (adding its per-step
bookkeeping: slot allocation, index tensors, sampling, host syncs). The graph's logits are
compared with eager's on the same inputs.
"""

from __future__ import annotations

from common import free_device_memory, log, time_ms
from harness import EngineDecode, runner_decode_ms, use_fast_attention


def run(ctx) -> dict:
    backend = use_fast_attention() if ctx.device.type == "cuda" else "reference"
    target = ctx.target()
    rows = []
    for b in ctx["graph_batches"]:
        eager_call = EngineDecode(target, b, ctx["context"], graph=False)
        eager = time_ms(eager_call, ctx.device, warmup=ctx["warmup"], reps=ctx["reps"])
        eager_logits = eager_call.out.clone()
        graph_call = EngineDecode(target, b, ctx["context"], graph=True, share=eager_call)
        graph = time_ms(graph_call, ctx.device, warmup=ctx["warmup"], reps=ctx["reps"])
        same = (graph_call.out.argmax(-1) == eager_logits.argmax(-1)).float().mean().item()
        rel = ((graph_call.out.float() - eager_logits.float()).norm() / eager_logits.float().norm()).item()
        del eager_call, graph_call
        free_device_memory()
        # Without CUDA, "padded" runs the graphs' static-buffer path eagerly (code exercised only).
        graph_mode = "capture" if ctx.device.type == "cuda" else "padded"
        runner = {mode: runner_decode_ms(target, b, ctx["context"], ctx["runner_steps"], ctx["runner_warmup"],
                                         ctx.device, mode) for mode in ("off", graph_mode)}
        runner["capture"] = runner.pop(graph_mode)
        row = {"batch": b, "context": ctx["context"], "graph_captured": ctx.device.type == "cuda",
               "eager_call_ms": eager["median_ms"], "graph_call_ms": graph["median_ms"],
               "runner_eager_ms": runner["off"], "runner_graph_ms": runner["capture"],
               "speedup_call": eager["median_ms"] / graph["median_ms"],
               "speedup_runner": runner["off"] / runner["capture"],
               "graph_argmax_equals_eager": same, "graph_vs_eager_rel_l2": rel,
               "eager_call": eager, "graph_call": graph}
        log(f"bs={b:<3} decode call: eager {eager['median_ms']:.2f} ms, graph {graph['median_ms']:.2f} ms "
            f"({row['speedup_call']:.2f}x) | Runner.step: off {runner['off']:.2f} ms, capture "
            f"{runner['capture']:.2f} ms ({row['speedup_runner']:.2f}x) | graph argmax = eager {100 * same:.0f}%")
        rows.append(row)
        free_device_memory()
    b1 = rows[0]
    return {
        "attention_backend": backend,
        "rows": rows,
        "goal": {"metric": "graph vs eager decode call at batch 1", "target": 3.0,
                 "value": b1["speedup_call"], "met": b1["speedup_call"] >= 3.0},
        "summary": [f"bs{r['batch']} call {r['speedup_call']:.1f}x, runner {r['speedup_runner']:.1f}x"
                    for r in rows] + ["goal bs1 >= 3x"],
    }
