"""DeepSeek-V4 FP4 routed experts: the fused FP4 grouped GEMM (engine/kernels/fp4_moe.py) against
bf16 experts and the dequantizing FP4 path, one MoE layer's routed experts at V4-Flash's shapes
(256 experts, hidden 4096, intermediate 2048, 6 per token; manifests/models/deepseek-v4-flash).

    python3 bench/fp4_moe_bench.py --out RESULTS_DIR          # < 90 s on an H200
    python3 bench/fp4_moe_bench.py --smoke --out RESULTS_DIR  # CPU, tiny shapes (TRITON_INTERPRET=1
                                                              # for the kernel), the code path only

Per batch 1, 2, 4, 8, 16, 32, 64 (rows = batch x 6): _Experts.forward captured in a CUDA graph,
each replay running SETS routings of random tokens and experts in turn (consecutive calls hit
other experts, so the 60 MB L2 holds no weights between them), median ms per call:
    bf16        bf16 weights, torch's grouped_mm
    fp4_old     FP4 codes dequantized to bf16 each call (engine/kernels/fp4.py) then gathered /
                grouped matmuls (FP4_FUSED_MOE off)
    fp4_fused   the fused kernel with choose_config's table and gathered_map's tile map (what the
                engine runs); map_ms: both tile maps with the table's configs; and each
                config of SWEEP (or --configs) for both projections (the sweep; its best too,
                each config's largest difference from the table's output relative to its
                largest value, sweep_rel_diff: ~1e-2 at most for a correct config, and any
                config that fails, sweep_errors, without stopping the run)
Ratios bf16 / fp4 (above 1: FP4 faster), the fraction of the FP4 weight-bytes roofline (codes
and scales of the experts a call hits, over the copy bandwidth measured in this run) and the
goals: fused FP4 >= 1.3x bf16 at batch 1 and >= 1.0x at every batch. Writes fp4_moe.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import bootstrap_specdeploy  # noqa: E402

bootstrap_specdeploy()

import torch  # noqa: E402

from common import (REPO_ROOT, argv_command, copy_bandwidth_bytes_per_s, environment, free_device_memory,  # noqa: E402
                    graph_replay_ms, log, time_ms, write_json)

import specdeploy.engine.models.deepseek_v4 as v4mod  # noqa: E402
from specdeploy.engine.kernels import fp4_moe  # noqa: E402
from specdeploy.engine.models.deepseek_v4 import V4ModelConfig, _Experts  # noqa: E402
from specdeploy.engine.models.fp8 import E2M1_VALUES, FP4_GROUP  # noqa: E402

FLASH = REPO_ROOT / "manifests" / "models" / "deepseek-v4-flash" / "config.json"
BATCHES = (1, 2, 4, 8, 16, 32, 64)
SIZES = {
    "device": dict(batches=BATCHES, sets=8, warmup=2, reps=10, device="cuda"),
    "smoke": dict(batches=(1, 3), sets=2, warmup=1, reps=2, device="cpu"),
}
GOALS = {"fp4_over_bf16_batch1": 1.3, "fp4_over_bf16_min_1_64": 1.0}
# The sweep stops starting configs after this many seconds of the run (the whole run: < 90 s).
SWEEP_BUDGET_S = 70.0
# The configs swept by default (each compiles its variants on first use): the decode shapes of
# each weight-building variant (Triton / inline PTX, scales on the weights / per group) and one
# prefill shape; --configs names others of fp4_moe.CONFIGS.
SWEEP = ("m16n32k128", "m16n64k128", "m16n32k128g", "m16n64k128g", "m16n32k128p", "m16n64k128p",
         "m16n32k128gp", "m16n64k128gp", "m16n64k256gp", "m32n64k128")


def flash_config(smoke: bool) -> dict:
    c = json.loads(FLASH.read_text())
    c.pop("quantization_config", None)
    if smoke:
        c.update(hidden_size=64, moe_intermediate_size=64, n_routed_experts=8)
    return c


def experts(cfg: V4ModelConfig, quant: str | None, device: str, seed: int) -> _Experts:
    """A layer's routed experts, random, allocated on `device` directly (no CPU copy)."""
    with torch.device("meta"):
        m = _Experts(cfg).to(torch.bfloat16)
        if quant:
            m.quantize(quant)
    m = m.to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    if quant:
        pairs = [(E2M1_VALUES[b & 0xF], E2M1_VALUES[b >> 4]) for b in range(256)]
        m.e2m1_pairs.copy_(torch.tensor(pairs, dtype=torch.float32))
        for name in ("gate_up_proj", "down_proj"):
            getattr(m, name).random_(-128, 128, generator=gen)
            getattr(m, name + "_scale").random_(118, 124, generator=gen)
    else:
        for name in ("gate_up_proj", "down_proj"):
            getattr(m, name).normal_(0.0, 0.02, generator=gen)
    return m


def fp4_bytes(cfg: V4ModelConfig, unique_experts: float) -> float:
    """Codes and scales of `unique_experts` experts, both projections."""
    weights = 3 * cfg.moe_intermediate_size * cfg.hidden_size
    return unique_experts * weights * (0.5 + 1 / FP4_GROUP)


def routings(cfg: V4ModelConfig, batch: int, sets: int, device: str, seed: int) -> list[tuple]:
    gen = torch.Generator(device=device).manual_seed(seed)
    e, k = cfg.num_experts, cfg.num_experts_per_tok
    out = []
    for _ in range(sets):
        x = torch.randn(batch, cfg.hidden_size, device=device, generator=gen).to(torch.bfloat16)
        idx = torch.rand(batch, e, device=device, generator=gen).topk(k, dim=-1).indices
        w = torch.rand(batch, k, device=device, generator=gen).to(torch.bfloat16)
        out.append((x, idx, w))
    return out


def call_ms(calls: list, size: dict) -> float:
    """Median ms of one call of `calls` (a CUDA graph of them all on CUDA, eager on CPU)."""
    if size["device"] == "cuda":
        return graph_replay_ms(calls, "cuda", warmup=size["warmup"], reps=size["reps"]) / len(calls)
    return time_ms(lambda: [c() for c in calls], "cpu", warmup=size["warmup"], reps=size["reps"])["median_ms"] / len(calls)


def fused_calls(m: _Experts, sets: list, configs: tuple[str, str] | None, gathered: bool | None = None) -> list:
    up, down = (m.gate_up_proj, m.gate_up_proj_scale), (m.down_proj, m.down_proj_scale)
    return [lambda x=x, idx=idx, w=w: fp4_moe.fp4_moe(x, idx, w, up, down, limit=m.limit or None, configs=configs,
                                                       gathered=gathered)
            for x, idx, w in sets]


GOAL_FIGURES = {"fp4_over_bf16_batch1": "FP4 / bf16 routed experts at batch 1 (V4-Flash shapes, fused FP4 GEMM)",
                "fp4_over_bf16_min_1_64": "FP4 / bf16 routed experts, worst batch of 1-64 (V4-Flash shapes)"}


def goals_of(ratios: dict) -> dict:
    """The JSON's goals, in the self-describing form bench/report.py reads."""
    measured = {"fp4_over_bf16_batch1": ratios.get(1), "fp4_over_bf16_min_1_64": min(ratios.values()) if ratios else None}
    return {k: {"figure": GOAL_FIGURES[k], "goal": g, "measured": measured[k], "unit": "x",
                "met": measured[k] is not None and measured[k] >= g} for k, g in GOALS.items()}


def record(rows, args, cfg, size, bw, started, skipped, errors) -> dict:
    rows = [row for row, _ in rows]
    return {
        "script": "bench/fp4_moe_bench.py",
        "title": "DeepSeek-V4-Flash FP4 routed experts: fused FP4 grouped GEMM vs bf16 and dequantizing FP4 (issue 32)",
        "command": argv_command(), "environment": environment(), "smoke": args.smoke,
        "shapes": {"experts": cfg.num_experts, "hidden": cfg.hidden_size, "intermediate": cfg.moe_intermediate_size,
                   "per_token": cfg.num_experts_per_tok, "routing_sets_per_replay": size["sets"]},
        "copy_bandwidth_bytes_per_s": bw, "configs": {k: c._asdict() for k, c in fp4_moe.CONFIGS.items()},
        "config_table": fp4_moe.CONFIG_TABLE, "rows": rows,
        "goals": goals_of({r["batch"]: r["bf16_over_fp4_fused"] for r in rows}),
        "goals_source": "the engine's path (_Experts.forward with the table's configs)",
        "sweep_skipped": skipped, "sweep_errors": errors, "wall_s": time.time() - started}


def markdown(result: dict) -> str:
    """A title line, then the per-batch table (ms) and the goals' source."""
    rows = result["rows"]
    configs = sorted({c for r in rows for c in (r.get("sweep_ms") or {})})
    head = ["batch", "rows", "bf16 ms", "FP4 dequantize + grouped ms", "fused FP4 (engine) ms", "fused / bf16",
            "% of FP4 roofline", "map", "a tile per row ms", "sorted by expert ms"] + [f"sweep {c}" for c in configs]
    lines = [f"# {result['title']}", "",
             f"{result['shapes']['experts']} experts of [{2 * result['shapes']['intermediate']}, "
             f"{result['shapes']['hidden']}] gate/up and [{result['shapes']['hidden']}, "
             f"{result['shapes']['intermediate']}] down, {result['shapes']['per_token']} per token, one MoE layer's "
             "routed experts as CUDA-graph replays over "
             f"{result['shapes']['routing_sets_per_replay']} routings (weights defeat the L2); medians. Goals read "
             f"from {result['goals_source']}.", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        frac = r.get("fp4_fused_roofline_fraction")
        cells = [r["batch"], r["rows"], f"{r['bf16_ms']:.3f}", f"{r['fp4_old_ms']:.3f}", f"{r['fp4_fused_ms']:.3f}",
                 f"{r['bf16_over_fp4_fused']:.2f}×", f"{100 * frac:.0f}%" if frac else "—", r.get("table_map", "—")]
        cells += [f"{r['map_ms'][m]:.3f}" if "map_ms" in r else "—" for m in ("gathered", "grouped")]
        cells += [f"{r['sweep_ms'][c]:.3f}" if c in (r.get("sweep_ms") or {}) else "—" for c in configs]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines) + "\n"


def render(path: Path) -> None:
    """Rewrite a recorded fp4_moe.json self-describing, with fp4_moe.md beside it. A record made
    under an earlier config table whose sweep timed the config the table names now for every
    batch takes its goals from those sweep rows (the same launches, the same run), and says so."""
    import json

    result = json.loads(path.read_text())
    now = [list(x) for x in fp4_moe.CONFIG_TABLE]
    if [list(x) for x in result.get("config_table", [])] != now:
        picks = {r["batch"]: fp4_moe.choose_config(r["rows"], 1, 1, result["shapes"]["experts"]) for r in result["rows"]}
        if all(picks[r["batch"]] in (r.get("sweep_ms") or {}) for r in result["rows"]):
            for r in result["rows"]:
                r["fp4_fused_ms_recorded"] = r["fp4_fused_ms"]
                r["fp4_fused_ms"] = r["sweep_ms"][picks[r["batch"]]]
                r["bf16_over_fp4_fused"] = r["bf16_ms"] / r["fp4_fused_ms"]
                if r.get("fp4_roofline_ms"):
                    r["fp4_fused_roofline_fraction"] = r["fp4_roofline_ms"] / r["fp4_fused_ms"]
            result["goals_source"] = (f"the sweep's rows of the configs the table names now ({sorted(set(picks.values()))}); "
                                      f"the run's own table was {result.get('config_table')}")
            result["config_table"] = fp4_moe.CONFIG_TABLE
    result.update(script="bench/fp4_moe_bench.py", goals=goals_of({r["batch"]: r["bf16_over_fp4_fused"] for r in result["rows"]}))
    result["title"] = result.get("title", "").removesuffix(" (issue 32)") + " (issue 32)"
    result.setdefault("goals_source", "the engine's path (_Experts.forward with the table's configs)")
    path.write_text(json.dumps(result, indent=1) + "\n")
    path.with_suffix(".md").write_text(markdown(result))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shapes: the code path only")
    ap.add_argument("--out", type=Path, default=Path(".bench"))
    ap.add_argument("--no-sweep", action="store_true", help="the table's config only")
    ap.add_argument("--configs", default=",".join(SWEEP), help="the configs to sweep, comma-separated")
    ap.add_argument("--render", type=Path, metavar="JSON", help="rewrite a recorded fp4_moe.json self-describing, "
                    "with its .md (goals for the current config table where its sweep timed it)")
    args = ap.parse_args()
    if args.render:
        return render(args.render)
    sweep = args.configs.split(",")
    if not set(sweep) <= set(fp4_moe.CONFIGS):
        sys.exit(f"unknown configs {sorted(set(sweep) - set(fp4_moe.CONFIGS))}; known: {list(fp4_moe.CONFIGS)}")
    size = SIZES["smoke" if args.smoke else "device"]
    dev = size["device"]
    if dev == "cuda" and not torch.cuda.is_available():
        sys.exit("needs CUDA (or --smoke)")
    started = time.time()
    cfg = V4ModelConfig.from_hf(flash_config(args.smoke))
    bw = copy_bandwidth_bytes_per_s(device=dev) if dev == "cuda" else None
    bf16 = experts(cfg, None, dev, seed=1)
    fp4 = experts(cfg, "fp4", dev, seed=2)
    log(f"experts: {cfg.num_experts} x ({2 * cfg.moe_intermediate_size} x {cfg.hidden_size} + "
        f"{cfg.hidden_size} x {cfg.moe_intermediate_size}), {cfg.num_experts_per_tok} per token"
        + (f"; copy bandwidth {bw / 1e12:.2f} TB/s" if bw else ""))
    rows = []
    saved = v4mod.FP4_FUSED_MOE
    for batch in size["batches"]:
        sets = routings(cfg, batch, size["sets"], dev, seed=batch)
        unique = sum(idx.unique().numel() for _, idx, _ in sets) / len(sets)
        row = {"batch": batch, "rows": batch * cfg.num_experts_per_tok, "unique_experts": unique}
        with torch.no_grad():
            row["bf16_ms"] = call_ms([lambda s=s: bf16(*s) for s in sets], size)
            v4mod.FP4_FUSED_MOE = False
            try:
                row["fp4_old_ms"] = call_ms([lambda s=s: fp4(*s) for s in sets], size)
            finally:
                v4mod.FP4_FUSED_MOE = saved
            row["fp4_fused_ms"] = call_ms([lambda s=s: fp4(*s) for s in sets], size)  # through _Experts
            r, e, h, i = row["rows"], cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
            row["table_configs"] = [fp4_moe.choose_config(r, i, h, e), fp4_moe.choose_config(r, h, i, e)]
            row["table_map"] = "gathered" if fp4_moe.gathered_map(r, e) else "grouped"
            # both tile maps with the table's configs (fp4_moe.gathered_map's rule comes from these)
            row["map_ms"] = {name: call_ms(fused_calls(fp4, sets, None, gathered=name == "gathered"), size)
                             for name in ("gathered", "grouped")}
        row["bf16_over_fp4_old"] = row["bf16_ms"] / row["fp4_old_ms"]
        row["bf16_over_fp4_fused"] = row["bf16_ms"] / row["fp4_fused_ms"]
        if bw:
            row["fp4_roofline_ms"] = fp4_bytes(cfg, unique) / bw * 1e3
            row["fp4_fused_roofline_fraction"] = row["fp4_roofline_ms"] / row["fp4_fused_ms"]
        log(f"bs={batch:<3} bf16 {row['bf16_ms']:.3f} ms, fp4 old {row['fp4_old_ms']:.3f} ms, fused "
            f"{row['fp4_fused_ms']:.3f} ms ({row['table_map']}; maps: gathered {row['map_ms']['gathered']:.3f}, "
            f"grouped {row['map_ms']['grouped']:.3f} ms) ({row['bf16_over_fp4_fused']:.2f}x bf16"
            + (f", {row['fp4_fused_roofline_fraction']:.0%} of roofline" if bw else "") + ")")
        rows.append((row, sets))
        free_device_memory()
    skipped, errors = [], []
    # the goals' figures are on disk before the sweep starts (a time cap may cut the sweep)
    write_json("fp4_moe.json", record(rows, args, cfg, size, bw, started, skipped, errors), args.out)
    for row, sets in rows:  # the sweep, within the time budget (the goals' figures come first)
        if args.no_sweep:
            break
        row["sweep_ms"], row["sweep_rel_diff"] = {}, {}
        table_calls = fused_calls(fp4, sets, None)
        for c in sweep:
            if dev == "cuda" and time.time() - started > SWEEP_BUDGET_S:  # smoke: every config asked
                skipped.append((row["batch"], c))
                continue
            try:
                with torch.no_grad():
                    calls = fused_calls(fp4, sets, (c, c))
                    # agreement with the table's configs on the first routing (a wrong config shows here)
                    ref, got = table_calls[0]().float(), calls[0]().float()
                    row["sweep_rel_diff"][c] = float((got - ref).abs().max() / ref.abs().max().clamp(min=1e-30))
                    row["sweep_ms"][c] = call_ms(calls, size)
            except Exception as err:  # a config that fails to compile or run: recorded, the sweep goes on
                errors.append({"batch": row["batch"], "config": c, "error": f"{type(err).__name__}: {err}"[:500]})
                log(f"bs={row['batch']:<3} {c} failed: {errors[-1]['error'][:200]}")
        if row["sweep_ms"]:
            best = min(row["sweep_ms"], key=row["sweep_ms"].get)
            row["best_config"], row["fp4_best_ms"] = best, row["sweep_ms"][best]
            row["bf16_over_fp4_best"] = row["bf16_ms"] / row["fp4_best_ms"]
            log(f"bs={row['batch']:<3} sweep: " + ", ".join(f"{c} {ms:.3f}" for c, ms in row["sweep_ms"].items())
                + f" ms; best {best} ({row['bf16_over_fp4_best']:.2f}x bf16)")
    result = record(rows, args, cfg, size, bw, started, skipped, errors)
    write_json("fp4_moe.json", result, args.out)
    (args.out / "fp4_moe.md").write_text(markdown(result))
    for k, g in result["goals"].items():
        log(f"goal {k}: {g['measured']:.2f} (goal {g['goal']}) {'met' if g['met'] else 'NOT met'}")


if __name__ == "__main__":
    main()
