"""How much of each weight row the small-M linear pulls into L2 before its PDL wait: the graphed
decode call on the Llama-3.1-8B shape, bf16 and FP8 block weights, side by side per batch.

    python3 bench/prefetch_sweep.py --out RESULTS_DIR          # device, ~4 min on an H200
    python3 bench/prefetch_sweep.py --smoke --out RESULTS_DIR  # CPU, tiny model, seconds

A decode step is ~320 kernels, most of a few microseconds; with programmatic dependent launch
the next kernel's programs are resident while the previous kernel drains, parked in
griddepcontrol.wait. The weights are nobody's output, so engine/kernels/gemv.py's programs can
ask for their first bytes before that wait (SPECDEPLOY_PREFETCH bytes of each weight row, as
L2 prefetches; launch.PREFETCH_BYTES by default) and HBM stays busy across the boundary.

For each weights kind (bf16, then the same random model quantized in place to FP8 block
128 x 128) and batch, one graphed decode call (bench/harness.EngineDecode, 1K context) is
captured per prefetch size; the captures are timed in interleaved rounds (each round every size
once, CUDA events, `--reps` calls), and each size's figure is the median over all its calls.
Against the batch's HBM roofline (bench/roofline.py over the measured copy bandwidth).

Writes prefetch_sweep.json and prefetch_sweep.md into RESULTS_DIR.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import bootstrap_specdeploy  # noqa: E402

bootstrap_specdeploy()

import torch  # noqa: E402

from common import LLAMA_31_8B, TINY_LLAMA, copy_bandwidth_bytes_per_s, environment, free_device_memory, log  # noqa: E402
from harness import EngineDecode, kernel_env, random_target  # noqa: E402
from roofline import roofline_rows  # noqa: E402

from specdeploy.engine.kernels import launch  # noqa: E402
from specdeploy.engine.models import fp8  # noqa: E402

FORMAT = fp8.FP8Format("block", "weight_scale_inv", (128, 128))
TITLE = "Weight prefetch before the PDL wait: the graphed decode call by prefetch size, Llama-3.1-8B shape"
COMMAND = "python3 bench/prefetch_sweep.py --out OUT"
SIZES = {
    "device": dict(config=LLAMA_31_8B, batches=(1, 4, 16, 64), context=1024, prefetch=(0, 1024, 2048, 4096, 8192),
                   rounds=5, reps=10, warmup=5),
    "smoke": dict(config=TINY_LLAMA, batches=(1, 4), context=32, prefetch=(0, 2048), rounds=2, reps=2, warmup=1),
}


def _timed(call, device, reps: int) -> list[float]:
    """`reps` back-to-back calls, each timed alone (ms)."""
    if device.type != "cuda":
        out = []
        for _ in range(reps):
            t0 = time.perf_counter()
            call()
            out.append((time.perf_counter() - t0) * 1e3)
        return out
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for start, end in events:
        start.record()
        call()
        end.record()
    torch.cuda.synchronize(device)
    return [start.elapsed_time(end) for start, end in events]


def batch_rows(target, label: str, batch: int, sizes: dict, device, roof: dict) -> list[dict]:
    calls = {}
    for pf in sizes["prefetch"]:
        with kernel_env(launch.PREFETCH_ENV, str(pf)):
            calls[pf] = EngineDecode(target, batch, sizes["context"], graph=device.type == "cuda")
            for _ in range(sizes["warmup"]):
                calls[pf]()
    times: dict = {pf: [] for pf in calls}
    for _ in range(sizes["rounds"]):
        for pf, call in calls.items():
            times[pf] += _timed(call, device, sizes["reps"])
    del calls
    free_device_memory()
    base = statistics.median(times[0]) if 0 in times else None
    rows = []
    for pf, ts in times.items():
        ms = statistics.median(ts)
        row = {"weights": label, "batch": batch, "prefetch_bytes": pf, "median_ms": ms, "min_ms": min(ts),
               "max_ms": max(ts), "calls": len(ts), "tok_s": batch / (ms / 1e3),
               "fraction_of_roofline": batch / (ms / 1e3) / roof[batch]["roofline_tok_s"],
               "speedup_vs_none": base / ms if base else None}
        rows.append(row)
    log(f"{label} bs={batch:<3} " + "  ".join(f"{r['prefetch_bytes']}: {r['median_ms']:.3f} ms "
                                             f"({100 * r['fraction_of_roofline']:.1f}%)" for r in rows))
    return rows


def render_md(result: dict) -> str:
    sizes = result["prefetch"]
    lines = [TITLE, "",
             f"Decode call median (ms) and share of the HBM roofline, by bytes of each weight row prefetched "
             f"before the wait (0: none); {result['calls_per_figure']} calls a figure in {result['rounds']} interleaved "
             f"rounds; the default at the run's commit was {result['default_prefetch_bytes']} bytes. Copy bandwidth "
             f"{result['bandwidth_bytes_per_s'] / 1e12:.2f} TB/s.", "",
             "| weights | batch | " + " | ".join(str(p) for p in sizes) + " | best / none |",
             "|---|---|" + "---|" * (len(sizes) + 1)]
    for (label, batch), rows in _grouped(result["rows"]).items():
        best = min(rows, key=lambda r: r["median_ms"])
        cells = [f"{r['median_ms']:.3f} ({100 * r['fraction_of_roofline']:.1f}%)" for r in rows]
        lines.append(f"| {label} | {batch} | " + " | ".join(cells) +
                     f" | {best['speedup_vs_none']:.3f}× at {best['prefetch_bytes']} |")
    return "\n".join(lines) + "\n"


def _grouped(rows: list[dict]) -> dict:
    out: dict = {}
    for r in rows:
        out.setdefault((r["weights"], r["batch"]), []).append(r)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny model")
    args = parser.parse_args()
    sizes = SIZES["smoke" if args.smoke else "device"]
    if not args.smoke and not torch.cuda.is_available():
        log("prefetch_sweep: needs a CUDA device (or --smoke)")
        return 2
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    start = time.monotonic()
    bandwidth = copy_bandwidth_bytes_per_s() if device.type == "cuda" else 1e11
    target = random_target(sizes["config"], device, dtype)
    rows = []
    for label in ("bf16", "fp8"):
        if label == "fp8":
            fp8.quantize_model_linears(target, FORMAT)
            free_device_memory()
        roof = {r["batch"]: r for r in roofline_rows(target, bandwidth, None, sizes["batches"], sizes["context"])}
        for b in sizes["batches"]:
            rows += batch_rows(target, label, b, sizes, device, roof)
    result = {"script": "bench/prefetch_sweep.py", "title": TITLE,
              "command": COMMAND.replace("--out", "--smoke --out") if args.smoke else COMMAND,
              "environment": environment(), "context": sizes["context"], "prefetch": list(sizes["prefetch"]),
              "rounds": sizes["rounds"], "calls_per_figure": sizes["rounds"] * sizes["reps"],
              "default_prefetch_bytes": launch.PREFETCH_BYTES, "bandwidth_bytes_per_s": bandwidth,
              "rows": rows, "goals": {}, "seconds": round(time.monotonic() - start, 1)}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "prefetch_sweep.json").write_text(json.dumps(result, indent=1))
    (args.out / "prefetch_sweep.md").write_text(render_md(result))
    log(f"prefetch_sweep done in {result['seconds']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
