"""Prefix cache: time to first token and throughput on a shared system prompt, cache on vs off.

    python3 bench/prefix_cache_bench.py --out .bench/prefix         # H200, under 90 s
    python3 bench/prefix_cache_bench.py --smoke                     # CPU, tiny shapes, seconds

The engine's Runner (CUDA graphs captured, the Triton attention backend) on the Llama-3.1-8B
shape with random bfloat16 weights and a random EAGLE-3 head (chain: 3 steps, topk 1), driven
the way the scheduler drives it (admit while there is room, then step). Prompts are a shared
system prompt of 4096 random tokens followed by a question of 16..96 random tokens; outputs
run to max_tokens (no stop token). Three measurements, each with the cache on and off:

    ttft        one request at a time on an idle engine, after one request with the same system
                prompt (and another question) has finished: add() to the first token. Each side
                twice: with the graphs of short prefill chunks (a hit's remainder, extend_graphs.py)
                replayed, and with them switched off (every chunk eager), side by side.
                Goal: with the cache (and those graphs, the engine's default) >= 10x lower.
    shared      `requests` requests with the same system prompt submitted at once, up to
                `running` in the batch: output tokens per second over the whole run, and the
                median time from submission to first token. Goal: never lower with the cache.
    unique      the same with a different random "system prompt" per request (no hit can happen):
                what the cache's bookkeeping costs when it never helps. Goal: never lower.

shared and unique run `rounds` times, cache off then on in each round (a fresh system prompt, or
fresh prompts, per round: the same for both sides of a round); each side's record is its
median round's (by tok/s), and the ratio is on's median tok/s over off's.

Greedy outputs are compared between the two runs of each workload: equal in float32 (the
tests prove it); in bfloat16 a cached K/V was computed in another forward (another batch
composition, other roundings), so an output may drift after a near-tie, as it may under any
change of batching. The JSON goes to <out>/prefix_cache.json; a table is printed last.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # works under python3 -P too

from common import (LLAMA_31_8B, TINY_LLAMA, bootstrap_specdeploy, environment, log, sync,  # noqa: E402
                    write_json)

bootstrap_specdeploy()

import torch  # noqa: E402

from harness import eagle3_head_config, random_head, random_target, use_fast_attention  # noqa: E402
from specdeploy.engine.runtime.runner import NoCapacity, Request, Runner  # noqa: E402
from specdeploy.engine.planner.plan import SpecSettings  # noqa: E402

PROFILES = {
    "device": {"config": LLAMA_31_8B, "system_tokens": 4096, "question_tokens": (16, 96), "max_tokens": 64,
               "ttft_reps": 6, "requests": 24, "running": 16, "draft_vocab": 32000, "graph_batches": (1, 2, 4, 8, 16),
               "rounds": 3},
    "smoke": {"config": TINY_LLAMA, "system_tokens": 256, "question_tokens": (4, 12), "max_tokens": 8,
              "ttft_reps": 2, "requests": 6, "running": 3, "draft_vocab": 128, "graph_batches": (1, 2, 3),
              "rounds": 2},
}
SHAPE = (3, 1, 4)   # EAGLE-3 chain: steps, topk, draft tokens


def make_runner(target, head, p: dict, cache: bool, device) -> Runner:
    longest = p["system_tokens"] + p["question_tokens"][1] + p["max_tokens"]
    # Room for every running request plus about as much again for the cache to keep.
    slots = 2 * p["running"] * (longest + 16) + 2 * longest
    return Runner(target, head, SpecSettings("EAGLE3", *SHAPE), max_total_tokens=slots,
                  max_running_requests=p["running"], context_length=longest + 16, device=device,
                  cuda_graph_batch_sizes=p["graph_batches"],
                  graph_mode="capture" if device.type == "cuda" else "padded", prefix_cache=cache,
                  extend_graphs=True)


def prompts(p: dict, n: int, shared: bool, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    vocab = p["config"]["vocab_size"]
    system = torch.randint(3, vocab, (p["system_tokens"],), generator=gen).tolist()
    out = []
    for _ in range(n):
        head = system if shared else torch.randint(3, vocab, (p["system_tokens"],), generator=gen).tolist()
        q = int(torch.randint(p["question_tokens"][0], p["question_tokens"][1] + 1, (1,), generator=gen))
        out.append(head + torch.randint(3, vocab, (q,), generator=gen).tolist())
    return out


def drive(runner: Runner, reqs: list[Request]) -> dict:
    """Submit all at t = 0, admit in order while there is room, step until done."""
    t0 = time.perf_counter()
    queue, first_s, tokens = list(reqs), {}, {r.id: [] for r in reqs}
    cached = {}
    while queue or runner.num_running:
        while queue:
            try:
                runner.add(queue[0])
            except NoCapacity:
                break
            queue.pop(0)
        for o in runner.step():
            if o.req_id not in first_s:
                first_s[o.req_id] = time.perf_counter() - t0
                cached[o.req_id] = o.num_cached_tokens
            tokens[o.req_id] += o.token_ids
    sync(runner.device)
    wall_s = time.perf_counter() - t0
    n_out = sum(len(t) for t in tokens.values())
    return {"wall_s": wall_s, "output_tokens": n_out, "tok_s": n_out / wall_s,
            "ttft_median_ms": 1e3 * statistics.median(first_s.values()),
            "cached_tokens": sum(cached.values()), "prompt_tokens": sum(len(r.prompt_ids) for r in reqs),
            "tokens": tokens}


def median_record(records: list[dict]) -> dict:
    """The record of the round with the median tok/s (the lower middle of an even count)."""
    return sorted(records, key=lambda r: r.get("tok_s", 0.0))[(len(records) - 1) // 2]


def ttft(runner: Runner, p: dict, seed: int, extend_graphs: bool) -> dict:
    """Idle engine, one request at a time: add() to the first token (the prefill step); the
    graphs of short prefill chunks replayed or not. Two output tokens per request (only the
    first is timed)."""
    runner.use_extend_graphs = extend_graphs and runner.extend_graphs is not None
    replays = runner.extend_graphs.replays if runner.extend_graphs is not None else 0
    texts = prompts(p, p["ttft_reps"] + 1, shared=True, seed=seed)
    drive(runner, [Request("warm", texts[0], 2)])   # caches the system prompt (when on)
    times, cached, firsts = [], [], []
    for i, prompt in enumerate(texts[1:]):
        sync(runner.device)
        t0 = time.perf_counter()
        runner.add(Request(f"t{i}", prompt, 2))
        out = runner.step()                                          # prefill: the first token
        sync(runner.device)
        times.append(1e3 * (time.perf_counter() - t0))
        cached.append(out[0].num_cached_tokens)
        firsts.append(out[0].token_ids)
        while runner.num_running:
            runner.step()
    runner.use_extend_graphs = runner.extend_graphs is not None
    return {"ttft_median_ms": statistics.median(times), "ttft_ms": times, "cached_tokens": cached,
            "first_tokens": firsts, "extend_graphs": extend_graphs,
            "extend_graph_replays": (runner.extend_graphs.replays - replays) if runner.extend_graphs else 0}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny shapes")
    parser.add_argument("--out", type=Path, default=Path(".bench/prefix"))
    parser.add_argument("--render", type=Path, metavar="JSON",
                        help="rewrite a recorded prefix_cache.json self-describing, with its .md beside it")
    args = parser.parse_args()
    if args.render:
        import json

        results = describe(json.loads(args.render.read_text()))
        args.render.write_text(json.dumps(results, indent=1) + "\n")
        args.render.with_suffix(".md").write_text(f"# {results['title']}\n\n" + markdown(results) + "\n")
        return 0
    t_start = time.perf_counter()
    p = PROFILES["smoke" if args.smoke else "device"]
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    backend = use_fast_attention() if device.type == "cuda" else "reference"
    t0 = time.perf_counter()
    target = random_target(p["config"], device, torch.bfloat16)
    head = random_head("EAGLE3", eagle3_head_config(p["config"], p["draft_vocab"]), target)
    log(f"models built in {time.perf_counter() - t0:.1f} s ({device}, attention {backend})")

    # One runner per side for all three workloads (graph capture once each), each warmed up
    # first: every kernel (prefill with and without a cached prefix, decode, the speculative
    # step) is compiled before anything is timed. The cache side carries what earlier workloads
    # left (other system prompts): later ones evict it as a long-running server would.
    t0 = time.perf_counter()
    runners = {cache: make_runner(target, head, p, cache, device) for cache in (False, True)}
    for runner in runners.values():
        drive(runner, [Request(f"w{i}", t, 4) for i, t in enumerate(prompts(p, 3, True, seed=0))])
    log(f"runners built, graphs captured and warmed up in {time.perf_counter() - t0:.1f} s")

    results = {"environment": environment(), "profile": {k: v for k, v in p.items() if k != "config"},
               "shape": SHAPE, "attention": backend}
    t_run = time.perf_counter()

    def workload(tag: str, shared: bool, seed: int):
        return lambda r: drive(r, [Request(f"{tag}{i}", t, p["max_tokens"]) for i, t in
                                   enumerate(prompts(p, p["requests"], shared, seed=seed))])

    for name, fns in (("ttft", [lambda r: ttft(r, p, seed=1, extend_graphs=True)]),
                      ("ttft_no_extend_graphs", [lambda r: ttft(r, p, seed=4, extend_graphs=False)]),
                      ("shared", [workload("s", True, 2 + 10 * i) for i in range(p["rounds"])]),
                      ("unique", [workload("u", False, 3 + 10 * i) for i in range(p["rounds"])])):
        rounds = []
        for i, fn in enumerate(fns):  # each round: off, then on, over the same prompts
            rec = {}
            for cache in (False, True):
                rec["on" if cache else "off"] = fn(runners[cache])
                log(f"{name}{f' round {i + 1}' if len(fns) > 1 else ''} cache {'on ' if cache else 'off'}: "
                    + ", ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}"
                                for k, v in rec["on" if cache else "off"].items() if not isinstance(v, (dict, list))))
            rounds.append(rec)
        outputs = "first_tokens" if name.startswith("ttft") else "tokens"
        pairs = []
        for rec in rounds:
            on, off = rec["on"].pop(outputs), rec["off"].pop(outputs)
            pairs += list(zip(on, off)) if name.startswith("ttft") else [(on[k], off[k]) for k in off]
        row = {side: median_record([rec[side] for rec in rounds]) for side in ("off", "on")}
        if len(rounds) > 1:
            row["rounds"] = [{side: rec[side]["tok_s"] for side in ("off", "on")} for rec in rounds]
        row["requests_with_equal_outputs"] = sum(a == b for a, b in pairs)
        row["requests"] = len(pairs)
        results[name] = row

    t, s, u = results["ttft"], results["shared"], results["unique"]
    t0_ = results["ttft_no_extend_graphs"]
    for row in (t, t0_):
        row["speedup"] = row["off"]["ttft_median_ms"] / row["on"]["ttft_median_ms"]
    t["goal_met"] = t["speedup"] >= 10
    for row in (s, u):
        row["throughput_ratio"] = row["on"]["tok_s"] / row["off"]["tok_s"]
        row["goal_met"] = row["throughput_ratio"] >= 0.98   # "never lower", within timing noise
    results["goals"] = {
        "ttft_hit_vs_miss": {"goal": 10, "measured": t["speedup"], "met": t["goal_met"],
                             "without_extend_graphs": t0_["speedup"]},
        "shared_throughput_ratio": {"goal": 0.98, "measured": s["throughput_ratio"], "met": s["goal_met"]},
        "unique_throughput_ratio": {"goal": 0.98, "measured": u["throughput_ratio"], "met": u["goal_met"]}}
    results["measure_wall_s"] = time.perf_counter() - t_run
    results["total_wall_s"] = total = time.perf_counter() - t_start   # models built to results (H200 goal < 90 s)
    results["goals"]["total_wall_s"] = {"goal": 90, "measured": total, "met": total < 90}
    describe(results)
    write_json("prefix_cache.json", results, args.out)
    if args.out:
        (Path(args.out) / "prefix_cache.md").write_text(f"# {results['title']}\n\n" + markdown(results) + "\n")
    print("\nSUMMARY (prefix cache: off -> on)")
    for label, row in (("short-chunk graphs on ", t), ("short-chunk graphs off", t0_)):
        print(f"  TTFT on a hit, {p['system_tokens']}-token system prompt, {label}: {row['off']['ttft_median_ms']:.1f}"
              f" -> {row['on']['ttft_median_ms']:.1f} ms ({row['speedup']:.1f}x), cached "
              f"{row['on']['cached_tokens'][0]} tokens, replays {row['on']['extend_graph_replays']}")
    print(f"  TTFT goal >= 10x lower (graphs on): {'met' if t['goal_met'] else 'MISSED'}")
    for label, row in (("shared system prompt", s), ("unique prompts", u)):
        print(f"  {label}, {p['requests']} requests, {p['running']} running: {row['off']['tok_s']:.1f} -> "
              f"{row['on']['tok_s']:.1f} output tok/s (x{row['throughput_ratio']:.2f}; never lower: "
              f"{'met' if row['goal_met'] else 'MISSED'}), median TTFT {row['off']['ttft_median_ms']:.0f} -> "
              f"{row['on']['ttft_median_ms']:.0f} ms, hit rate "
              f"{row['on']['cached_tokens'] / row['on']['prompt_tokens']:.1%}")
    print("  requests with equal greedy outputs, cache on vs off: " + ", ".join(
        f"{k} {results[k]['requests_with_equal_outputs']}/{results[k]['requests']}"
        for k in ("ttft", "ttft_no_extend_graphs", "shared", "unique")))
    print("\nMARKDOWN (for docs/benchmarks.md)\n" + markdown(results))
    return 0


GOAL_FIGURES = {  # the JSON's goals as bench/report.py's Goals table names them
    "ttft_hit_vs_miss": "prefix-hit TTFT, times lower than a miss (8B shape, EAGLE-3, short-chunk graphs)",
    "shared_throughput_ratio": "output tok/s, prefix cache on / off, shared system prompt",
    "unique_throughput_ratio": "output tok/s, prefix cache on / off, unique prompts",
}


def describe(results: dict) -> dict:
    """Make the record self-describing for bench/report.py: script, title, command, environment,
    and figure names on the product goals (the run-time cap stays out of the Goals table)."""
    results.update(script="bench/prefix_cache_bench.py", command="python3 bench/prefix_cache_bench.py --out OUT",
                   title="Prefix cache: hit vs miss TTFT, and throughput with shared and unique prompts (issue 32)",
                   environment=results.pop("env", None) or results["environment"])  # "env": records before 2026-12-02
    goals = results.get("goals", {})
    if "total_wall_s" in goals:  # describing twice keeps it
        results["run_time_goal"] = goals.pop("total_wall_s")
    for key, figure in GOAL_FIGURES.items():
        if key in goals:
            goals[key].update(figure=figure, unit="x")
    return results


def markdown(results: dict) -> str:
    p = results["profile"]
    t, s, u = results["ttft"], results["shared"], results["unique"]
    env = results["environment"]
    t0_ = results["ttft_no_extend_graphs"]
    rows = [f"| TTFT, one request on an idle engine | {t['off']['ttft_median_ms']:.1f} ms | "
            f"{t['on']['ttft_median_ms']:.1f} ms | {t['speedup']:.1f}x lower | >= 10x lower: "
            f"{'met' if t['goal_met'] else 'missed'} |",
            f"| the same, short-chunk graphs off | {t0_['off']['ttft_median_ms']:.1f} ms | "
            f"{t0_['on']['ttft_median_ms']:.1f} ms | {t0_['speedup']:.1f}x lower | (comparison) |"]
    for label, row in (("shared system prompt", s), ("unique prompts (no hit possible)", u)):
        rows.append(f"| output tok/s, {label} | {row['off']['tok_s']:.0f} | {row['on']['tok_s']:.0f} | "
                    f"x{row['throughput_ratio']:.2f} (hit rate {row['on']['cached_tokens'] / row['on']['prompt_tokens']:.0%}, "
                    f"median TTFT {row['off']['ttft_median_ms']:.0f} -> {row['on']['ttft_median_ms']:.0f} ms) | "
                    f"never lower: {'met' if row['goal_met'] else 'missed'} |")
    return "\n".join([
        f"{'Llama-3.1-8B shape' if env['device'] != 'cpu' else 'Tiny Llama (--smoke)'}, random bfloat16 "
        f"weights, EAGLE-3 chain {SHAPE}, {'CUDA graphs' if env['device'] != 'cpu' else 'no graphs (CPU)'}, "
        f"attention {results['attention']}; {env['device']}, torch {env['torch']}. System prompt {p['system_tokens']} "
        f"tokens + a question of {p['question_tokens'][0]}-{p['question_tokens'][1]} tokens, {p['max_tokens']} "
        f"output tokens; throughput: {p['requests']} requests at once, {p['running']} running"
        + (f", the median of {p['rounds']} rounds, cache off then on in each" if p.get("rounds", 1) > 1 else "")
        + " (`python3 bench/prefix_cache_bench.py`).", "",
        "| measure | cache off | cache on | change | goal |", "|---|---|---|---|---|", *rows, "",
        "Requests whose greedy output is the same with the cache on and off: " + ", ".join(
            f"{k} {results[k]['requests_with_equal_outputs']}/{results[k]['requests']}"
            for k in ("ttft", "ttft_no_extend_graphs", "shared", "unique") if k in results)
        + ". The TTFT rows compare first tokens; the throughput rows whole 64-token outputs, in bf16 on random "
        "weights, whose next-token distributions are flat: a prefix's KV read back from the cache was computed in "
        "another chunking than a recomputed one, rounds differently, and a long output parts at the first near tie. "
        "Cache on equals cache off token for token in float32 (tests/gpu/test_prefix_cache_gpu.py, "
        "tests/gpu/test_extend_graphs_gpu.py)."])


if __name__ == "__main__":
    sys.exit(main())
