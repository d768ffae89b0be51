"""The FP8 GEMM options side by side at the Llama-3.1-8B linear shapes, in one run: which one the
engine's FP8 linear should take at each M (decode rows, verify rows and prefill chunks).

    python3 bench/fp8_crossover.py --out DIR      # CUDA (compute capability >= 8.9), ~2 min
    python3 bench/fp8_crossover.py --smoke --out DIR   # two shapes, two M, seconds

Options, each on the same random weights (FP8 block 128 x 128, as DeepSeek / Qwen3-FP8):
- `bf16`: cuBLAS on the bf16 weights (the bar every FP8 option must clear);
- `gemv`: the project's small-M weight-streaming kernel (engine/kernels/gemv.py, M <= 16);
- `w8a16`: the project's weight-only Triton kernel (M <= 64 before this run's choice);
- `w8a8`: the project's Triton W8A8 kernel (activations quantized per 1 x 128 group, counted);
- `torch_block`: torch's `scaled_mm` with block scales (cuBLASLt, activation 1 x 128 through the
  project's `act_quant`, counted; weight 128 x 128): the same numerics as `w8a8`;
- `torch_block_gemm`: the same GEMM alone (activations quantized beforehand): what the
  quantization launch costs;
- `torch_tensor`: `scaled_mm` with one scale per tensor (an upper bound: a block checkpoint does
  not have these numerics);
- `engine`: `fp8_linear` as the engine calls it (the route this run chose).
Each figure is one layer timed as a CUDA graph of back-to-back calls over enough weight copies to
exceed the L2 many times (what a graphed decode step sees), median of replays; a step's linears
are the four layers x 32. Writes fp8_crossover.json and prints the per-step table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
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
ROWS = (1, 16, 32, 64, 65, 128, 256, 512, 2048, 8192)
OPTIONS = ("bf16", "gemv", "w8a16", "w8a8", "torch_block", "torch_block_gemm", "torch_tensor", "engine")
L2_MULTIPLE_BYTES = 512 << 20  # weight bytes per graph replay: many times the 50-60 MB L2
MAX_COPIES = 32


def _calls(option: str, m: int, x, weights, ys):
    """One closure per weight copy for `option` at M = m, or None where the option has no kernel."""
    k = x.shape[1]
    if option == "bf16":
        return [lambda w=w, y=y: torch.mm(x, w.t(), out=y) for (w, _), y in zip(weights["bf16"], ys)]
    codes = weights["fp8"]
    n = codes[0][0].shape[0]
    if option == "gemv":
        if m > gemv.GEMV_MAX_M:
            return None
        cfg = gemv.config_for("fp8", n, k, m, x.device)
        return [lambda w=w, s=s, y=y: gemv.launch(x, w, s, 128, None, y, *cfg) for (w, s), y in zip(codes, ys)]
    if option == "w8a16":
        tiles = kernels._decode_tiles(min(m, 64), n)
        return [lambda w=w, s=s, y=y: kernels.w8a16(x, w, s, 128, None, y, *tiles) for (w, s), y in zip(codes, ys)]
    if option == "w8a8":
        return [lambda w=w, s=s, y=y: kernels._w8a8(x, w, s, 128, None, y, False) for (w, s), y in zip(codes, ys)]
    if option == "engine":
        return [lambda w=w, s=s: kernels.fp8_linear(x, w, s, 128) for w, s in codes]
    if not kernels.torch_block_mm_available(x.device, x.dtype):
        return None
    if option == "torch_block":
        return [lambda w=w, s=s: kernels.torch_block_linear(x, w, s) for w, s in codes]
    if option == "torch_block_gemm":
        a, a_s = kernels.act_quant(x, column_major=True)
        return [lambda w=w, s=s: kernels._torch_block_call(a, a_s, w, s, x.dtype) for w, s in codes]
    if option == "torch_tensor":
        a = x.to(torch.float8_e4m3fn)
        one = torch.ones((), device=x.device)
        return [lambda w=w: torch._scaled_mm(a, w.t(), one, one, out_dtype=x.dtype) for w, _ in codes]
    raise ValueError(option)


def measure(shapes: dict, rows: tuple, reps: int, dev) -> dict:
    per_layer: dict = {}
    for name, (n, k) in shapes.items():
        g = torch.Generator(device=dev).manual_seed(0)
        w = torch.randn(n, k, device=dev, generator=g) * 0.02
        codes, scale = fp8.quantize_fp8_block(w, (128, 128))
        bf16 = w.to(torch.bfloat16)
        del w
        fp8_copies = max(1, min(MAX_COPIES, -(-L2_MULTIPLE_BYTES // codes.numel())))
        bf16_copies = max(1, min(MAX_COPIES, -(-L2_MULTIPLE_BYTES // (2 * bf16.numel()))))
        weights = {"fp8": [(codes, scale)] + [(codes.clone(), scale) for _ in range(fp8_copies - 1)],
                   "bf16": [(bf16, None)] + [(bf16.clone(), None) for _ in range(bf16_copies - 1)]}
        per_layer[name] = {"n": n, "k": k, "fp8_copies": fp8_copies, "bf16_copies": bf16_copies, "rows": {}}
        for m in rows:
            x = torch.randn(m, k, device=dev, generator=g).to(torch.bfloat16)
            ys = [torch.empty(m, n, device=dev, dtype=torch.bfloat16) for _ in range(max(fp8_copies, bf16_copies))]
            row = {}
            for option in OPTIONS:
                try:
                    calls = _calls(option, m, x, weights, ys)
                    if calls is not None:
                        row[option] = 1e3 * graph_replay_ms(calls, "cuda", reps=reps) / len(calls)
                except Exception as e:  # an option that fails at a shape is recorded, not fatal
                    row[option + "_error"] = f"{type(e).__name__}: {e}"[:200]
            per_layer[name]["rows"][str(m)] = row
            log(f"{name:<8} M={m:<5} " + "  ".join(f"{o} {row[o]:8.1f}" for o in OPTIONS if o in row) + "  (us)")
            del ys
        del weights
        torch.cuda.empty_cache()
    return per_layer


def step_table(per_layer: dict, rows: tuple) -> list[dict]:
    """Per M: microseconds of a step's linears (the four layers x LAYERS) per option, and bf16 over each."""
    table = []
    for m in rows:
        entry = {"m": m, "us": {}, "speedup_vs_bf16": {}}
        for option in OPTIONS:
            if all(option in per_layer[name]["rows"][str(m)] for name in per_layer):
                entry["us"][option] = LAYERS * sum(per_layer[name]["rows"][str(m)][option] for name in per_layer)
        for option, us in entry["us"].items():
            entry["speedup_vs_bf16"][option] = entry["us"]["bf16"] / us
        fp8_options = {o: us for o, us in entry["us"].items() if o not in ("bf16", "torch_tensor", "torch_block_gemm",
                                                                            "engine")}
        entry["fastest_block_option"] = min(fp8_options, key=fp8_options.get)
        table.append(entry)
    return table


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--smoke", action="store_true", help="two shapes, two row counts")
    args = parser.parse_args()
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        log("fp8_crossover: needs a CUDA device of compute capability 8.9 or later")
        return 2
    dev = torch.device("cuda")
    shapes = dict(list(LLAMA_8B_LINEARS.items())[:2]) if args.smoke else LLAMA_8B_LINEARS
    rows = (16, 64) if args.smoke else ROWS
    torch_block = kernels.torch_block_mm_available(dev, torch.bfloat16)
    per_layer = measure(shapes, rows, 5 if args.smoke else args.reps, dev)
    table = step_table(per_layer, rows)
    result = {"environment": environment(), "torch_block_available": torch_block, "layers": LAYERS,
              "route": {"gemv_max_m": gemv.GEMV_MAX_M, "decode_max_m": kernels.DECODE_MAX_M,
                        "torch_block_above": gemv.GEMV_MAX_M if torch_block else None,
                        "block_route": [list(r) for r in kernels.BLOCK_ROUTE],
                        "deep_gemm_available": kernels.library_available("deep_gemm", dev, torch.bfloat16)},
              "per_layer_us": per_layer, "step_linears": table}
    engine_vs_bf16 = [e["speedup_vs_bf16"].get("engine") for e in table]
    result["goal"] = {"name": "FP8 linears >= bf16 at every M (8B shape, a step's linears)",
                      "min_engine_speedup": min(s for s in engine_vs_bf16 if s is not None),
                      "met": all(s is not None and s >= 1.0 for s in engine_vs_bf16)}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "fp8_crossover.json").write_text(json.dumps(result, indent=1))
    log("step linears (us, 8B x 32 layers) and bf16 / option:")
    for e in table:
        log(f"M={e['m']:<5} " + "  ".join(f"{o} {us:8.0f} ({e['speedup_vs_bf16'][o]:.2f}x)" for o, us in e["us"].items())
            + f"  fastest block option: {e['fastest_block_option']}")
    log(f"goal FP8 >= bf16 at every M: {'met' if result['goal']['met'] else 'MISSED'} "
        f"(lowest engine/bf16 {result['goal']['min_engine_speedup']:.2f}x; "
        f"median {statistics.median(s for s in engine_vs_bf16 if s is not None):.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
