"""Turn the suite's JSON into docs/benchmarks.md (tables always; PNG figures where matplotlib is
installed).

    python3 bench/report.py RESULTS_DIR [RESULTS_DIR ...] [--out docs/benchmarks.md]

Each RESULTS_DIR is one `bench/run.py --out` folder (env.json + <n>_<name>.json). When a section appears
in several folders, the later folder wins. Nothing here measures anything: every figure comes
from the JSON, and a section that failed is shown with its error. The merged records are kept
beside the page (docs/benchmarks/results.json), the figures too (docs/benchmarks/*.png).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

GB = 1e9
GIB = 1024 ** 3

HOW_TO_READ = """\
**How to read these numbers.** Every time is a median over repeated runs, taken with CUDA events
after warm-up (wall clock around a device sync for whole Runner steps and whole requests).
Sections 1-4 and 6 use random bf16 weights of the stated shapes, made on the device: speed and
memory depend on shapes, not on weight values, and nothing is downloaded. The *roofline* is the
fastest a memory-bound decode step can be: the bytes it must read (every weight once, plus each
request's KV prefix) over the copy bandwidth measured in the same run. The *engine call* is the
graphed target forward alone; the *Runner step* adds what serving costs per step (slot
bookkeeping, sampling, a host sync) and is what a request sees. A speculative step is given as a
multiple of the Runner's target-only decode step in the same graph mode. Both steps include host
work, and the lent machines' hosts differ: figures within one run compare with each other, across
runs a step multiple moves by up to about 0.15x (the notes under each section say which run and
code a table comes from). Speculation gains
roughly acceptance length / that multiple, so the multiple is the price and the acceptance
length (tokens emitted per target forward, 1 = no draft token accepted) is what buys it back.
Planner ratios are measured over predicted bytes: 1.00 is exact, above 1 the plan undercounts.
"""


def load(dirs: list[Path]) -> tuple[dict, list[dict]]:
    sections, envs = {}, []
    for d in dirs:
        env = d / "env.json"
        if env.is_file():
            envs.append(json.loads(env.read_text()))
        for path in sorted(d.glob("[0-9]_*.json")):
            rec = json.loads(path.read_text())
            sections[rec["section"]] = rec
    return sections, envs


def _f(x, digits=1, scale=1.0, suffix=""):
    if x is None:
        return "—"
    try:
        return f"{x / scale:.{digits}f}{suffix}"
    except (TypeError, ValueError):
        return str(x)


def _pct(x):
    return "—" if x is None else f"{100 * x:.0f}%"


def _table(headers: list[str], rows: list[list]) -> str:
    out = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(out)


def _met(flag) -> str:
    return "—" if flag is None else ("met" if flag else "**missed**")


def _header(rec: dict) -> str:
    lines = [f"## {rec['section']}. {rec['title']}", ""]
    lines.append(f"Reproduce: `{rec.get('command', '')}` (status **{rec['status']}**, "
                 f"{rec.get('duration_s', 0):.0f} s)")
    if rec["status"] != "ok":
        error = rec.get("error", "")
        lines += ["", f"> Error: `{error}`"] if "\n" not in error else ["", "Error:", "", "```", error, "```"]
    # Provenance notes added when records of several runs are merged by hand.
    for note in rec.get("provenance", []):
        lines += ["", f"> {note}"]
    return "\n".join(lines) + "\n"


# ---- sections --------------------------------------------------------------------------------

def s1(r: dict) -> str:
    lines = [
        f"Copy bandwidth {r['copy_bandwidth_bytes_per_s'] / 1e12:.2f} TB/s (read + write, 4 GiB buffers); "
        f"bf16 matrix product {r['matmul_flops_per_s'] / 1e12:.0f} TFLOP/s ({r['matmul_n']}³). "
        f"Weights {r['weight_bytes'] / GB:.2f} GB ({r['num_params'] / 1e9:.2f} B parameters), of which a "
        f"decode step reads {r['weight_bytes_read_per_step'] / GB:.2f} GB (the embedding table is looked up, "
        f"not read whole); KV {r['kv_bytes_per_token'] / 1024:.0f} KiB per token.", ""]
    lines.append(_table(["batch", "context", "bytes / step", "memory floor", "compute floor", "bound",
                         "roofline tok/s"],
                        [[x["batch"], x["context"], _f(x["bytes_per_step"], 2, GB, " GB"),
                          _f(x["memory_floor_ms"], 3, 1, " ms"), _f(x.get("compute_floor_ms"), 3, 1, " ms"),
                          x.get("bound", "—"), _f(x["roofline_tok_s"], 0)] for x in r["rows"]]))
    return "\n".join(lines)


def _overlap_lines(r: dict) -> list[str]:
    """Runner.step with overlap on and off against the runner's own step graph and the call."""
    rows = []
    for x in r["ours"]:
        g = x.get("runner")
        if g:
            rows.append([f"plain bs{x['batch']}", _f(g.get("graph_ms"), 3), _f(g["step_ms_overlap_on"], 3),
                         _f(g.get("step_ms_overlap_off"), 3), _f(g.get("step_ms_overlap_launch"), 3),
                         _f(g.get("gap_pct_overlap_on_vs_graph"), 1, 1, "%"),
                         _f(g.get("gap_pct_overlap_off_vs_graph"), 1, 1, "%"),
                         _f(g.get("gap_pct_overlap_launch_vs_graph"), 1, 1, "%"),
                         _f(g.get("gap_pct_overlap_on_vs_call"), 1, 1, "%"), _pct(g.get("overlapped_steps_on"))])
    for x in r.get("spec_overlap", []):
        if "step_ms_overlap_on" in x:
            rows.append([f"EAGLE {x['shape']} {tuple(x['steps_topk_draft'])} bs{x['batch']}", _f(x.get("graph_ms"), 3),
                         _f(x["step_ms_overlap_on"], 3), _f(x.get("step_ms_overlap_off"), 3),
                         _f(x.get("step_ms_overlap_launch"), 3),
                         _f(x.get("gap_pct_overlap_on_vs_graph"), 1, 1, "%"),
                         _f(x.get("gap_pct_overlap_off_vs_graph"), 1, 1, "%"),
                         _f(x.get("gap_pct_overlap_launch_vs_graph"), 1, 1, "%"), "—",
                         _pct(x.get("overlapped_steps_on"))])
    if not rows:
        return []
    goal = r.get("overlap_goal", {})
    return ["", "Host work the device waits for: Runner.step back to back (ms), overlap on (the default: the "
                "next step staged while this one runs), off, and launch-ahead (`--launch-ahead`: the next step "
                "launched before this one is waited for), against the replay of the runner's own step graph "
                f"(goal: within 3% with overlap on; worst {_f(goal.get('worst_pct'), 1, 1, '%')}, "
                f"{_met(goal.get('met')) if goal else '—'}) and, for plain decode, the graphed call above.", "",
            _table(["step", "step graph", "overlap on", "overlap off", "launch-ahead", "gap on", "gap off",
                    "gap launch-ahead", "on vs call", "steps staged ahead"], rows)]


def s2(r: dict) -> str:
    hf = r.get("transformers", {})
    eager = {x["batch"]: x for x in hf.get("eager", [])}
    comp = {x["batch"]: x for x in hf.get("static_compiled", [])}
    rows = []
    for x in r["ours"]:
        b = x["batch"]
        rows.append([b, _f(x["roofline_tok_s"], 0), _f(x["tok_s"], 1), _pct(x["fraction_of_roofline"]),
                     _f(x.get("runner_tok_s"), 1), _pct(x.get("runner_fraction_of_roofline")),
                     _f(eager.get(b, {}).get("tok_s"), 1), _f(comp.get(b, {}).get("tok_s"), 1)])
    lines = [f"Attention backend: `{r.get('attention_backend')}`. Engine call source: "
             f"{r['ours'][0].get('source', '—') if r['ours'] else '—'}.", ""]
    label = "static + compile" if hf.get("static_compiled_is_compiled") else "static (not compiled)"
    lines.append(_table(["batch", "roofline tok/s", "engine call tok/s", "% roofline", "Runner step tok/s",
                         "% roofline", "transformers eager", f"transformers {label}"], rows))
    lines += _overlap_lines(r)
    par = hf.get("parity")
    if par:
        lines += ["", f"Same weights in both implementations: logits differ by {par['rel_l2_logits']:.2e} "
                      f"(relative L2; first eighth of positions {par.get('rel_l2_first_eighth', float('nan')):.2e}, "
                      f"last eighth {par.get('rel_l2_last_eighth', float('nan')):.2e}), argmax agrees on "
                      f"{100 * par['argmax_agreement']:.0f}% of {par['tokens']} positions."]
    if hf.get("error"):
        lines += ["", f"transformers baseline failed: `{hf['error']}`"]
    for row in comp.values():
        if "wall_s_including_compile" in row and hf.get("static_compiled_is_compiled"):
            lines += ["", f"transformers' compile + measurement at batch {row['batch']} took "
                          f"{row['wall_s_including_compile']:.0f} s of wall time."]
    g = r.get("goal", {})
    lines += ["", f"Goal: engine ≥ 90% of roofline at batch 1 — measured {_pct(g.get('value'))}: {_met(g.get('met'))}."]
    return "\n".join(lines)


def s3(r: dict) -> str:
    rows = []
    for x in r["rows"]:
        if "error" in x:
            rows.append([x["target"], x["algorithm"], x["shape"], x["graph_mode"], "error: " + x["error"][:80],
                         "", "", "", "", "", "", ""])
            continue
        rows.append([f"{x['target']} ({x['target_layers']}L×{x['target_hidden']})", x["algorithm"],
                     f"{x['shape']} ({x['num_steps']},{x['topk']},{x['num_draft_tokens']})", x["graph_mode"],
                     _f(x["draft_ms"], 2), _f(x["verify_ms"], 2), _f(x["extend_ms"], 2),
                     "—" if x["overhead_ms"] is None else
                     f"{_f(x['overhead_ms'], 2)} ({_f(x['tree_ms'], 2)}, {_f(x['accept_ms'], 2)})",
                     _f(x["whole_ms"], 2), _f(x["decode_step_ms"], 2), f"{x['x_decode_step']:.2f}×",
                     f"≤{x['goal']}× {_met(x.get('goal_met'))}" if x.get("goal_met") is not None else "—"])
    lines = ["Times in ms, medians per step, batch 1, 1K context. Modes: *fused* is the engine's default, "
             "the whole iteration one CUDA graph (timed whole); *split* graphs each model call and runs "
             "tree building and acceptance eagerly between them, which lets CUDA events split the step "
             "into phases; *off* runs without graphs. Overhead is the step minus its model calls, in "
             "brackets (tree build, acceptance). The decode step is the Runner's plain decode step, "
             "graphed for fused and split. hc4 is the same Llama-3.1-8B shape with hc_mult 4 (four "
             "residual streams, spec_hidden_size 16384).", ""]
    lines.append(_table(["target", "head", "shape (steps,topk,tokens)", "graphs", "draft", "verify", "extend",
                         "overhead", "step", "decode step", "step / decode", "goal"], rows))
    return "\n".join(lines)


def s4(r: dict) -> str:
    rows = [[x["batch"], _f(x["eager_call_ms"], 2), _f(x["graph_call_ms"], 2), f"{x['speedup_call']:.2f}×",
             _f(x["runner_eager_ms"], 2), _f(x["runner_graph_ms"], 2), f"{x['speedup_runner']:.2f}×",
             _pct(x["graph_argmax_equals_eager"])] for x in r["rows"]]
    g = r.get("goal", {})
    return "\n".join([
        _table(["batch", "call eager ms", "call graph ms", "speed-up", "Runner step eager ms",
                "Runner step graph ms", "speed-up", "graph argmax = eager"], rows), "",
        f"Goal: graphs ≥ 3× eager at batch 1 — measured {_f(g.get('value'), 2)}×: {_met(g.get('met'))}."])


def s5(r: dict, spec_rows: list | None = None) -> str:
    c = r["corpus"]
    tt, ht, at = r["target_training"], r["head_training"], r["assistant_training"]
    recipe = r.get("recipe")
    if recipe and recipe.get("mode") == "fixed steps":
        spent = {role: f"{recipe[f'{role}_steps']} steps" for role in ("target", "head", "assistant")}
        how = f"Training: a fixed number of steps from seed {recipe['seed']} (the same pair on every machine)"
    else:
        budget = r.get("budget") or recipe or {}
        spent = {role: f"{budget.get(f'{role}_budget_s', 0):.0f} s" for role in ("target", "head", "assistant")}
        how = "Training budget (wall clock on the GPU)"
    if r.get("pair_cache", {}).get("hit"):
        how += "; target and head loaded from the pair cache"
    lines = [
        f"Corpus: {c['files']} Python files of the installed torch package ({c['bytes'] / 1e6:.1f} MB; every "
        f"tenth file held out), byte-level BPE with {c['vocab_size']} tokens: {c['train_tokens'] / 1e6:.2f} M "
        f"training tokens, {c['held_out_tokens'] / 1e6:.2f} M held out.",
        "",
        f"{how}: target {spent['target']} "
        f"({tt['params'] / 1e6:.0f} M parameters, held-out loss {tt['held_out_loss']:.2f} nats/token"
        + (f", {tt['train_windows_loss']:.2f} on training windows" if "train_windows_loss" in tt else "")
        + (f"; a unigram model scores {c['unigram_held_out_loss']:.2f}" if "unigram_held_out_loss" in c else "")
        + f"), EAGLE head {spent['head']} ({ht['params'] / 1e6:.0f} M"
        + (f"; its first draft token equals the target's greedy token on "
           f"{100 * ht['held_out_first_token_agreement']:.0f}% of held-out positions, teacher-forced"
           if "held_out_first_token_agreement" in ht else "")
        + f"), assisted-generation draft "
        f"{spent['assistant']} ({at['params'] / 1e6:.0f} M, held-out loss "
        f"{at['held_out_loss']:.2f}). Last progress lines: target `{tt['last_progress']}`; head "
        f"`{ht['last_progress']}`.",
        "",
        f"{r['prompts']} held-out prompts of {r['prompt_len']} tokens, {r['new_tokens']} new tokens each, greedy "
        "unless a temperature is named (sampled rows compare with sampled target-only), batch 1; tok/s counts "
        "whole requests (prefill + decode). Distinct 4-grams: near 1 for text that does not repeat, small for "
        "an output caught in a loop, which is trivially easy to draft.",
        ""]
    if "rows" not in r:  # a partial record: the call ended during the evaluation
        so_far = r.get("systems_so_far", {})
        lines.append(_table(["system (evaluation cut short)", "accept length", "tok/s"],
                            [[k, _f(v.get("accept_length"), 2), _f(v["tok_s"], 1)] for k, v in so_far.items()]))
        return "\n".join(lines)
    rows = []
    for x in r["rows"]:
        same = x["same_output_as_engine_target_only"]
        rows.append([x["system"], _f(x.get("accept_length"), 2), _f(x["tok_s"], 1),
                     f"{x['speedup_vs_engine_target_only']:.2f}×", f"{x['speedup_vs_transformers']:.2f}×",
                     f"{x['speedup_vs_transformers_assisted']:.2f}×",
                     "—" if same is None else
                     f"{same['equal_outputs']}/{same['of']} (prefix {same['mean_common_prefix']:.0f})",
                     _f(x.get("distinct_4gram_share"), 2)])
    lines.append(_table(["system", "accept length", "tok/s", "vs engine target-only", "vs transformers",
                         "vs transformers assisted", "same tokens as engine target-only", "distinct 4-grams"], rows))
    lm = r.get("fp8_lm_head")
    if lm:
        lines += ["", f"The head's draft logits through an FP8 lm_head (the trained target's {lm['lm_head_shape'][0]} x "
                      f"{lm['lm_head_shape'][1]} lm_head quantized as `--draft-quantization fp8` quantizes an EAGLE-3 "
                      f"head's own, e4m3 with a scale per 128 x 128 block), {lm['positions']} teacher-forced held-out "
                      f"positions: the draft token is the stored lm_head's at {100 * lm['same_draft_token']:.2f}% of "
                      f"them, and equals the target's greedy token at {100 * lm['first_token_agreement_stored']:.1f}% "
                      f"stored, {100 * lm['first_token_agreement_fp8']:.1f}% FP8."]
    par = r.get("hf_parity")
    if par:
        lines += ["", f"Engine vs transformers on the trained target: logits differ by {par['rel_l2_logits']:.2e}, "
                      f"argmax agrees on {100 * par['argmax_agreement']:.0f}% of positions."]
    if any((x.get("same_output_as_engine_target_only") or {}).get("equal_outputs", 0)
           < (x.get("same_output_as_engine_target_only") or {}).get("of", 0) for x in r["rows"]):
        lines += ["", "Where a greedy output differs from the engine's target-only output, the two part at "
                      "a near tie: the models run in bf16, and the target verifying several tokens in one "
                      "forward rounds differently from decoding one, so where its top two logits lie within "
                      "bf16 rounding of each other either may win. transformers, a third bf16 implementation "
                      "of the same weights, parts from the engine's target-only output on as many prompts. "
                      "In float32 the speculative output equals the target-only output token for token "
                      "(tests/engine/test_speculative.py, tests/gpu)."]
    g = r["goal"]
    lines += ["", f"Goal: ≥ 2.5× engine target-only tok/s at batch 1 — best ({g['system']}) "
                  f"{g['value']:.2f}×: {_met(g['met'])}."]
    lines += _acceptance_costs(r, spec_rows or [])
    return "\n".join(lines)


def _acceptance_costs(r: dict, spec_rows: list) -> list[str]:
    """What a speculative step costs this small target, and what the same acceptance lengths buy
    at the step costs section 3 measured on the Llama-3.1-8B shape."""
    rows = {x["system"]: x for x in r.get("rows", [])}
    base = rows.get("engine target-only")
    if not base:
        return []
    out = []
    for name, x in rows.items():
        if name.startswith("engine EAGLE") and x.get("accept_length") and not x.get("temperature"):
            implied = x["accept_length"] * base["tok_s"] / x["tok_s"]
            out.append(f"{name.removeprefix('engine EAGLE ')} {implied:.2f}×")
    lines = ["", "Implied cost of one speculative step in target decode steps on this target (acceptance "
                 "length × target-only tok/s / speculative tok/s): " + ", ".join(out) + ". The target is "
                 "small enough that a decode step is bound by kernel launches rather than by memory: the "
                 "draft's and the tree's kernels weigh almost as much as the target's."]
    shapes = {"chain": "EAGLE chain", "tree": "EAGLE tree", "tree-deep": "EAGLE tree-deep"}
    proj = []
    for x in spec_rows:
        if x.get("target") == "hc1" and x.get("algorithm") == "EAGLE" and x.get("graph_mode") == "fused" \
                and "x_decode_step" in x and shapes.get(x["shape"]) in {k.removeprefix("engine ") for k in rows}:
            acc = rows["engine " + shapes[x["shape"]]]["accept_length"]
            proj.append(f"{x['shape']}: {acc:.2f} / {x['x_decode_step']:.2f} = {acc / x['x_decode_step']:.2f}×")
    if proj:
        lines += ["", "The same acceptance lengths at the step costs of section 3 (EAGLE head on the "
                      "Llama-3.1-8B shape, fused graphs; a projection from two measurements, not a run): "
                      + "; ".join(proj) + "."]
    return lines


def s6(r: dict) -> str:
    out = [f"GPU in the plan: `{r.get('gpu_catalog')}`; {r.get('shape_source')}."]
    for x in r["rows"]:
        out += ["", f"**{x['config']}** ({x.get('algorithm')})"]
        if "error" in x:
            out += ["", f"Failed: `{x['error']}`"]
            continue
        p = x["plan"]
        out += ["", f"Plan: TP {p['tensor_parallel_size']}, max_total_tokens {p['max_total_tokens']}, "
                    f"context {p['context_length']}, max running {p['max_running_requests']}, graph buckets "
                    f"{p['cuda_graph_batch_sizes']}.", ""]
        rows = []
        for name, t in x["terms"].items():
            measured = _f(t["measured_bytes"], 3, GIB, " GiB")
            if "error" in t:
                measured = "out of memory" if "out of memory" in t["error"] else "failed"
            rows.append([name, _f(t["predicted_bytes"], 3, GIB, " GiB"), measured,
                         _f(t.get("measured_over_predicted"), 3)])
        out.append(_table(["term", "plan", "measured", "measured / plan"], rows))
        total = x["terms"].get("total", {})
        if total.get("nvidia_smi_used_bytes"):
            out += ["", f"nvidia-smi used at the end: {total['nvidia_smi_used_bytes'] / GIB:.2f} GiB; the driver's "
                        f"total {x.get('gpu_total_bytes_driver', 0) / GIB:.2f} GiB against the plan's "
                        f"{x.get('plan_gpu_memory_bytes', 0) / GIB:.2f} GiB."]
        for note in x.get("notes", []):
            out += ["", f"Note: {note}"]
    return "\n".join(out)


def _profile_table(title: str, prof: dict) -> str:
    if not prof:
        return ""
    if "error" in prof:
        return f"**{title}**: profiler unavailable (`{prof['error']}`)\n"
    rows = [[f"`{x['name']}`", _f(x["calls_per_rep"], 0), _f(x["self_device_us_per_rep"], 1),
             _f(x["self_cpu_us_per_rep"], 1), _pct(x["share_of_device_time"])] for x in prof["top"]]
    host = prof.get("host_time_us_per_call")
    order = "top entries by host time" if prof.get("by") == "host" else "top entries by device time"
    return "\n".join([f"**{title}** (device time {prof['device_time_us_per_call']:.0f} µs per call"
                      + (f", host time {host:.0f} µs" if host is not None else "")
                      + f", {prof['reps']} calls profiled; {order})", "",
                      _table(["op / kernel", "calls", "device µs", "host µs", "share of device"], rows), ""])


def profiles(sections: dict) -> str:
    parts = []
    rec = sections.get("2")
    if rec and rec.get("results"):
        parts.append(_profile_table("Decode call, batch 1, eager", rec["results"].get("profile_bs1_eager_call")))
        parts.append(_profile_table("Runner decode step, batch 1, graphed, overlap on",
                                    rec["results"].get("profile_bs1_runner_step")))
        parts.append(_profile_table("Runner decode step, batch 1, graphed, overlap off",
                                    rec["results"].get("profile_bs1_runner_step_no_overlap")))
        parts.append(_profile_table("Runner decode step, batch 1, graphed, launch-ahead",
                                    rec["results"].get("profile_bs1_runner_step_launch_ahead")))
    rec = sections.get("3")
    if rec and rec.get("results"):
        for x in rec["results"]["rows"]:
            if x.get("profile"):
                parts.append(_profile_table(f"Speculative step, {x['target']} {x['algorithm']} {x['shape']} "
                                            f"({x['graph_mode']})", x["profile"]))
    return "\n".join(p for p in parts if p)


def s7(r: dict) -> str:
    e, p = r["embedding"], r["parity"]
    sm, big = e["small"], e["shape"]
    lines = [
        f"How the models were made: section 5's trained pair ({r.get('trained_in', '—')}) embedded exactly into "
        f"Llama-3.1-8B shapes (engine/demo/embed.py): hidden {sm['hidden_size']} → {big['hidden_size']} "
        f"(zero-padded), {sm['num_heads']}/{sm['num_kv_heads']} → {big['num_heads']}/{big['num_kv_heads']} "
        f"query/KV heads of {sm['head_dim']} → {big['head_dim']} (extra heads zero, q scaled for the softmax), "
        f"MLP {sm['intermediate_size']} → {big['intermediate_size']}, {sm['num_layers']} → {big['num_layers']} "
        f"layers (the trained ones at {e['small_layers_at']}, the others random with zero output projections), "
        f"RMSNorm weights and eps rescaled for the padded width, vocabulary {sm['vocab_size']} → "
        f"{big['vocab_size']} (zero rows). The function is the small model's; every step reads the 8B's "
        f"bytes: {e['target_params'] / 1e9:.2f} B target parameters ({e['target_weight_bytes'] / GB:.2f} GB), "
        f"{e['head_params'] / 1e6:.0f} M in the EAGLE head. Float32 equality of the logits is tested on a tiny "
        "instance (tests/engine/demo/test_embed.py).",
        "",
        f"Embedded vs small target in bf16 on {p['positions']} held-out positions: logits differ by "
        f"{p['rel_l2_logits']:.2e} (relative L2), argmax agrees on {100 * p['argmax_agreement']:.1f}%; the padded "
        f"tokens' logits are {p['padded_logits_max_abs']:.0f} and every real logit is below them at "
        f"{p['positions_all_real_logits_below_zero']} positions (greedy never leaves the trained vocabulary).",
        "",
        f"Batch 1, end to end: {r['prompts']} held-out prompts of {r['prompt_len']} tokens, {r['new_tokens']} new "
        "tokens each, greedy; tok/s counts whole requests (prefill + decode).", ""]
    rows = []
    for x in r["rows"]:
        same = x["same_output_as_engine_target_only"]
        small = x.get("same_output_as_small_target")
        rows.append([x["system"], _f(x.get("accept_length"), 2), _f(x["tok_s"], 1),
                     f"{x['speedup_vs_engine_target_only']:.2f}×", _f(x["speedup_vs_transformers"], 2, suffix="×"),
                     _f(x["speedup_vs_best_transformers"], 2, suffix="×"),
                     f"{same['equal_outputs']}/{same['of']} (prefix {same['mean_common_prefix']:.0f})",
                     "—" if small is None else f"{small['equal_outputs']}/{small['of']} "
                                               f"(prefix {small['mean_common_prefix']:.0f})",
                     ", ".join(f"{k}: {v}" for k, v in x.get("shape_steps", {}).items() if v) or "—"])
    lines.append(_table(["system", "accept length", "tok/s", "vs engine target-only", "vs transformers eager",
                         "vs best transformers", "same tokens as engine target-only",
                         "same tokens as the small target", "adaptive: steps per shape"], rows))
    for name, err in (r.get("errors") or {}).items():
        lines += ["", f"{name} failed: `{err}`"]
    if r.get("hf_error"):
        lines += ["", f"transformers failed: `{r['hf_error']}`"]
    if r.get("hf_compile_error"):
        lines += ["", f"transformers static + compile failed: `{r['hf_compile_error']}`"]
    lines += ["", "Batch sweep: each configuration on one runner (graphs for every bucket), the batch's requests "
                  f"admitted at once, {r['sizes']['sweep_new_tokens']} new tokens each; decode tok/s of the whole "
                  "batch (after every request's first token, best of two runs), its multiple of target-only, and "
                  "in brackets the multiple end to end (prefill included).", ""]
    rows = [[x["batch"], _f(x["target_only_tok_s"], 0),
             *["failed" if x[f"{k}_tok_s"] is None else
               f"{_f(x[f'{k}_tok_s'], 0)} ({x[f'{k}_x']:.2f}×; {x.get(f'{k}_e2e_x') or float('nan'):.2f}×)"
               for k in ("chain", "tree", "adaptive")],
             ", ".join(f"{k}: {v}" for k, v in (x.get("adaptive_shapes") or {}).items())]
            for x in r["sweep_table"]]
    lines.append(_table(["batch", "target-only decode tok/s", "chain (3,1,4)", "tree (3,4,8)", "adaptive",
                         "adaptive: steps per shape"], rows))
    c = r["crossover_batch"]
    lines += ["", "Crossover (the smallest batch at which a fixed shape decodes slower than target-only): "
                  + ", ".join(f"{k} {'none up to ' + str(r['sweep_table'][-1]['batch']) if v is None else v}"
                              for k, v in c.items()) + "."]
    for name, rec in r["sweep"].items():
        if "error" in rec:
            lines += ["", f"Sweep {name} failed: `{rec['error']}`"]
    costs = r["sweep"].get("adaptive", {}).get("start_up_costs_ms") or {}
    if costs:
        shapes = list(dict.fromkeys(k.split("@")[0] for k in costs))
        buckets = sorted({int(k.split("@")[1]) for k in costs})
        none = {b: costs.get(f"none@{b}") for b in buckets}
        lines += ["", "Step costs the adaptive runner measured at start-up (ms per step, graph replays on padded "
                      "inputs; in brackets the multiple of the plain step at the same batch):", ""]
        lines.append(_table(["shape", *[f"batch {b}" for b in buckets]],
                            [[sh, *[f"{costs[f'{sh}@{b}']:.2f}" + ("" if sh == "none" or not none[b] else
                                                                   f" ({costs[f'{sh}@{b}'] / none[b]:.2f}×)")
                                    for b in buckets]] for sh in shapes]))
    pol = r["sweep"].get("adaptive", {}).get("policy")
    if pol:
        rates = pol["acceptance_rates"]
        lines += ["", "Adaptive policy at the end of the sweep: per-depth acceptance "
                  + "; ".join(f"{k} [{', '.join(f'{x:.2f}' for x in v)}]" for k, v in rates.items())
                  + "; expected tokens per step " + ", ".join(f"{k} {v:.2f}" for k, v in pol["expected_tokens"].items())
                  + f"; predicted crossover batch {pol['crossover_batch'] or 'none'}."]
    for g in r["goals"]:
        lines += ["", f"Goal: {g['metric']} ≥ {g['target']}× — measured {g['value']:.2f}×: {_met(g['met'])}."]
    return "\n".join(lines)


def s8(r: dict) -> str:
    """DeepSeek-V4 (bench/dsv4_bench.py, run on its own: `python3 bench/dsv4_bench.py --out DIR`)."""
    c = r["config"]
    lines = [f"Reduced-depth DeepSeek-V4-Flash: hidden {c['hidden_size']}, {c['num_attention_heads']} heads of "
             f"{c['head_dim']}, {c['n_routed_experts']} experts (top {c['num_experts_per_tok']}, width "
             f"{c['moe_intermediate_size']}), vocabulary {c['vocab_size']}, hc_mult {c['hc_mult']}, window "
             f"{c['sliding_window']}, index_topk {c['index_topk']}; layers {c['compress_ratios'][:-1]} + MTP "
             f"(0 sliding, 4 CSA, 128 HCA); random bf16 weights; {r['context']}-token prompts; graphs "
             f"{r['graph_mode']}. Random weights: the MTP layer rarely agrees with the target, so the step "
             "multiple is the cost of speculation here, not its gain.", ""]
    rows = []
    for x in r["rows"]:
        if "error" in x:
            rows.append([x["kind"], x.get("shape", "—"), x["batch"], "error", x["error"][:80], "—"])
        elif x["kind"] == "decode":
            rows.append(["decode", "—", x["batch"], _f(x["step_ms"], 2, 1, " ms"), _f(x["tok_s"], 1), "1.00x"])
        else:
            rows.append(["MTP", x["shape"], x["batch"], _f(x["step_ms"], 2, 1, " ms"),
                         _f(x["tokens_per_step"], 2) + " tok/step", f"{x['x_decode_step']:.2f}x"])
    lines.append(_table(["step", "shape", "batch", "Runner.step", "tok/s or accepted", "x decode step"], rows))
    pt = r.get("planner_truth") or {}
    if "error" in pt:
        lines += ["", f"Planner truth: error `{pt['error']}`"]
    elif pt:
        lines += ["", "Planner truth (Runner(plan=...) on this GPU, MTP 3 steps, 16 requests): measured / planned:", ""]
        keys = [("weights", "weights_vs_plan"), ("KV pools", "kv_pools_vs_plan"),
                ("graphs + static buffers", "graphs_and_buffers_vs_plan"),
                ("prefill peak reserved / activation workspace", "prefill_peak_vs_plan"),
                ("prefill peak allocated / the workspace's tensors (less allocator slack)", "prefill_allocated_vs_plan"),
                ("total", "total_vs_plan")]
        lines.append(_table(["term", "ratio"], [[name, _f(pt.get(key), 4)] for name, key in keys if key in pt]))
    fp4 = r.get("fp4") or []
    if fp4:
        lines += ["", "FP4 routed experts (the published layout, random codes), dequantized to bf16 inside the expert "
                  "computation: the decode step against the bf16 experts' step, and the dequantization alone:", ""]
        rows = []
        for x in fp4:
            if "error" in x:
                rows.append(["error", x["error"][:80], "—", "—", "—", "—"])
            else:
                rows.append([x["batch"], _f(x["fp4_step_ms"], 2, 1, " ms"), f"{x['x_bf16_step']:.2f}x",
                             _f(x["dequant_ms"], 2, 1, " ms"), f"{x['dequant_share']:.0%}",
                             _f(x.get("dequant_torch_ms"), 2, 1, " ms")])
        lines.append(_table(["batch", "FP4 decode step", "x bf16 step", "dequantization", "share of the step",
                             "dequantization, torch code"], rows))
    return "\n".join(lines)


RENDER = {"1": s1, "2": s2, "3": s3, "4": s4, "5": s5, "6": s6, "7": s7, "8": s8}


# ---- goals and figures -------------------------------------------------------------------------

def goals(sections: dict) -> str:
    return _table(["figure", "goal", "measured", ""], [row[:4] for row in goal_rows(sections)])


def _x(g: dict) -> str:
    """A multiple with its spread where the record has one (the median of several runs)."""
    text = f"{g['value']:.2f}×"
    if g.get("range"):
        text += f" ({g['range'][0]:.2f}–{g['range'][1]:.2f}, {g.get('runs', '?')} runs)"
    return text


def goal_rows(sections: dict) -> list[list]:
    """[figure, goal, measured, verdict, section key] per goal the section records carry."""
    rows = []

    def res(key):
        rec = sections.get(key)
        return rec["results"] if rec and rec["status"] == "ok" else None

    for key, rec in sorted(sections.items()):
        if rec["status"] != "ok":
            rows.append([f"section {key} ({rec['name']})", "—", rec["status"], (rec.get("error", "").splitlines() or [""])[0][:120], key])

    r = res("2")
    if r:
        g = r["goal"]
        rows.append(["decode call at batch 1, % of HBM roofline", "≥ 90%", _pct(g["value"]), _met(g["met"]), "2"])
        step = r["ours"][0].get("runner_fraction_of_roofline")
        if step is not None:
            rows.append(["Runner decode step at batch 1, % of HBM roofline", "≥ 90%", _pct(step),
                         _met(step >= 0.9), "2"])
        at64 = next((x for x in r["ours"] if x["batch"] == 64), None)
        if at64 is not None:  # issue 32's second decode goal
            rows.append(["decode call at batch 64, % of HBM roofline", "≥ 80%", _pct(at64["fraction_of_roofline"]),
                         _met(at64["fraction_of_roofline"] >= 0.8), "2"])
    r = res("3")
    if r:
        for x in r["rows"]:
            if x.get("goal_met") is not None:
                rows.append([f"{x['target']} {x['algorithm']} {x['shape']} step / decode step", f"≤ {x['goal']}×",
                             f"{x['x_decode_step']:.2f}×", _met(x["goal_met"]), "3"])
    r = res("4")
    if r:
        g = r["goal"]
        rows.append(["CUDA graphs vs eager at batch 1", "≥ 3×", f"{g['value']:.2f}×", _met(g["met"]), "4"])
    r = res("5")
    if r:
        g = r["goal"]
        rows.append(["speculative vs target-only tok/s at batch 1 (trained models)", "≥ 2.5×",
                     f"{g['value']:.2f}×", _met(g["met"]), "5"])
    r = res("7")
    if r:
        for g in r["goals"]:
            rows.append([g["metric"], f"≥ {g['target']}×", _x(g), _met(g["met"]), "7"])
        for name, batch in r["crossover_batch"].items():
            rows.append([f"crossover batch, fixed {name}", "report", "none up to 64" if batch is None else str(batch), "—", "7"])
    r = res("6")
    if r:
        for x in r["rows"]:
            t = x.get("terms", {}).get("total", {})
            oom = [k for k, term in x.get("terms", {}).items() if "error" in term]
            if "measured_over_predicted" in t:
                v = t["measured_over_predicted"]
                # A term that ran out of memory means the plan promised memory the GPU lacks,
                # whatever the total says.
                rows.append([f"planner total, {x['config']}", "within 5%",
                             f"{v:.3f}" + (f" ({', '.join(oom)} ran out of memory)" if oom else ""),
                             _met(abs(v - 1) <= 0.05 and not oom), "6"])
            elif "error" in x:
                rows.append([f"planner total, {x['config']}", "within 5%", "error", "**missed**", "6"])
    missing = [k for k in RENDER if k not in sections]
    for k in missing:
        rows.append([f"section {k}", "—", "not run", "—", k])
    return rows


def figures(sections: dict, fig_dir: Path) -> list[str]:
    """PNG figures (matplotlib, when installed); returns markdown image lines."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:
        return []
    fig_dir.mkdir(parents=True, exist_ok=True)
    made = []
    rec = sections.get("2")
    if rec and rec["status"] == "ok":
        r = rec["results"]
        b = [x["batch"] for x in r["ours"]]
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot(b, [x["roofline_tok_s"] for x in r["ours"]], "k--", label="HBM roofline")
        ax.plot(b, [x["tok_s"] for x in r["ours"]], "o-", label="engine call (graph)")
        ax.plot(b, [x.get("runner_tok_s") for x in r["ours"]], "s-", label="engine Runner step")
        static = ("transformers static+compile" if r.get("transformers", {}).get("static_compiled_is_compiled")
                  else "transformers static (not compiled)")
        for key, label in (("eager", "transformers eager"), ("static_compiled", static)):
            pts = [(x["batch"], x["tok_s"]) for x in r.get("transformers", {}).get(key, []) if "tok_s" in x]
            if pts:
                ax.plot(*zip(*pts), "^-", label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("batch")
        ax.set_ylabel("decode tok/s")
        ax.set_title("Target-only decode, Llama-3.1-8B shape, 1K context")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(fig_dir / "decode.png", dpi=120)
        plt.close(fig)
        made.append("![decode](benchmarks/decode.png)")
    rec = sections.get("3")
    if rec and rec["status"] == "ok":
        rows = [x for x in rec["results"]["rows"] if "whole_ms" in x]
        if rows:
            fig, ax = plt.subplots(figsize=(7, 0.35 * len(rows) + 1.2))
            labels = [f"{x['target']} {x['algorithm']} {x['shape']} ({x['graph_mode']})" for x in rows]
            # Split and eager steps by phase; a fused step (one graph) as a whole.
            phased = [x.get("draft_ms") is not None for x in rows]
            left = [0.0] * len(rows)
            for key in ("draft_ms", "verify_ms", "extend_ms", "overhead_ms"):
                vals = [max(x[key], 0) / x["decode_step_ms"] if ph else 0.0 for x, ph in zip(rows, phased)]
                ax.barh(labels, vals, left=left, label=key[:-3])
                left = [a + v for a, v in zip(left, vals)]
            ax.barh(labels, [0.0 if ph else x["x_decode_step"] for x, ph in zip(rows, phased)],
                    color="0.35", label="whole step (fused graph)")
            ax.axvline(1.35, color="k", ls="--", lw=0.8, label="chain goal")
            ax.axvline(1.6, color="k", ls=":", lw=0.8, label="tree goal")
            ax.invert_yaxis()
            ax.set_xlabel("speculative step / target decode step (same graph mode)")
            ax.tick_params(axis="y", labelsize=7)
            # Below the axes: inside, it would cover the longest bars.
            ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.5 / (0.35 * len(rows) + 1.2)),
                      ncol=4, frameon=False)
            fig.tight_layout()
            fig.savefig(fig_dir / "spec_step.png", dpi=120)
            plt.close(fig)
            made.append("![speculative step](benchmarks/spec_step.png)")
    return made


def _section_tables(key: str, rec: dict, sections: dict) -> list[str]:
    """A section's tables, or a line saying why its record could not be rendered (a malformed
    record, or one of an older layout: the rest of the page stands)."""
    if rec["status"] not in ("ok", "partial") or key not in RENDER:
        return []
    try:
        if key == "5":  # its projection reads section 3's step costs
            spec = sections.get("3", {}).get("results") or {}
            return [s5(rec["results"], spec.get("rows"))]
        return [RENDER[key](rec["results"])]
    except Exception as e:
        return [f"(could not render: {type(e).__name__}: {e})"]


def _with_profiles(lines: list[str], sections: dict) -> str:
    """The page: `lines`, then where the time goes, when any section profiled it."""
    prof = profiles(sections)
    if prof:
        lines += ["## Profiles", "", "Where the time goes (torch.profiler).", "", prof]
    return "\n".join(lines).rstrip() + "\n"


def render(sections: dict, envs: list[dict], fig_dir: Path | None) -> str:
    smoke = any(rec.get("smoke") for rec in sections.values())
    lines = ["# Benchmarks", ""]
    if smoke:
        lines += ["> **Smoke run (CPU, tiny shapes): these numbers only show that the code runs; they say "
                  "nothing about speed.**", ""]
    lines.append("Generated by `bench/report.py` from the JSON that `bench/run.py` wrote on the GPU machine.")
    lines.append("")
    for env in envs:
        lines.append(f"- {env.get('date')}: {env.get('device')} ({_f(env.get('device_memory_bytes'), 1, GIB, ' GiB')}, "
                     f"{env.get('sm_count')} SMs; {env.get('nvidia_smi') or 'no nvidia-smi'}), Python "
                     f"{env.get('python')}, torch {env.get('torch')} (CUDA {env.get('cuda')}), triton "
                     f"{env.get('triton')}, transformers {env.get('transformers')}, tokenizers "
                     f"{env.get('tokenizers')}; command `{env.get('command')}`")
    lines += ["", HOW_TO_READ, "## Goals", "", goals(sections), ""]
    if fig_dir is not None:
        figs = figures(sections, fig_dir)
        if figs:
            lines += ["## Figures", "", *figs, ""]
    for key in sorted(sections):
        rec = sections[key]
        lines.append(_header(rec))
        lines += _section_tables(key, rec, sections)
        lines.append("")
    return _with_profiles(lines, sections)


# ---- the repository's report: every committed run, each goal once from its latest run ---------

RUNS_COMMAND = "python3 bench/report.py --runs docs/benchmarks/runs --out docs/benchmarks.md"
HISTORY = "benchmarks/history.md"  # the earlier, hand-written reports, relative to docs/
# scripts outside bench/run.py whose JSON the report reads (the first two carry goals)
SCRIPT_JSON = ("fp8.json", "fp8_crossover.json", "serving_bench.json")
# Scripts that describe themselves (any `<name>.json` with "script": "bench/<file>.py"): their
# "goals" name their figures ({key: {"figure", "goal", "measured", "unit": "x" | "%" | "ms" |
# "", "better": "higher" | "lower"}}), and the `<name>.md` the script wrote beside the JSON (its
# tables, first line a title) is the report's section for it, under `title` and `command`.
SERVING_COMMAND = "python3 bench/serving_bench.py --out OUT --rates 4,16,64 --budget-s 200"
SERVING_COUNTS_NOTE = (
    "Answered counts the requests of the measured window completed in it against those sent in it. "
    "Refused are those the server answered 429 (its waiting queue, `--max-queued-requests`, is full) or 503 "
    "(draining, stalled): load shed past saturation, as designed, not failures. Failed are any other error, by "
    "kind. In flight at close were still queued or streaming when the rate's duration ended (guidellm cancels "
    "them; the client's HTTP timeout outlasts every rate, so it cuts none).")
SERVING_NOTE = (
    "The load generator is [guidellm](https://github.com/vllm-project/guidellm) 0.8.1 (the vLLM project's; "
    "in pyproject.toml's dev extra, and its smoke form, `bench/serving_bench.py --smoke`, runs in "
    "tests/bench/test_serving_bench.py against the tiny CPU pair). Of the three tools users of this field run, it "
    "is the one that installs beside the engine: inference-perf 0.7.0 (the Kubernetes serving working group's) "
    "requires Python 3.12 and pins transformers; aiperf 0.13.0 brings some 60 packages (dash, plotly, optuna, "
    "kubernetes-asyncio, ...) and pins older rich, psutil and huggingface-hub than the engine's; guidellm needs "
    "a dozen small ones, and has what the benchmark asks for built in: Poisson arrivals at given rates, a "
    "synthetic text source with length spreads and shared prefixes generated locally from the served "
    "tokenizer, and TTFT/ITL percentiles per rate. (Its metadata pins click~=8.4 and pulls sanic for its mock "
    "server; neither is used here.) Each mode is one `specdeploy engine serve` (target-only: `--algorithm "
    "NONE`; fixed: the EAGLE chain of depth 3; adaptive: the same with `--adaptive-speculation`), driven at "
    "each rate until its duration or request cap; output tok/s is the output tokens over the measured "
    "window, the achieved request rate below the offered one marks saturation.")

SECTION_FILE = re.compile(r"\d_[a-z0-9_]+\.json")  # a section record (not superseded-/partial-/before-)


def _json(path: Path):
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _record_date(folder_date: str | None, started: str | None) -> str | None:
    """A section record's date: its folder's day and its own start time ("HH:MM:SS")."""
    if folder_date and started and re.fullmatch(r"\d\d:\d\d:\d\d", started):
        return f"{folder_date[:10]} {started[:5]} UTC"
    return folder_date


def scan_runs(root: Path, repo: Path) -> dict:
    """Every run folder under `root`: the latest record of each section and of each goal-carrying
    script JSON (by date), and every GPU-test log's summary line. Records keep where they came
    from: `_source` (path in the repository), `_date`, `_commit`."""
    sections: dict = {}
    scripts: dict = {}
    tests: list = []
    serving_runs: list = []
    for folder in sorted(p for p in root.iterdir() if p.is_dir()):
        records = {p: _json(p) for p in sorted(folder.glob("*.json"))}
        env = records.pop(folder / "env.json", None)
        dated = sorted((r.get("environment") or {}).get("date") for r in records.values()
                       if r and (r.get("environment") or {}).get("date"))
        folder_date = (env or {}).get("date") or (dated[0] if dated else None)
        folder_commit = (env or {}).get("commit")
        for path, rec in records.items():
            if rec is None:
                continue
            rel = path.relative_to(repo).as_posix()
            if "section" in rec and SECTION_FILE.fullmatch(path.name):
                cand = {**rec, "_source": rel, "_date": _record_date(folder_date, rec.get("started")),
                        "_commit": folder_commit, "_env": env}
                old = sections.get(rec["section"])
                if old is None or (cand["_date"] or "") >= (old["_date"] or ""):
                    sections[rec["section"]] = cand
            elif path.name in SCRIPT_JSON or str(rec.get("script", "")).startswith("bench/"):
                renv = rec.get("environment") or {}
                cand = {"data": rec, "_source": rel, "_date": renv.get("date") or folder_date,
                        "_commit": renv.get("commit") or folder_commit, "_folder": folder}
                if path.name == "serving_bench.json":
                    serving_runs.append(cand)
                old = scripts.get(path.name)
                if old is None or (cand["_date"] or "") >= (old["_date"] or ""):
                    scripts[path.name] = cand
        for log in sorted(folder.glob("gpu_tests*.log")):
            lines = [x for x in log.read_text(errors="replace").splitlines()
                     if re.search(r"\d+ (passed|failed)", x) and " in " in x]
            name_commit = re.fullmatch(r"gpu_tests_([0-9a-f]{7,40})\.log", log.name)
            name_time = re.fullmatch(r"gpu_tests_(\d\d)(\d\d)\.log", log.name)  # an older naming: the UTC time
            tests.append({"log": log.relative_to(repo).as_posix(), "summary": lines[-1].strip("= ") if lines else
                          "no summary line (stopped before the end)",
                          "date": f"{folder_date[:10]} {name_time[1]}:{name_time[2]} UTC" if name_time and folder_date
                          else folder_date,
                          "commit": name_commit.group(1) if name_commit and not name_time else folder_commit or
                          next(((r.get("environment") or {}).get("commit") for r in records.values()
                                if r and (r.get("environment") or {}).get("commit")), None)})
    serving = sorted(serving_runs, key=lambda r: r["_date"] or "")
    return {"sections": sections, "scripts": scripts, "tests": tests, "serving_runs": serving}


def script_goal_rows(scripts: dict) -> list[tuple[list, dict]]:
    """([figure, goal, measured, verdict], record) per goal of bench/fp8_bench.py and
    bench/fp8_crossover.py."""
    rows = []
    fp8 = scripts.get("fp8.json")
    if fp8:
        names = {"batch1_fp8_over_bf16": ("FP8 / bf16 decode call at batch 1 (Llama-3.1-8B shape)", "x"),
                 "batch1_fraction_of_fp8_roofline": ("FP8 decode call at batch 1, share of the FP8 roofline", "%"),
                 "fp8_over_bf16_every_batch_min": ("FP8 / bf16 decode call, worst batch of 1-256", "x"),
                 "eagle3_multiple_fp8_over_bf16": ("EAGLE-3 chain step multiple, FP8 target / bf16 target", "x"),
                 "eagle3_multiple_fp8_draft_fp8_over_bf16": (
                     "EAGLE-3 chain step multiple, FP8 target with the head quantized at load (--draft-quantization "
                     "fp8) / bf16 target", "x")}
        for key, g in (fp8["data"].get("goals") or {}).items():
            figure, unit = names.get(key, (key, "x"))
            lower = g.get("better") == "lower"
            goal = f"{'≤' if lower else '≥'} " + (f"{g['goal']:.0%}" if unit == "%" else f"{g['goal']}×")
            measured = _pct(g["measured"]) if unit == "%" else f"{g['measured']:.2f}×"
            met = g["measured"] <= g["goal"] if lower else g["measured"] >= g["goal"]
            rows.append(([figure, goal, measured, _met(met)], fp8))
    cross = scripts.get("fp8_crossover.json")
    if cross and cross["data"].get("goal"):
        d = cross["data"]
        g = d["goal"]
        rows.append((["FP8 linears / bf16, worst M of 1-8192 (a step's 8B linears)", "≥ 1.0×",
                      f"{g['min_engine_speedup']:.2f}×", _met(g["met"])], cross))
        prefill = [e["speedup_vs_bf16"]["engine"] for e in d.get("step_linears", [])
                   if e["m"] >= 2048 and "engine" in e["speedup_vs_bf16"]]
        if prefill:
            rows.append((["FP8 prefill linears / bf16, worst M >= 2048", "≥ 1.5×", f"{min(prefill):.2f}×",
                          _met(min(prefill) >= 1.5)], cross))
    return rows


def _goal_text(value: float, unit: str) -> str:
    return {"x": f"{value:.2f}×", "%": _pct(value), "ms": f"{value:.2f} ms"}.get(unit, f"{value:g}")


def described_goal_rows(scripts: dict) -> list[tuple[list, dict]]:
    """([figure, goal, measured, verdict], record) per goal of the self-describing scripts."""
    rows = []
    for name, rec in sorted(scripts.items()):
        if name in SCRIPT_JSON:
            continue
        for key, g in (rec["data"].get("goals") or {}).items():
            unit, lower = g.get("unit", "x"), g.get("better") == "lower"
            measured = g.get("measured")
            goal = f"{'≤' if lower else '≥'} " + (f"{g['goal']:g}×" if unit == "x" else _goal_text(g["goal"], unit))
            if measured is None:
                rows.append(([g.get("figure", key), goal, "not measured", "—"], rec))
                continue
            met = measured <= g["goal"] if lower else measured >= g["goal"]
            rows.append(([g.get("figure", key), goal, _goal_text(measured, unit), _met(met)], rec))
    return rows


def described_sections(scripts: dict) -> list[str]:
    """The self-describing scripts' sections: heading, command, provenance, their own markdown."""
    lines: list[str] = []
    for name, rec in sorted(scripts.items()):
        if name in SCRIPT_JSON:
            continue
        d = rec["data"]
        env = d.get("environment") or {}
        lines += [f"## {d.get('title') or name}", "",
                  f"`{d.get('command') or d['script']}` ({rec['_date']}, commit {rec['_commit'] or '—'}, "
                  f"`{rec['_source']}`); {env.get('device', '?')}, torch {env.get('torch', '?')}, "
                  f"triton {env.get('triton', '?')}.", ""]
        md = rec["_folder"] / (Path(name).stem + ".md")
        if md.is_file():
            body = md.read_text().split("\n", 1)
            lines += [(body[1] if len(body) > 1 else "").strip(), ""]
    return lines


def _gpu(env: dict | None) -> str:
    """The GPU a record was measured on, short ("H100", "H200"), from its environment."""
    name = (env or {}).get("device") or (env or {}).get("gpu") or ""
    found = re.search(r"\b([A-Z]\d{2,4}[A-Z]?)\b", name)
    return found.group(1) if found else (name.removeprefix("NVIDIA ") or "—")


def repository_goals(scan: dict) -> list[list]:
    """The Goals table's rows: [figure, goal, measured, verdict, date, commit, GPU, source], each
    goal once (the latest run that measured it)."""
    rows = {}
    sections = scan["sections"]
    for row in goal_rows(sections):
        figure, goal, measured, verdict, key = row
        rec = sections.get(key, {})
        if measured == "not run":
            continue
        rows[figure] = [figure, goal, measured, verdict, rec.get("_date") or "—", rec.get("_commit") or "—",
                        _gpu(rec.get("_env") or rec.get("environment")), rec.get("_source") or "—"]
    for (figure, goal, measured, verdict), rec in script_goal_rows(scan["scripts"]) + described_goal_rows(scan["scripts"]):
        rows[figure] = [figure, goal, measured, verdict, rec["_date"] or "—", rec["_commit"] or "—",
                        _gpu(rec["data"].get("environment")), rec["_source"]]
    return list(rows.values())


def goals_table(rows: list[list]) -> str:
    return _table(["figure", "goal", "measured", "verdict", "date", "commit", "GPU", "JSON"],
                  [[*r[:7], f"`{r[7]}`"] for r in rows])


def _crossover_table(d: dict) -> str:
    options = [o for o in ("bf16", "gemv", "w8a16", "w8a8", "torch_block", "torch_tensor", "engine")
               if any(o in e["us"] for e in d["step_linears"])]
    rows = [[e["m"]] + [f"{e['us'][o]:.0f} ({e['speedup_vs_bf16'][o]:.2f}×)" if o in e["us"] else "—"
                        for o in options] for e in d["step_linears"]]
    return _table(["M"] + options, rows)


def _kernel_profile(prof: dict, step_ms: float | None) -> str:
    """A profile_top table (bench/harness.py) by kernel; step_ms: the same call's unprofiled median."""
    if not prof or prof.get("error"):
        return f"(profile unavailable: {prof.get('error') if prof else 'not recorded'})"
    rows = [[t["name"][:60], f"{t['calls_per_rep']:.0f}", f"{t['self_device_us_per_rep']:.1f}",
             _pct(t["share_of_device_time"])] for t in prof["top"] if t["self_device_us_per_rep"] >= 1.0]
    note = (f"Device time per profiled replay {prof['device_time_us_per_call']:.0f} µs"
            + (f" against {1e3 * step_ms:.0f} µs unprofiled (the profiler stretches each of the step's "
               "kernels, so read the shares, and the µs as upper bounds)" if step_ms else "") + ".")
    return note + "\n\n" + _table(["kernel", "launches", "µs", "share"], rows)


def _spec_profiles(data: dict) -> list[str]:
    """Where the EAGLE-3 steps' time goes on the bf16 and the FP8 target (fp8_bench's speculative
    rows that carry a profile), beside the decode step each is a multiple of."""
    lines = []
    for row in data.get("speculative", []):
        if row.get("profile") and "error" not in row:
            off = row.get("step_ms_pdl_off")
            where = f"the {row['weights']} target" if row["weights"] in ("bf16", "fp8") else f"the {row['weights']}"
            lines += [f"Where the EAGLE-3 chain step's time goes on {where} ({row['step_ms']:.3f} ms "
                      f"a step, {row['step_over_decode']:.2f}x its {row['decode_step_ms']:.3f} ms decode step), each "
                      "kernel's own: torch.profiler over the steps of a Runner captured without PDL"
                      + (f" ({off:.3f} ms a step)" if off else "") + ".", "",
                      _kernel_profile(row["profile"], off or row["step_ms"]), ""]
    return lines


def _e2e_note(r: dict) -> list[str]:
    """Where the batch-1 speed-up at the 8B cost goes, from section 7's own rows: a speculative
    system's speed-up is its tokens per target forward over what one of its steps costs."""
    rows = {row["system"]: row for row in r.get("rows", [])}
    base = rows.get("engine target-only")
    spec = [row for name, row in rows.items() if name.startswith("engine EAGLE") and row.get("accept_length")]
    if not base or not spec:
        return []
    out = ["## End to end at the 8B cost: where the speed-up goes", "",
           f"Batch 1, section 7 (medians of {base.get('runs', 1)} runs): target-only {base['tok_s']:.0f} tok/s "
           f"({base.get('tok_s_min') or base['tok_s']:.0f}-{base.get('tok_s_max') or base['tok_s']:.0f}). A speculative "
           "system's speed-up is its accept length (tokens per target forward) over the cost of one of its steps "
           "in target-only steps; the second factor is the price of drafting and verifying.", "",
           _table(["system", "tok/s (min-max)", "speed-up", "accept length", "implied step cost (accept length / speed-up, prefill included)"],
                  [[row["system"], f"{row['tok_s']:.0f} ({(row.get('tok_s_min') or row['tok_s']):.0f}-"
                    f"{(row.get('tok_s_max') or row['tok_s']):.0f})", f"{row['speedup_vs_engine_target_only']:.2f}×",
                    f"{row['accept_length']:.2f}", f"{row['accept_length'] / row['speedup_vs_engine_target_only']:.2f}×"]
                   for row in spec]), ""]
    return out


def _serving_counts(r: dict) -> list[str]:
    """answered/sent, refused (the server's 429/503), failed (any other error, by kind) and in
    flight at the window's close; an older record without the breakdown shows its errored."""
    q = r["requests"]
    e = r.get("errors")
    if e is None:
        return [f"{q['successful']}/{q['total']}", "—", f"{q['errored']} (kind not recorded)" if q["errored"] else "0",
                str(q["incomplete"])]
    refused = ", ".join(f"{n} ({k.removeprefix('http ')})" for k, n in e["kinds"].items()
                        if k in ("http 429", "http 503")) or "0"
    failed = ", ".join(f"{n} {k}" for k, n in e["kinds"].items() if k not in ("http 429", "http 503"))
    return [f"{q['successful']}/{q['total']}", refused, failed or str(e["failed"]), str(q["incomplete"])]


def serving_table(d: dict) -> str:
    """bench/serving_bench.py's JSON -> one row per mode and offered rate (a mode skipped or cut
    by the time budget says so)."""
    rows = []
    for mode, rec in d["modes"].items():
        why = rec.get("skipped") or rec.get("cut") or rec.get("error")
        if not rec["rows"] and why:
            rows.append([mode, "—", "—", "—", "—", "—", "—", "—", f"not measured: {why}", "—", "—", "—"])
        for r in rec["rows"]:
            rows.append([mode, f"{r['rate']:.1f}", _f(r["achieved_requests_per_s"], 2), _f(r["output_tok_s"]),
                         _f(r["ttft_ms_p50"]), _f(r["ttft_ms_p99"]), _f(r["itl_ms_p50"], 2), _f(r["itl_ms_p99"], 2),
                         *_serving_counts(r)])
    return _table(["mode", "offered req/s", "achieved req/s", "output tok/s", "TTFT p50 ms", "TTFT p99 ms",
                   "ITL p50 ms", "ITL p99 ms", "answered", "refused (status)", "failed", "in flight at close"],
                  rows)


SERVING_PANELS = (("output_tok_s", None, "output tok/s"), ("ttft_ms_p50", "ttft_ms_p99", "TTFT p50 / p99 (ms)"),
                  ("itl_ms_p50", "itl_ms_p99", "ITL p50 / p99 (ms)"))


def serving_plot(d: dict, path: Path) -> bool:
    """Output tok/s, TTFT p50/p99 and ITL p50/p99 against the offered rate, one colour per mode
    (p50 solid, p99 dashed); False where matplotlib is not installed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, len(SERVING_PANELS), figsize=(13, 3.6))
    for i, (mode, rec) in enumerate(d["modes"].items()):
        rows = [r for r in rec["rows"] if r.get("output_tok_s") is not None]
        if not rows:
            continue
        rates = [r["rate"] for r in rows]
        for ax, (p50, p99, _) in zip(axes, SERVING_PANELS):
            ax.plot(rates, [r[p50] for r in rows], marker="o", color=f"C{i}", label=mode)
            if p99:
                ax.plot(rates, [r[p99] for r in rows], marker="^", linestyle="--", color=f"C{i}",
                        label=f"{mode} p99")
    rates = sorted({r["rate"] for rec in d["modes"].values() for r in rec["rows"]})
    for ax, (_, p99, title) in zip(axes, SERVING_PANELS):
        ax.set_xscale("log")
        if rates:
            ax.set_xticks(rates, [f"{x:g}" for x in rates])
        ax.minorticks_off()
        if p99:
            ax.set_yscale("log")
        ax.set_xlabel("offered requests/s (Poisson)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[0].legend()
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _serving_run_text(d: dict) -> str:
    """What the run did, from its JSON: the warm-up (or that it had none), the budget."""
    warm = [rec.get("warmup") for rec in d["modes"].values() if rec.get("rows")]
    run = d["run"]
    text = ""
    if warm and all(warm):
        w = warm[0]
        phase = (f"first {w['value']} request(s)" if w["mode"] == "requests" else f"first {w['value']} s")
        text = (f"No figure is cold: each server first answered {run.get('prime_requests', 0)} unmeasured requests, "
                f"and each rate's {phase} were guidellm's warm-up, sent but left out of every figure.")
    elif warm:
        text = ("Each mode's first rate also carries the server's first requests (this run had no warm-up "
                "phase), so read its TTFT as a cold figure.")
    per_mode = ", ".join(f"{m} {rec['max_seconds']} s" for m, rec in d["modes"].items()
                         if rec.get("rows") and rec.get("max_seconds"))
    if run.get("budget_s"):
        text += f" Time budget {run['budget_s']:.0f} s for the whole run" + (
            f"; each rate's duration, warm-up included: {per_mode}." if per_mode else ".")
    return text.strip()


def _serving_legacy_errors(d: dict) -> str:
    """For a run recorded before the error breakdown: what its errored were, read from its counts
    (errored = sent - answered - in flight, and in flight stuck at what the server holds)."""
    old = [(mode, r) for mode, rec in d["modes"].items() for r in rec["rows"] if "errors" not in r
           and r["requests"]["errored"]]
    if not old:
        return ""
    held = ", ".join(f"{mode} {r['requests']['incomplete']}" for mode, r in old)
    return (f" This run predates the breakdown: where requests errored (the highest rate), in flight at close was "
            f"{held}, about the {d['run']['max_running_requests']} running plus the full waiting queue the "
            "server holds; what arrived beyond it was refused with 429.")


def merged_serving(runs: list[dict]) -> dict | None:
    """One serving record of the latest run, each mode taken from the latest run that measured it
    (a device call's time budget may skip a mode; a later call measures it) among the runs of the
    same workload and harness (per-rate warm-up); each mode keeps where it came from."""
    if not runs:
        return None
    latest = runs[-1]
    base = latest["data"]
    same = [r for r in runs if r["data"].get("workload") == base.get("workload")
            and ("warmup_s" in r["data"].get("run", {})) == ("warmup_s" in base.get("run", {}))]
    modes: dict = {}
    for rec in same:  # oldest first: a later measurement of a mode replaces an earlier one
        for mode, m in rec["data"]["modes"].items():
            if m.get("rows") or mode not in modes:
                modes[mode] = {**m, "_run": {"date": rec["_date"], "commit": rec["_commit"], "source": rec["_source"]}}
    return {**latest, "data": {**base, "modes": modes}, "_merged": len({m["_run"]["source"] for m in modes.values()}) > 1}


def _serving_section(rec: dict | None) -> list[str]:
    lines = ["## Serving benchmark (issue 33)", "", SERVING_NOTE, ""]
    if rec is None:
        return lines + [f"Not yet run on the device: `{SERVING_COMMAND}` (`--modes` and `--smoke` narrow it), then "
                        "copy OUT/serving_bench.json into a folder under docs/benchmarks/runs/ and regenerate "
                        "this page.", ""]
    d = rec["data"]
    w, m = d["workload"], d["model"]
    lines += [f"`{d.get('command') or SERVING_COMMAND}` ({rec['_date']}, commit {rec['_commit']}, `{rec['_source']}`), "
              f"{d['device']}, guidellm {d.get('tool_version')}. Pair: {m['pair']}, {m.get('num_layers', '?')} "
              f"layers, hidden {m.get('hidden_size', '?')}, vocabulary {m['vocab_size']}, {m['dtype']}. Workload: "
              f"prompts {w['prompt_tokens']} ± {w['prompt_tokens_stdev']} tokens ({w['prompt_tokens_min']}-"
              f"{w['prompt_tokens_max']}) after one of {w['prefix_count']} shared {w['prefix_tokens']}-token "
              f"prefixes, outputs {w['output_tokens']} ± {w['output_tokens_stdev']} ({w['output_tokens_min']}-"
              f"{w['output_tokens_max']}), each rate for up to {d['run']['max_seconds']} s or "
              f"{d['run']['max_requests']} requests, up to {d['run']['max_running_requests']} running on the "
              "server. " + _serving_run_text(d), "",
              SERVING_COUNTS_NOTE + _serving_legacy_errors(d), ""]
    if rec.get("_merged"):
        lines += ["The modes come from more than one device call (a call's time budget skipped some); each mode's run: "
                  + "; ".join(f"{mode}: {m['_run']['date']}, commit {m['_run']['commit']}, `{m['_run']['source']}`"
                              for mode, m in d["modes"].items()) + ".", ""]
    lines += [f"{mode}: {m['note']}" for mode, m in d["modes"].items() if m.get("note")]
    if any(m.get("note") for m in d["modes"].values()):
        lines.append("")
    png = rec["_folder"] / "serving_bench.png"
    if png.is_file():
        lines += [f"![serving curves]({png.relative_to(rec['_folder'].parents[2]).as_posix()})", ""]
    return lines + [serving_table(d), ""]


def render_repository(scan: dict, repo: Path) -> str:
    sections, scripts = scan["sections"], scan["scripts"]
    lines = ["# Benchmarks", "",
             f"Generated by `{RUNS_COMMAND}` from the JSON committed under `docs/benchmarks/runs/` (each "
             "folder one device session). Every figure below is read from those files; each goal appears "
             "once, from the latest run that measured it, with that run's date, the commit it measured "
             "(— where the run predates commit recording), the GPU it ran on and its JSON: a figure "
             "measured on an H100 and one on an H200 are each that card's. Earlier hand-written reports, "
             f"whose figures these supersede: [history]({HISTORY}).", "", HOW_TO_READ,
             "## Goals", "", goals_table(repository_goals(scan)), "",
             "## GPU tests", "",
             "Each log's summary line, newest first. From 2026-12-01 19:54 UTC the whole suite in one call: "
             "`python3 -P -m pytest -q -n 8 tests/gpu` (pytest-xdist, one H100 or H200); earlier logs ran subsets "
             "under a time cap (the history says which).", "",
             _table(["date", "commit", "result", "log"],
                    [[t["date"] or "—", t["commit"] or "—", t["summary"], f"`{t['log']}`"]
                     for t in sorted(scan["tests"], key=lambda t: t["date"] or "", reverse=True)]), ""]
    fp8 = scripts.get("fp8.json")
    cross = scripts.get("fp8_crossover.json")
    if fp8 or cross:
        lines += ["## FP8 weights (issue 32)", ""]
    if cross and cross["data"].get("step_linears"):
        env = cross["data"].get("environment", {})
        lines += [f"### FP8 GEMM options side by side (`python3 bench/fp8_crossover.py --out OUT`, {cross['_date']}, "
                  f"commit {cross['_commit']}, `{cross['_source']}`)", "",
                  f"{env.get('device')}, torch {env.get('torch')}, triton {env.get('triton')}. Microseconds of a "
                  "decode step's linears (the Llama-3.1-8B qkv, o, gate_up and down x 32 layers, each layer a "
                  "CUDA graph over weight copies that defeat the L2), bf16 / option in brackets; `engine` is "
                  "the route `fp8_linear` takes (docs/engine.md says why).", "", _crossover_table(cross["data"]), ""]
    if fp8:
        md = fp8["_folder"] / "fp8.md"
        lines += [f"### FP8 end to end (`python3 bench/fp8_bench.py --out OUT`, {fp8['_date']}, commit "
                  f"{fp8['_commit']}, `{fp8['_source']}`)", ""]
        if md.is_file():
            lines += [md.read_text().split("\n", 1)[1].strip(), ""]
        prof = fp8["data"].get("profile_fp8_batch1")
        if prof:
            row = next((r for r in fp8["data"].get("decode", []) if r["weights"] == "fp8" and r["batch"] == 1), {})
            lines += ["Where the batch-1 FP8 step's time goes (the goal of 1.8× bf16 and 85% of the FP8 roofline "
                      "is missed): torch.profiler over replays of the graphed decode call.", "",
                      _kernel_profile(prof, row.get("median_ms")), ""]
        for weights in ("bf16", "fp8"):
            for att in fp8["data"].get(f"attributed_{weights}") or []:
                lines += [f"Where the {weights} batch-{att['batch']} step's time goes, each kernel's own: the graphed "
                          f"decode call captured without PDL ({att['median_ms_pdl_off']:.3f} ms a step), "
                          "torch.profiler over its replays.", "",
                          _kernel_profile(att["profile"], att["median_ms_pdl_off"]), ""]
        lines += _spec_profiles(fp8["data"])
    lines += described_sections(scripts)
    lines += _serving_section(merged_serving(scan.get("serving_runs") or []))
    e2e = sections.get("7")
    if e2e and e2e["status"] == "ok":
        lines += _e2e_note(e2e["results"])
    for key in sorted(sections):
        rec = sections[key]
        lines.append(_header(rec).rstrip())
        lines += ["", f"Source: `{rec['_source']}` ({rec['_date'] or 'undated'}, commit {rec['_commit'] or '—'}).", ""]
        lines += _section_tables(key, rec, sections)
        lines.append("")
    return _with_profiles(lines, sections)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="results JSON -> docs/benchmarks.md")
    parser.add_argument("dirs", nargs="*", type=Path, help="folders holding env.json and <n>_<name>.json")
    parser.add_argument("--runs", type=Path, default=None,
                        help="the repository's report: every run folder under this one (docs/benchmarks/runs)")
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks.md"))
    parser.add_argument("--no-figures", action="store_true")
    args = parser.parse_args(argv)
    if args.runs is not None:
        repo = Path(__file__).resolve().parent.parent
        scan = scan_runs(args.runs.resolve(), repo)
        serving = merged_serving(scan["serving_runs"])
        if serving and not args.no_figures:
            serving_plot(serving["data"], serving["_folder"] / "serving_bench.png")
        args.out.write_text(render_repository(scan, repo))
        print(f"wrote {args.out}")
        return 0
    if not args.dirs:
        parser.error("give result folders, or --runs")
    sections, envs = load(args.dirs)
    if not sections:
        print(f"no section JSON under {', '.join(map(str, args.dirs))}", file=sys.stderr)
        return 1
    data_dir = args.out.parent / "benchmarks"
    fig_dir = None if args.no_figures else data_dir
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(render(sections, envs, fig_dir))
    # The raw records next to the page, so every figure in it can be traced to its measurement.
    data_dir.mkdir(parents=True, exist_ok=True)
    (data_dir / "results.json").write_text(json.dumps({"environments": envs, "sections": sections},
                                                      indent=1, default=str))
    print(f"wrote {args.out} and {data_dir / 'results.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
