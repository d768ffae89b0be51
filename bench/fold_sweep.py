"""The batch-1 folds of the small-M linear (engine/kernels/gemv.py: norm_linear, silu_linear)
against the two launches they replace, per Llama-3.1-8B shape, and over the fold's launch
configurations.

    python3 bench/fold_sweep.py --out RESULTS_DIR          # device, ~2-3 min on an H200 (compiles)
    python3 bench/fold_sweep.py --smoke --out RESULTS_DIR  # CPU (Triton interpreter), tiny, seconds

Per (weights, shape): the pair as the engine ran it before the folds (elementwise.add_rms_norm or
silu_mul, then the linear with the table's M-1 launch) and the folded launch at the table's
configuration and at a grid of others (BLOCK_N, BLOCK_K, num_warps; split-K for silu), each
timed as bench/gemv_sweep.py times a launch: a CUDA graph of back-to-back calls over enough
weight copies that the bytes exceed the L2 many times, median of the replays, per call. With
PDL as the engine launches (engine/kernels/launch.py). Writes fold_sweep.json; prints one line
per shape: unfused µs, folded µs at the table's launch, the best folded launch and its µs.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

if "--smoke" in sys.argv:  # chosen when Triton is first imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import bootstrap_specdeploy  # noqa: E402

bootstrap_specdeploy()

import torch  # noqa: E402

from common import environment, free_device_memory, log, write_json  # noqa: E402
from gemv_sweep import L2_MULTIPLE_BYTES, _tensors, _time_graph  # noqa: E402

# (name, N, K, what feeds it): the two projections a norm feeds, and the one silu-mul feeds
SHAPES = {"device": [("qkv", 6144, 4096, "norm"), ("gate_up", 28672, 4096, "norm"), ("down", 4096, 14336, "silu")],
          "smoke": [("tiny_norm", 64, 512, "norm"), ("tiny_silu", 64, 512, "silu")]}
EPS = 1e-5


def fold_candidates(fold: str, table_cfg: tuple, smoke: bool) -> list[tuple]:
    """The table's launch first, then the fold's grid: "fma" at BLOCK_N 8-64, BLOCK_K 256 / 512,
    2 / 4 warps, 3 stages; split-K 1 for the norm (it needs all of K), 1 / 2 / 4 for silu."""
    if smoke:
        return [("fma", 8, 256, 1, 4, 2)]
    out = [table_cfg]
    splits = (1,) if fold == "norm" else (1, 2, 4)
    for bn in (8, 16, 32, 64):
        for bk in (256, 512):
            for warps in (2, 4):
                for split in splits:
                    cfg = ("fma", bn, bk, split, warps, 3)
                    if cfg not in out and not (split > 1 and (bk, warps) != (512, 2)):
                        out.append(cfg)
    return out


def measure(kind: str, n: int, k: int, fold: str, device, smoke: bool) -> dict:
    from specdeploy.engine.kernels import elementwise, gemv
    weight_bytes = n * k * (1 if kind == "fp8" else 2)
    copies = 2 if smoke else max(2, -(-L2_MULTIPLE_BYTES // weight_bytes))
    weights = _tensors(kind, n, k, device, copies)
    dtype = torch.bfloat16
    table_cfg = gemv.config_for(kind, n, k, 1, device)
    residual = torch.randn(1, k, device=device).to(dtype)
    delta = torch.randn(1, k, device=device).to(dtype)
    norm_w = (1 + 0.1 * torch.randn(k, device=device)).to(dtype)
    gate_up = torch.randn(1, 2 * k, device=device).to(dtype)
    gate, up = gate_up[:, :k], gate_up[:, k:]
    total = torch.empty_like(residual)
    y = torch.empty(1, n, device=device, dtype=dtype)

    def linear(x, w, s, cfg, **fold_args):
        if cfg[0] == "cublas":
            return torch.mm(x, w.t(), out=y)
        return gemv.launch(x, w, s, 128, None, y, *cfg, **fold_args)

    def unfused(w, s):
        if fold == "norm":
            _, h = elementwise.add_rms_norm(residual, delta, norm_w, EPS)
        else:
            h = elementwise.silu_mul(gate, up)
        linear(h, w, s, table_cfg)

    def folded(cfg):
        if fold == "norm":
            args = {"norm": gemv.Norm(delta, norm_w, EPS, total)}
            return [lambda w=w, s=s: linear(residual, w, s, cfg, **args) for w, s in weights]
        return [lambda w=w, s=s: linear(gate, w, s, cfg, up=up) for w, s in weights]

    row = {"weights": kind, "n": n, "k": k, "fold": fold, "table": list(table_cfg), "copies": copies,
           "unfused_us": 1e3 * _time_graph([lambda w=w, s=s: unfused(w, s) for w, s in weights], device) / copies,
           "folded": []}
    for cfg in fold_candidates(fold, table_cfg, smoke):
        if cfg[0] == "cublas":
            continue
        try:
            for call in folded(cfg)[:1]:
                call()  # compiles outside the capture
            us = 1e3 * _time_graph(folded(cfg), device) / copies
        except Exception as e:  # a launch the compiler refuses: recorded
            row["folded"].append({"config": list(cfg), "error": f"{type(e).__name__}: {e}"[:200]})
            continue
        row["folded"].append({"config": list(cfg), "us": us})
    timed = [f for f in row["folded"] if "us" in f]
    if timed:
        best = min(timed, key=lambda f: f["us"])
        row["best"] = best
        row["table_folded_us"] = next((f["us"] for f in timed if tuple(f["config"]) == tuple(table_cfg)), None)
        row["unfused_over_best"] = row["unfused_us"] / best["us"]
    del weights
    free_device_memory()
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny shapes: checks the script, measures nothing")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    sizes = "smoke" if args.smoke else "device"
    t0 = time.time()
    result = {"environment": environment(), "rows": []}
    for kind in ("fp8", "plain"):
        for name, n, k, fold in SHAPES[sizes]:
            row = {"shape": name, **measure(kind, n, k, fold, device, args.smoke)}
            result["rows"].append(row)
            best = row.get("best", {})
            table_us = row.get("table_folded_us")
            log(f"{kind:5} {name:8} {fold}: unfused {row['unfused_us']:7.2f} us | folded at the table's "
                f"{tuple(row['table'])} {table_us if table_us is None else f'{table_us:7.2f}'} us | best "
                f"{tuple(best.get('config', ()))} {best.get('us', float('nan')):7.2f} us")
    write_json("fold_sweep.json", result, args.out)
    log(f"fold sweep done in {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
