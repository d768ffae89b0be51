"""What one hyper-connection residual (engine/models/hc.py, hc_mult 4, H 4096: the Llama-3.1-8B shape
with four streams) costs per sublayer: the torch code against the Triton kernels
(engine/kernels/hc.py) at several block sizes, at decode / verify sizes (8 sublayers in a row
captured in one CUDA graph, medians of replays) and at a prefill chunk (eager).

    python3 bench/hc_residual_probe.py [--out DIR]        (CUDA only)
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # works under python3 -P too

from common import bootstrap_specdeploy, cuda_probe_args, log, write_json  # noqa: E402

bootstrap_specdeploy()

from specdeploy.engine.kernels import hc as hc_triton  # noqa: E402
from specdeploy.engine.models.hc import HCConfig, HyperConnection, hc_collapse, hc_expand  # noqa: E402

H, HC, LAYERS = 4096, 4, 8
VARIANTS = ((1024, 1024), (2048, 256), (4096, 512), (1024, 256), (512, 128))


def torch_forward(mod, streams, sublayer):
    pre, post, comb = mod.mixing_weights(streams)
    return hc_expand(sublayer(hc_collapse(streams, pre)), streams, post, comb)


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
    args = cuda_probe_args(__doc__)
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
        for pre, expand in VARIANTS:
            hc_triton.PRE_BLOCK, hc_triton.EXPAND_BLOCK = pre, expand
            row[f"triton_{pre}_{expand}_us"] = timed(chain(lambda m, s, f: m(s, f)), graph)
        rows.append(row)
        log(f"T={t:5d} per sublayer: torch {row['torch_us']:8.1f} µs | " + " | ".join(
            f"triton {p}/{e} {row[f'triton_{p}_{e}_us']:7.1f} µs" for p, e in VARIANTS))
    if args.out:
        write_json("hc_residual_probe.json", rows, args.out)


if __name__ == "__main__":
    main()
