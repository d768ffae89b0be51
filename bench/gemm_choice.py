"""Choosing the FP8 block-scaled GEMM: every candidate, maintained libraries and the project's own
kernels, timed side by side at the Llama-3.1-8B linears in one run, each checked against the
dequantized weights; which one fp8_linear should take per M (engine/kernels/fp8.py BLOCK_ROUTE).

    python3 bench/gemm_choice.py --out DIR          # CUDA SM90 (H200), < 2 min
    python3 bench/gemm_choice.py --smoke --out DIR  # one shape, two M, seconds
    python3 bench/gemm_choice.py --render DIR/gemm_choice.json  # its gemm_choice.md again (CPU)

Candidates (weights FP8 e4m3 with 128 x 128 block scales, activations quantized per 1 x 128
group by the project's `act_quant`, counted in every W8A8 column):
- `bf16`: cuBLAS on bf16 weights, the bar;
- `gemv`: the project's small-M kernel (M <= 16; weight-only except its dot8/wg8 launches);
- `w8a8`: the project's Triton W8A8 kernel (pointer loads, one program per tile);
- `torch_block`: `torch.nn.functional.scaled_mm` with BlockWise1x128 / BlockWise128x128
  (cuBLASLt); `torch_block_private`: the same through `torch._scaled_mm` (scales by shape);
- `deep_gemm`: DeepGEMM's dense FP8 NT GEMM (`deep_gemm.fp8_gemm_nt`), as the engine calls it
  (`block_library_linear`), where installed and its probe passes;
- `flashinfer`: FlashInfer's block-scaled GEMM, where installed (`fp8_blockscale_gemm_sm90` on
  SM90: `gemm_fp8_nt_groupwise` requires SM100/103/120/121);
- `engine`: `fp8_linear` as the engine calls it (BLOCK_ROUTE as committed).
A candidate that is not installed, or refuses the problem, is logged once and recorded under
"unavailable" / per-row errors, never dropped silently. Each figure is one layer timed as a
CUDA graph of back-to-back calls over enough weight copies to exceed the L2 (what a graphed step
sees): so every candidate is also checked to capture. Correctness: relative L2 distance of each
output to float32 x @ W^T over the dequantized weights, under `tolerance` (below).
Writes gemm_choice.json: environment, per-layer microseconds and errors, the step's linears
(4 layers x 32) per M and option, per-M winners and the BLOCK_ROUTE they imply, and its goals in
the form bench/report.py reads ({"figure", "goal", "measured", "unit", "better"}); and beside it
gemm_choice.md, a title line and the step's linears per M and option as a markdown table (the
section docs/benchmarks.md shows for it). `--render` writes that .md again from a JSON, earlier
runs' included.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import bootstrap_specdeploy, environment, graph_replay_ms, log  # noqa: E402

bootstrap_specdeploy()

import torch  # noqa: E402

from specdeploy.engine.kernels import fp8 as kernels  # noqa: E402
from specdeploy.engine.kernels import gemv  # noqa: E402
from specdeploy.engine.models import fp8  # noqa: E402

LLAMA_8B_LINEARS = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
LAYERS = 32
ROWS = (1, 2, 4, 8, 16, 64, 256, 2048, 4096, 8192)
L2_MULTIPLE_BYTES = 384 << 20  # weight bytes per graph replay: several times the 50-60 MB L2
MAX_COPIES = 24
E4M3_HALF_ULP = 2.0**-4  # e4m3: 3 mantissa bits, relative rounding error <= 2^-4
BF16_HALF_ULP = 2.0**-9
FP32_EPS = 2.0**-24
# Options that are not block-scaled FP8 candidates for the route (the bar, the composite)
NOT_CANDIDATES = ("bf16", "engine")
# Route names of the candidates (engine/kernels/fp8.py BLOCK_OPTIONS); "triton" is w8a8's
ROUTE_NAME = {"gemv": "gemv", "torch_block": "torch_block", "deep_gemm": "deep_gemm", "w8a8": "triton"}


def tolerance(option: str, k: int, weight_only: bool | None = None) -> float:
    """Relative L2 bound of an option's output against the float32 product over the dequantized
    weights. Weight-only paths (gemv's fma/dot/dot16/wg16 launches; bf16 against its own
    unquantized weights) round once to bf16: 2^-9 relative, doubled for margin. W8A8 paths
    (gemv's dot8/wg8 launches too: they quantize x per 128-wide group as act_quant does) round
    every activation to e4m3 (relative error <= 2^-4 per element; the output's relative L2 is
    that bound when the errors line up, about 2^-4 / sqrt(3) when they do not), plus the output's
    bf16 rounding. Each adds float32 accumulation over K terms (K * 2^-24, a worst case)."""
    accumulate = k * FP32_EPS
    if weight_only if weight_only is not None else option in ("bf16", "gemv"):
        return 2 * BF16_HALF_ULP + accumulate
    return E4M3_HALF_ULP + BF16_HALF_ULP + accumulate


def _weight_only(option: str, n: int, k: int, m: int, dev) -> bool:
    """Whether the option's launch at this shape keeps activations unquantized."""
    if option == "gemv":
        return gemv.config_for("fp8", n, k, m, dev)[0] not in gemv.QUANTIZING_VARIANTS
    return option == "bf16"


def _optional(module: str):
    """(module, None) where importable, else (None, reason)."""
    try:
        return importlib.import_module(module), None
    except Exception as e:  # noqa: BLE001 - whatever keeps it from loading is the reason
        return None, f"{type(e).__name__}: {str(e)[:160]}"


def _flashinfer_call(fi):
    """FlashInfer's block-scaled GEMM for this device: on SM90 `fp8_blockscale_gemm_sm90`
    (TensorRT-LLM's kernel, JIT-built with nvcc unless flashinfer-jit-cache is installed; weight
    scales one per row and 128-wide K group, so the 128 x 128 grid is expanded once per weight,
    outside the timing); elsewhere `gemm_fp8_nt_groupwise` (its requirement lists SM100/103/120/121)."""
    sm90 = getattr(fi.gemm, "fp8_blockscale_gemm_sm90", None)
    if torch.cuda.get_device_capability() == (9, 0) and sm90 is not None:
        rows: dict = {}

        def call(x, w, s, y):
            if id(s) not in rows:
                rows[id(s)] = s.repeat_interleave(128, 0)[:w.shape[0]].contiguous()
            a, a_s = kernels.act_quant(x, column_major=True, pad_rows_to=4)
            m = x.shape[0]
            return sm90(a[:m], w, a_s[:m], rows[id(s)], out=y)
        return call
    gemm = fi.gemm.gemm_fp8_nt_groupwise

    def call(x, w, s, y):
        a, a_s = kernels.act_quant(x, column_major=True)
        return gemm(a, w, a_s.t(), s.t().contiguous(), scale_major_mode="MN", out=y, out_dtype=y.dtype)
    return call


def candidates(m: int, k: int, libraries: dict) -> dict:
    """option -> call(x, w, s, y) returning the output, for the options that have a kernel at M."""
    calls = {}
    if m <= gemv.GEMV_MAX_M:
        def gemv_call(x, w, s, y):
            gemv.launch(x, w, s, 128, None, y, *gemv.config_for("fp8", w.shape[0], k, m, x.device))
            return y
        calls["gemv"] = gemv_call
    calls["w8a8"] = lambda x, w, s, y: kernels._w8a8(x, w, s, 128, None, y, False)
    if libraries["torch_block"]:
        calls["torch_block"] = lambda x, w, s, y: kernels.torch_block_linear(x, w, s)

        def private(x, w, s, y):
            a, a_s = kernels.act_quant(x, column_major=True, pad_rows_to=kernels.TORCH_BLOCK_ROW_ALIGN)
            return torch._scaled_mm(a, w.t(), a_s, s.t(), out_dtype=x.dtype)[:m]
        calls["torch_block_private"] = private
    if libraries.get("deep_gemm"):
        calls["deep_gemm"] = lambda x, w, s, y: kernels.block_library_linear("deep_gemm", x, w, s)
    if libraries.get("flashinfer") is not None:
        calls["flashinfer"] = _flashinfer_call(libraries["flashinfer"])
    calls["engine"] = lambda x, w, s, y: kernels.fp8_linear(x, w, s, 128)
    return calls


def measure(shapes: dict, rows: tuple, reps: int, dev, libraries: dict) -> dict:
    per_layer: dict = {}
    for name, (n, k) in shapes.items():
        g = torch.Generator(device=dev).manual_seed(0)
        w = torch.randn(n, k, device=dev, generator=g) * 0.02
        codes, scale = fp8.quantize_fp8_block(w, (128, 128))
        dequantized = fp8.dequantize_fp8(codes, scale, (128, 128), torch.float32)
        bf16 = w.to(torch.bfloat16)
        fp8_copies = max(1, min(MAX_COPIES, -(-L2_MULTIPLE_BYTES // codes.numel())))
        bf16_copies = max(1, min(MAX_COPIES, -(-L2_MULTIPLE_BYTES // (2 * bf16.numel()))))
        fp8_weights = [(codes, scale)] + [(codes.clone(), scale) for _ in range(fp8_copies - 1)]
        bf16_weights = [bf16] + [bf16.clone() for _ in range(bf16_copies - 1)]
        per_layer[name] = {"n": n, "k": k, "fp8_copies": fp8_copies, "bf16_copies": bf16_copies, "rows": {}}
        for m in rows:
            x = torch.randn(m, k, device=dev, generator=g).to(torch.bfloat16)
            ys = [torch.empty(m, n, device=dev, dtype=torch.bfloat16) for _ in range(max(fp8_copies, bf16_copies))]
            want_fp8 = x.float() @ dequantized.t()
            want_bf16 = x.float() @ w.t()
            row: dict = {"us": {}, "rel_l2": {}, "errors": {}}
            options = {"bf16": lambda x, w, s, y: torch.mm(x, w.t(), out=y), **candidates(m, k, libraries)}
            for option, call in options.items():
                weights = [(b, None) for b in bf16_weights] if option == "bf16" else fp8_weights
                try:
                    got = call(x, *weights[0], ys[0]).float()
                    want = want_bf16 if option == "bf16" else want_fp8
                    rel = ((got - want).norm() / want.norm()).item()
                    row["rel_l2"][option] = rel
                    bound = tolerance(option, k, _weight_only(option, n, k, m, dev))
                    if not rel <= bound:
                        row["errors"][option] = f"relative L2 {rel:.3g} above tolerance {bound:.3g}"
                        continue
                    fns = [lambda w=w_, s=s_, y=y: call(x, w, s, y) for (w_, s_), y in zip(weights, ys)]
                    row["us"][option] = 1e3 * graph_replay_ms(fns, "cuda", reps=reps) / len(fns)
                except Exception as e:  # noqa: BLE001 - an option that fails at a shape is recorded, not fatal
                    row["errors"][option] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
            for option, why in row["errors"].items():
                log(f"{name} M={m}: {option} left out: {why}")
            per_layer[name]["rows"][str(m)] = row
            log(f"{name:<8} M={m:<5} " + "  ".join(f"{o} {us:7.1f}" for o, us in row["us"].items()) + "  (us)")
            del ys, want_fp8, want_bf16
        del fp8_weights, bf16_weights, dequantized
        torch.cuda.empty_cache()
    return per_layer


ACT_QUANT_TILES = ((1, 4), (16, 2), (8, 4), (32, 1), (4, 8))  # (rows, groups) a program; the first the earlier kernel's


def act_quant_rows(shapes: dict, rows: tuple, per_layer: dict, reps: int, dev) -> list[dict]:
    """The activation quantization a W8A8 linear starts with (DeepGEMM's route: M-fastest
    scales, rows padded to DEEP_GEMM_ROW_ALIGN and left unwritten), alone, per K of the shapes
    and M past the small-M kernel, under each program tile of ACT_QUANT_TILES: µs (graph of
    back-to-back calls over copies of x), achieved bandwidth (bf16 read, e4m3 + scales written)
    and, at the committed tile, its share of each layer's DeepGEMM linear as measured above."""
    out = []
    for k in sorted({k for _, k in shapes.values()}):
        for m in (r for r in rows if r > gemv.GEMV_MAX_M):
            copies = max(1, min(MAX_COPIES, -(-L2_MULTIPLE_BYTES // (2 * m * k))))
            xs = [torch.randn(m, k, device=dev).to(torch.bfloat16) for _ in range(copies)]
            moved = m * k * 3 + m * (k // 128) * 4
            row = {"k": k, "m": m, "us": {}, "tb_s": {}}
            for tile in ACT_QUANT_TILES:
                fns = [lambda x=x, tile=tile: kernels.act_quant(x, column_major=True, pad_rows_to=kernels.DEEP_GEMM_ROW_ALIGN,
                                                               fill_padding=False, tile=tile) for x in xs]
                us = 1e3 * graph_replay_ms(fns, "cuda", reps=reps) / copies
                row["us"][str(list(tile))] = us
                row["tb_s"][str(list(tile))] = moved / us / 1e6
            committed = row["us"][str(list(kernels.ACT_QUANT_TILE))]
            row["share_of_deep_gemm_linear"] = {
                name: committed / layer["rows"][str(m)]["us"]["deep_gemm"]
                for name, layer in per_layer.items() if layer["k"] == k and str(m) in layer["rows"]
                and "deep_gemm" in layer["rows"][str(m)]["us"]}
            log(f"act_quant K={k:<5} M={m:<5} " + "  ".join(f"{t} {us:6.1f}" for t, us in row["us"].items()) + "  (us)")
            out.append(row)
            del xs
    return out


def step_table(per_layer: dict, rows: tuple) -> list[dict]:
    """Per M: microseconds of a step's linears (the four layers x LAYERS) per option that ran at
    every layer, bf16 over each, and the fastest block-scaled candidate."""
    table = []
    for m in rows:
        layer_rows = [per_layer[name]["rows"][str(m)]["us"] for name in per_layer]
        options = [o for o in layer_rows[0] if all(o in r for r in layer_rows)]
        entry = {"m": m, "us": {o: LAYERS * sum(r[o] for r in layer_rows) for o in options}}
        bar = entry["us"].get("bf16")
        entry["speedup_vs_bf16"] = {o: bar / us for o, us in entry["us"].items()} if bar else {}
        fp8_options = {o: us for o, us in entry["us"].items() if o not in NOT_CANDIDATES}
        entry["winner"] = min(fp8_options, key=fp8_options.get) if fp8_options else None
        table.append(entry)
    return table


def route_name(option: str) -> str | None:
    """The BLOCK_ROUTE option a measured candidate is (None for the libraries and private APIs
    the engine does not call)."""
    return ROUTE_NAME.get(option)


def routable_winner(entry: dict) -> str | None:
    """The fastest option at this M among those the engine can call (None where none ran)."""
    routable = {o: us for o, us in entry["us"].items() if o not in NOT_CANDIDATES and route_name(o)}
    return min(routable, key=routable.get) if routable else None


def implied_route(table: list[dict]) -> list[list]:
    """BLOCK_ROUTE from the per-M winners among the options the engine can call: each winner
    serves up to the M where it won (the last up to any M), neighbours with one winner merged."""
    picks = [(e["m"], route_name(routable_winner(e))) for e in table if routable_winner(e)]
    route: list[list] = []
    for m, option in picks:
        if route and route[-1][1] == option:
            route[-1][0] = m
        else:
            route.append([m, option])
    if route:
        route[-1][0] = None
    return route


TITLE = "Choosing the FP8 GEMM: a step's Llama-3.1-8B linears (4 linears x 32 layers), µs and bf16 / option"
COMMAND = "python3 bench/gemm_choice.py --out OUT"
# key -> (figure, goal as bf16 / engine route, the M it is read at: "prefill" M >= 2048, "all", or one M).
# The first two figures are bench/fp8_crossover.py's, so the report keeps the latest run of either.
GOALS = {
    "prefill_1_5x_at_m_ge_2048": ("FP8 prefill linears / bf16, worst M >= 2048", 1.5, "prefill"),
    "never_slower_than_bf16": ("FP8 linears / bf16, worst M of 1-8192 (a step's 8B linears)", 1.0, "all"),
    "decode_m1_1_8x": ("FP8 linears / bf16 at M 1 (a step's 8B linears)", 1.8, 1),
}
PREFILL_MIN_M = 2048


def goals(table: list[dict]) -> dict:
    """The goals in bench/report.py's form, measured on the engine's route (`fp8_linear` as
    committed): the worst bf16 / engine over the M each goal reads (None where none ran)."""
    out = {}
    for key, (figure, goal, where) in GOALS.items():
        picked = [e for e in table if where == "all" or (where == "prefill" and e["m"] >= PREFILL_MIN_M)
                  or e["m"] == where]
        values = [e["speedup_vs_bf16"]["engine"] for e in picked if "engine" in e["speedup_vs_bf16"]]
        out[key] = {"figure": figure, "goal": goal, "measured": min(values) if values else None,
                    "unit": "x", "better": "higher"}
    return out


def render_md(result: dict) -> str:
    """gemm_choice.md: the title, then one row per M of the step's linears, a column per option
    measured at any M (µs and bf16 / option; "—" where it did not run) and the winner."""
    table = result["step_linears"]
    options: list[str] = []
    for e in table:
        options += [o for o in e["us"] if o not in options]
    lines = [f"# {result.get('title') or TITLE}", "",
             "| M | " + " | ".join(f"`{o}`" for o in options) + " | fastest block-scaled |",
             "|---|" + "---|" * (len(options) + 1)]
    for e in table:
        cells = [f"{e['us'][o]:.0f} ({e['speedup_vs_bf16'][o]:.2f}×)" if o in e["us"] and o in e["speedup_vs_bf16"]
                 else f"{e['us'][o]:.0f}" if o in e["us"] else "—" for o in options]
        lines.append(f"| {e['m']} | " + " | ".join(cells) + f" | `{e.get('winner') or '—'}` |")
    quant = result.get("act_quant") or []
    if quant:
        tiles = list(quant[0]["us"])
        lines += ["", f"The activation quantization inside each W8A8 column (`act_quant`, DeepGEMM's layout), alone: µs "
                  f"and TB/s by program tile (rows, 128-wide groups); the engine's is {result.get('act_quant_tile')}, "
                  "its share of the layer's DeepGEMM linear last.", "",
                  "| K | M | " + " | ".join(tiles) + " | share of the DeepGEMM linear |",
                  "|---|---|" + "---|" * (len(tiles) + 1)]
        for q in quant:
            share = ", ".join(f"{name} {100 * v:.0f}%" for name, v in q["share_of_deep_gemm_linear"].items())
            lines.append(f"| {q['k']} | {q['m']} | " + " | ".join(f"{q['us'][t]:.1f} ({q['tb_s'][t]:.2f})" for t in tiles)
                         + f" | {share or '—'} |")
    return "\n".join(lines) + "\n"


def render(path: Path) -> int:
    """Writes the .md beside a gemm_choice JSON (this script's, any run)."""
    try:
        result = json.loads(path.read_text())
        text = render_md(result)
    except (OSError, ValueError, KeyError, TypeError) as e:
        log(f"gemm_choice --render: {path} is not a gemm_choice JSON ({type(e).__name__}: {e})")
        return 2
    out = path.with_suffix(".md")
    out.write_text(text)
    log(f"wrote {out}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--smoke", action="store_true", help="one shape, two row counts")
    parser.add_argument("--render", type=Path, metavar="JSON", help="write the .md beside a gemm_choice JSON and stop")
    args = parser.parse_args()
    if args.render is not None:
        return render(args.render)
    if args.out is None:
        parser.error("--out DIR is required (or --render JSON)")
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        log("gemm_choice: needs a CUDA device of compute capability 8.9 or later")
        return 2
    start = time.monotonic()
    dev = torch.device("cuda")
    shapes = dict(list(LLAMA_8B_LINEARS.items())[:1]) if args.smoke else LLAMA_8B_LINEARS
    rows = (16, 2048) if args.smoke else ROWS
    # The libraries the engine routes to, probed as the engine probes them (a failure logged once)
    libraries: dict = {o: kernels.library_available(o, dev, torch.bfloat16) for o in ("torch_block", "deep_gemm")}
    unavailable = {o: f"{o} probe failed (logged above)" for o, ok in libraries.items() if not ok}
    for option, module in (("flashinfer", "flashinfer"),):
        libraries[option], why = _optional(module)
        if why is not None:
            unavailable[option] = f"import {module}: {why}"
            log(f"gemm_choice: {option} not measured: {unavailable[option]}")
    per_layer = measure(shapes, rows, 5 if args.smoke else args.reps, dev, libraries)
    quant = act_quant_rows(shapes, rows, per_layer, 5 if args.smoke else args.reps, dev)
    table = step_table(per_layer, rows)
    route = implied_route(table)
    # what the implied route would give: the routable winner's speedup at each M
    best = {e["m"]: e["speedup_vs_bf16"].get(routable_winner(e)) for e in table if routable_winner(e)}
    result = {
        "script": "bench/gemm_choice.py", "title": TITLE,
        "command": COMMAND.replace("--out", "--smoke --out") if args.smoke else COMMAND,
        "environment": environment(), "layers": LAYERS, "rows": list(rows), "shapes": shapes,
        "tolerance": {o: tolerance(o, 4096) for o in ("bf16", "gemv", "w8a8")},
        "unavailable": unavailable,
        "route_committed": [list(r) for r in kernels.BLOCK_ROUTE],
        "route_implied": route,
        "route_implied_speedup": {str(m): x for m, x in best.items()},
        "per_layer": per_layer, "step_linears": table, "act_quant": quant,
        "act_quant_tile": list(kernels.ACT_QUANT_TILE),
        "winners": {str(e["m"]): e["winner"] for e in table},
        "goals": goals(table),
        "seconds": None,
    }
    result["seconds"] = round(time.monotonic() - start, 1)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gemm_choice.json").write_text(json.dumps(result, indent=1))
    (args.out / "gemm_choice.md").write_text(render_md(result))
    log("step linears (us, 8B x 32 layers) and bf16 / option:")
    for e in table:
        log(f"M={e['m']:<5} " + "  ".join(f"{o} {us:8.0f} ({e['speedup_vs_bf16'].get(o, math.nan):.2f}x)"
                                          for o, us in e["us"].items()) + f"  winner {e['winner']}")
    log(f"BLOCK_ROUTE the winners imply: {tuple(tuple(r) for r in route)} (committed {kernels.BLOCK_ROUTE})")
    for g in result["goals"].values():
        log(f"goal {g['figure']}: >= {g['goal']}x, engine route "
            + (f"{g['measured']:.2f}x" if g["measured"] is not None else "not measured"))
    log(f"done in {result['seconds']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
