"""Per-kernel time of the decode step's non-GEMM kernels at the Llama-3.1-8B shapes, batch 1 and 64,
each form next to the one it replaces.

    python3 bench/decode_kernels.py --out RESULTS_DIR          # device, ~20 s on an H200
    python3 bench/decode_kernels.py --smoke --out RESULTS_DIR  # CPU (Triton interpreter), tiny shapes

Each kernel is timed as the decode step runs it: a CUDA graph of LAYERS back-to-back launches (one
per layer, each over its own buffers, programmatic dependent launch as the engine's launches), the
median replay divided by LAYERS. So a row's µs is what one launch adds to a graphed step, launch
and drain boundary included, not the kernel's duration in a profiler (with PDL a kernel is
launched while its predecessor runs and waits for it in `griddepcontrol.wait`: a profiler counts
that wait as its own time). Rows:

- residual add + RMSNorm: torch add then the norm kernel (two launches) vs `add_rms_norm` (one);
  the norm alone; H = 4096.
- SiLU(gate) * up over the fused gate/up output, I = 14336.
- rope on q/k and the K/V pool writes (`rope_store`), 32 q heads, 8 kv heads, D = 128.
- attention over a 1024-token prefix (split kernel, then the combine kernel when it splits): the
  engine's launch (row `engine_launch`: `attention.chosen_launch`) next to the launch
  it replaced (row `previous_launch`: batch 1 16 splits, batch 64 BLOCK_K 32; PREVIOUS_LAUNCH),
  then other split counts, BLOCK_K and pipelining depths (what to tune next).

Bytes are what a kernel must move (reads + writes); `floor_us` is bytes over the measured copy
bandwidth. Writes decode_kernels.json (with an "environment" block) into RESULTS_DIR.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

if "--smoke" in sys.argv:  # chosen when Triton is first imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import bootstrap_specdeploy  # noqa: E402

bootstrap_specdeploy()

import torch  # noqa: E402

from common import calls_ms, copy_bandwidth_bytes_per_s, environment, log, write_json  # noqa: E402

SHAPES = {  # hidden, intermediate, q heads, kv heads, head dim, prefix, batches, layers
    "device": dict(hidden=4096, inter=14336, hq=32, hkv=8, d=128, prefix=1024, batches=(1, 64), layers=32),
    "smoke": dict(hidden=64, inter=96, hq=4, hkv=2, d=16, prefix=40, batches=(1, 2), layers=1),
}
KV_BYTES_PER_GRAPH = 1 << 30  # attention: at most this much KV across the graph's layers (fewer layers at batch 64)
REPS, WARMUP = 30, 5
# The engine's attention launch before docs/benchmarks/runs/2026-12-02-kernels chose the present one:
# batch -> (splits, BLOCK_K), at the device shapes (1024-key prefix, 8 kv heads, 132 SMs).
PREVIOUS_LAUNCH = {1: (16, 32), 64: (1, 32)}


def _row(name: str, batch: int, form: str, calls, nbytes: int, bandwidth: float, device) -> dict:
    us = 1e3 * calls_ms(calls, device, warmup=WARMUP, reps=REPS) / len(calls)
    floor = 1e6 * nbytes / bandwidth
    row = {"kernel": name, "batch": batch, "form": form, "us": round(us, 3), "bytes": nbytes,
           "floor_us": round(floor, 3), "fraction_of_floor": round(floor / us, 3) if us else None}
    log(f"{name:>24} bs{batch:<3} {form:<28} {us:8.2f} us  (floor {floor:6.2f} us)")
    return row


def _norm_rows(s, batch, bandwidth, device) -> list[dict]:
    from specdeploy.engine.kernels import elementwise
    h, n = s["hidden"], s["layers"]
    dt = torch.bfloat16
    xs = [torch.randn(batch, h, device=device, dtype=dt) for _ in range(n)]
    ds = [torch.randn(batch, h, device=device, dtype=dt) for _ in range(n)]
    w = torch.rand(h, device=device, dtype=dt) + 0.5
    row_bytes = batch * h * 2
    norm_bytes = 2 * row_bytes + h * 2                       # x in, out, weight
    add_bytes = 4 * row_bytes + h * 2                        # x, delta in; sum, out
    return [
        _row("rms_norm", batch, "norm only", [lambda x=x: elementwise.rms_norm(x, w, 1e-5) for x in xs],
             norm_bytes, bandwidth, device),
        _row("add + rms_norm", batch, "torch add, then norm (2)",
             [lambda x=x, d=d: elementwise.rms_norm(x + d, w, 1e-5) for x, d in zip(xs, ds)],
             add_bytes + 3 * row_bytes, bandwidth, device),
        _row("add + rms_norm", batch, "add_rms_norm (1)",
             [lambda x=x, d=d: elementwise.add_rms_norm(x, d, w, 1e-5) for x, d in zip(xs, ds)],
             add_bytes, bandwidth, device),
    ]


def _silu_rows(s, batch, bandwidth, device) -> list[dict]:
    from specdeploy.engine.kernels import elementwise
    i, n = s["inter"], s["layers"]
    gus = [torch.randn(batch, 2 * i, device=device, dtype=torch.bfloat16) for _ in range(n)]
    return [_row("silu_mul", batch, "silu_mul (1)",
                 [lambda gu=gu: elementwise.silu_mul(gu[:, :i], gu[:, i:]) for gu in gus],
                 batch * i * 2 * 3, bandwidth, device)]


def _rope_rows(s, batch, bandwidth, device) -> list[dict]:
    from specdeploy.engine.kernels import elementwise
    hq, hkv, d, n = s["hq"], s["hkv"], s["d"], s["layers"]
    dt = torch.bfloat16
    width = (hq + 2 * hkv) * d
    qkvs = [torch.randn(batch, 1, width, device=device, dtype=dt) for _ in range(n)]
    cos = torch.randn(batch, 1, d, device=device, dtype=dt)
    sin = torch.randn(batch, 1, d, device=device, dtype=dt)
    pool = [torch.zeros(batch * 4, hkv, d, device=device, dtype=dt) for _ in range(2)]
    slots = torch.arange(batch, device=device).view(batch, 1)
    nbytes = batch * (width * 2 + hq * d * 2 + 2 * hkv * d * 2 + 2 * d * 2)
    return [_row("rope_store", batch, "rope_store (1)",
                 [lambda x=x: elementwise.rope_store(x, cos, sin, pool[0], pool[1], slots, hq, hkv)
                  for x in qkvs], nbytes, bandwidth, device)]


def _attention_rows(s, batch, bandwidth, device) -> list[dict]:
    from specdeploy.engine.kernels import attention as attention_triton
    from specdeploy.engine.models.attention import AttnBatch
    hq, hkv, d, prefix = s["hq"], s["hkv"], s["d"], s["prefix"]
    dt = torch.bfloat16
    kv_layer = batch * prefix * hkv * d * 2 * 2
    layers = max(1, min(s["layers"], KV_BYTES_PER_GRAPH // kv_layer))
    slots_total = batch * prefix * layers + batch
    k = torch.randn(slots_total, hkv, d, device=device, dtype=dt)
    v = torch.randn(slots_total, hkv, d, device=device, dtype=dt)
    batches, qs = [], []
    for layer in range(layers):
        # each layer's prefix its own slots, shuffled (a pool's pages are not in order)
        base = layer * batch * prefix
        order = torch.randperm(batch * prefix, device=device) + base
        prefix_slots = order.view(batch, prefix)
        new = (slots_total - batch + torch.arange(batch, device=device)).view(batch, 1)
        mask = torch.ones(batch, 1, 1, dtype=torch.bool, device=device)
        lens = torch.full((batch,), prefix, dtype=torch.int64, device=device)
        batches.append(AttnBatch(new, prefix_slots, lens, new, mask))
        qs.append(torch.randn(batch, 1, hq, d, device=device, dtype=dt))
    q_bytes = batch * hq * d * 2
    nbytes = kv_layer + 2 * q_bytes + batch * prefix * 8
    chosen = (*attention_triton.chosen_launch(batch, 1, hq, hkv, prefix, device), None)
    rows = []
    for splits, block_k, stages in _attention_configs(chosen, batch, device.type == "cuda"):
        form = (f"{splits} split" + ("s, combine kernel (2)" if splits > 1 else " (1)")
                + f", BLOCK_K {block_k}" + ("" if stages is None else f", {stages} stages"))
        calls = [lambda q=q, bt=bt, sp=splits, bk=block_k, st=stages: attention_triton.attend(
            q, k, v, bt, d ** -0.5, num_splits=sp, block_k=bk, num_stages=st)
            for q, bt in zip(qs, batches)]
        rows.append(_row("attention", batch, form, calls, nbytes, bandwidth, device))
        rows[-1].update(splits=splits, block_k=block_k, num_stages=stages, layers_in_graph=layers,
                        engine_launch=(splits, block_k, stages) == chosen,
                        previous_launch=(splits, block_k, stages) == _previous(batch, device.type == "cuda"))
    return rows


def _previous(batch: int, device_run: bool) -> tuple:
    """The launch the engine made before the present choice (smoke shapes: 8 splits, BLOCK_K 16,
    a stand-in that takes the combine path)."""
    splits, block_k = PREVIOUS_LAUNCH[batch] if device_run else (8, 16)
    return splits, block_k, None


def _attention_configs(chosen: tuple, batch: int, device_run: bool) -> list[tuple]:
    """(splits, BLOCK_K, num_stages) to time: the engine's launch first, the previous one next,
    then other split counts and tile/pipelining depths."""
    previous = _previous(batch, device_run)
    if device_run and batch == 1:
        others = [(8, 32, None), (16, 64, None), (32, 16, None), (32, 64, None)]
    elif device_run:
        others = [(1, 64, 2), (1, 32, 4), (1, 64, 4), (2, 32, None), (2, 64, None)]
    else:
        others = [(chosen[0], 32, None)]
    configs = []
    for config in [chosen, previous, *others]:
        if config not in configs:
            configs.append(config)
    return configs


def run(device: torch.device, smoke: bool) -> dict:
    s = SHAPES["smoke" if smoke else "device"]
    bandwidth = copy_bandwidth_bytes_per_s(1 << 30) if device.type == "cuda" else 1e11
    rows = []
    for batch in s["batches"]:
        for part in (_norm_rows, _silu_rows, _rope_rows, _attention_rows):
            rows += part(s, batch, bandwidth, device)
    return {"environment": environment(), "smoke": smoke, "shapes": {k: v for k, v in s.items()},
            "copy_bandwidth_bytes_per_s": bandwidth, "pdl": os.environ.get("SPECDEPLOY_PDL", "1") != "0",
            "rows": rows}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--smoke", action="store_true", help="CPU (Triton interpreter), tiny: checks the script")
    args = parser.parse_args()
    if not args.smoke and not torch.cuda.is_available():
        parser.error("needs a CUDA device (or --smoke)")
    device = torch.device("cuda" if not args.smoke else "cpu")
    torch.manual_seed(0)
    result = run(device, args.smoke)
    write_json("decode_kernels.json", result, args.out)
    return 0 if result["rows"] and all(r["us"] > 0 for r in result["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
