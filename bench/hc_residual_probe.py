"""What one hyper-connection residual (engine/hc.py, hc_mult 4, H 4096: the Llama-3.1-8B shape
with four streams) costs per sublayer: the torch code against the Triton kernels
(engine/hc_triton.py), their mixes projection either cuBLAS over a float32 copy of the streams or
hc_mixes at several split widths; at decode / verify sizes (8 sublayers in a row captured in one
CUDA graph, medians of replays) and at a prefill chunk (eager).

    python3 bench/hc_residual_probe.py [--out DIR]        (CUDA only)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))  # works under python3 -P too

from common import bootstrap_specdeploy, log  # noqa: E402

bootstrap_specdeploy()

from specdeploy.engine import hc_triton  # noqa: E402
from specdeploy.engine.hc import (HCConfig, HyperConnection, flatten_streams, hc_collapse,  # noqa: E402
                                  hc_expand)

H, HC, LAYERS = 4096, 4, 8
# The mixes projection: cuBLAS on a float32 copy, or hc_mixes with this many columns per split.
VARIANTS = ("cublas", 256, 512, 1024)


def torch_forward(mod, streams, sublayer):
    pre, post, comb = mod.mixing_weights(streams)
    return hc_expand(sublayer(hc_collapse(streams, pre)), streams, post, comb)


def cublas_forward(mod, streams, sublayer):
    mixes = F.linear(flatten_streams(streams).float(), mod.fn)
    x, _, post, comb = hc_triton.hc_pre(streams, mixes, mod.base, mod.scale, mod.sinkhorn_iters,
                                        mod.norm_eps, mod.hc_eps)
    return hc_triton.hc_expand(sublayer(x), streams, post, comb)


def timed(fn, graph: bool, reps: int = 30) -> float:
    """Median µs per sublayer."""
    fn()
    torch.cuda.synchronize()
    if graph:
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn()
        torch.cuda.current_stream().wait_stream(s)
        with torch.cuda.graph(g):
            fn()
        run = g.replay
    else:
        run = fn
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        run()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / LAYERS)
    return statistics.median(times)


@torch.no_grad()
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("CUDA only")
    g = torch.Generator(device="cuda").manual_seed(0)
    mods = [HyperConnection(HCConfig(hidden_size=H, hc_mult=HC)).cuda() for _ in range(LAYERS)]
    for m in mods:
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, device="cuda", generator=g) * (0.02 if p.dim() == 2 else 1.0))
    rows = []
    for t in (1, 4, 16, 64, 8192):
        streams = torch.randn(t, HC, H, device="cuda", generator=g).to(torch.bfloat16)
        graph = t <= 64

        def chain(forward):
            def run():
                s = streams
                for m in mods:
                    s = forward(m, s, lambda x: x)
                return s
            return run

        row = {"tokens": t, "graphed": graph, "torch_us": timed(chain(torch_forward), graph)}
        for v in VARIANTS:
            if v == "cublas":
                row["triton_cublas_mixes_us"] = timed(chain(cublas_forward), graph)
            else:
                hc_triton.MIXES_SPLIT = v
                row[f"triton_split{v}_us"] = timed(chain(lambda m, s, f: m(s, f)), graph)
        rows.append(row)
        log(f"T={t:5d} per sublayer: torch {row['torch_us']:8.1f} µs | " + " | ".join(
            f"{k[7:-3]} {v:7.1f} µs" for k, v in row.items() if k.startswith("triton_")))
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "hc_residual_probe.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
