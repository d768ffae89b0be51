"""Batch-64 bf16 linears on the Llama-3.1-8B shapes: cuBLAS against a Triton weight-streaming GEMM,
to decide whether the small-M kernel (engine/kernels/gemv.py, today M <= 16) should take M = 64.

    python3 bench/skinny_gemm_probe.py --out RESULTS_DIR          # device, ~1 min on an H200
    python3 bench/skinny_gemm_probe.py --smoke --out RESULTS_DIR  # CPU (Triton interpreter), tiny

At batch 64 the bf16 decode step's linears go to cuBLAS, and they are most of the step: the
profile in docs/benchmarks.md books ~4.3 ms of a 7.3 ms step to cuBLAS's kernels. The step is
memory-bound there (64 rows against 15 GB of weights), so what counts is the fraction of the
device's copy bandwidth each GEMM reaches. Per shape, M rows of bf16 activations times [N, K]
bf16 weights:

- `cublas`: torch.mm into a bf16 output (what F.linear runs);
- `triton`: one program per BLOCK_N output columns and K split, x [M, BLOCK_K] and
  W [BLOCK_N, BLOCK_K] tiles into tl.dot (Triton pipelines the loads), float32 sums; one split
  stores bf16, more add into a zeroed float32 output with atomics (the zeroing inside the timed
  graph). A handful of tile shapes, the split count chosen so that the grid fills >= 2 waves.

Each timed as a CUDA graph of back-to-back calls over enough weight copies to exceed the L2
many times (bench/gemv_sweep.py's method), median replay over the copies. Per shape: µs, TB/s,
the fraction of the measured copy bandwidth (reads + writes), and the best Triton launch over
cuBLAS; then the step's sum (32 layers of qkv, o, gate/up, down and one lm_head), cuBLAS against
the faster of the two per shape: the most that taking M = 64 into the kernel could save.
Writes skinny_gemm_probe.json and skinny_gemm_probe.md into RESULTS_DIR.
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
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from common import calls_ms, copy_bandwidth_bytes_per_s, environment, free_device_memory, log, write_json  # noqa: E402

# (name, N, K, times in a step): Llama-3.1-8B's fused qkv, o, fused gate/up, down, lm_head
SHAPES = {
    "device": [("qkv", 6144, 4096, 32), ("o", 4096, 4096, 32), ("gate_up", 28672, 4096, 32),
               ("down", 4096, 14336, 32), ("lm_head", 128256, 4096, 1)],
    "smoke": [("tiny", 96, 256, 2), ("tiny_wide", 160, 128, 1)],
}
M_ROWS = {"device": 64, "smoke": 8}
# (BLOCK_N, BLOCK_K, num_warps, num_stages); BLOCK_M is M rounded up to a power of two (>= 16)
TILES = {"device": [(64, 128, 4, 4), (128, 128, 8, 4), (64, 256, 4, 3), (128, 64, 4, 5), (32, 256, 4, 4)],
         "smoke": [(32, 64, 4, 2)]}
L2_MULTIPLE_BYTES = 512 << 20
WAVES = 2  # the split count makes the grid at least this many programs per SM
REPS, WARMUP = 30, 5


@triton.jit
def _skinny_kernel(x_ptr, w_ptr, y_ptr, M, N, K_SPLIT, stride_xm, stride_wn, stride_ym,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ATOMIC: tl.constexpr):
    pid_n = tl.program_id(0)
    k_lo = tl.program_id(1) * K_SPLIT
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    rows_n = tl.minimum(offs_n, N - 1)  # past N: the last real row, so the weight loads stay unmasked
    m_ok = offs_m < M
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in tl.range(k_lo, k_lo + K_SPLIT, BLOCK_K):
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + (k0 + offs_k)[None, :], mask=m_ok[:, None], other=0.0)
        w = tl.load(w_ptr + rows_n[:, None] * stride_wn + (k0 + offs_k)[None, :])
        acc += tl.dot(x, tl.trans(w))
    ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    mask = m_ok[:, None] & (offs_n < N)[None, :]
    if ATOMIC:
        tl.atomic_add(ptrs, acc, mask=mask, sem="relaxed")
    else:
        tl.store(ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)


def split_for(n: int, k: int, block_n: int, block_k: int, num_sms: int) -> int:
    """The fewest K splits (a power of two, each >= 2 BLOCK_Ks) that give >= WAVES programs an SM."""
    tiles = -(-n // block_n)
    split = 1
    while tiles * split < WAVES * num_sms and k % (2 * split * block_k) == 0 and k // (2 * split) >= 2 * block_k:
        split *= 2
    return split


def triton_call(x, w, y32, y16, tile, split):
    block_n, block_k, warps, stages = tile
    m, k = x.shape
    n = w.shape[0]
    block_m = max(16, triton.next_power_of_2(m))
    out = y32 if split > 1 else y16

    def call():
        if split > 1:
            out.zero_()
        _skinny_kernel[(triton.cdiv(n, block_n), split)](
            x, w, out, m, n, k // split, x.stride(0), w.stride(0), out.stride(0),
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, ATOMIC=split > 1,
            num_warps=warps, num_stages=stages)
    return call


def run(device, smoke: bool) -> dict:
    size = "smoke" if smoke else "device"
    m = M_ROWS[size]
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    bandwidth = copy_bandwidth_bytes_per_s(device=device) if device.type == "cuda" else 1e11
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # the interpreter's dot takes float32
    g = torch.Generator(device=device).manual_seed(0)
    rows = []
    for name, n, k, times in SHAPES[size]:
        w_bytes = n * k * dtype.itemsize
        copies = max(1, -(-L2_MULTIPLE_BYTES // w_bytes)) if device.type == "cuda" else 1
        w0 = (torch.randn(n, k, device=device, generator=g) * 0.02).to(dtype)
        weights = [w0] + [w0.clone() for _ in range(copies - 1)]
        x = torch.randn(m, k, device=device, generator=g).to(dtype)
        y16 = [torch.empty(m, n, device=device, dtype=dtype) for _ in range(copies)]
        y32 = [torch.empty(m, n, device=device, dtype=torch.float32) for _ in range(copies)]
        want = (x.float() @ w0.float().t())
        moved = w_bytes + dtype.itemsize * m * (k + n)
        results = []
        ms = calls_ms([lambda w=w, y=y: torch.mm(x, w.t(), out=y) for w, y in zip(weights, y16)], device,
                      warmup=WARMUP, reps=REPS) / copies
        results.append({"kernel": "cublas", "us": ms * 1e3})
        for tile in TILES[size]:
            split = split_for(n, k, tile[0], tile[1], num_sms)
            try:
                check = triton_call(x, w0, y32[0], y16[0], tile, split)
                check()
                got = (y32[0] if split > 1 else y16[0]).float()
                err = ((got - want).norm() / want.norm()).item()
                if err > 1e-2:
                    raise RuntimeError(f"wrong result: relative error {err:.2e}")
                ms = calls_ms([triton_call(x, w, a, b, tile, split) for w, a, b in zip(weights, y32, y16)],
                              device, warmup=WARMUP, reps=REPS) / copies
            except Exception as e:  # a launch the compiler or the device refuses: recorded
                results.append({"kernel": "triton", "tile": list(tile), "split": split, "error": str(e)[:200]})
                continue
            results.append({"kernel": "triton", "tile": list(tile), "split": split, "us": ms * 1e3,
                            "relative_error": err})
        for r in results:
            if "us" in r:
                r["tb_s"] = moved / (r["us"] / 1e6) / 1e12
                r["fraction_of_copy_bandwidth"] = moved / (r["us"] / 1e6) / bandwidth
        ok = [r for r in results if "us" in r]
        cublas = ok[0]
        best = min((r for r in ok if r["kernel"] == "triton"), key=lambda r: r["us"], default=None)
        row = {"name": name, "n": n, "k": k, "m": m, "times_per_step": times, "bytes": moved, "copies": copies,
               "cublas": cublas, "best_triton": best, "all": results,
               "triton_over_cublas_speedup": cublas["us"] / best["us"] if best else None}
        rows.append(row)
        log(f"{name:<8} N={n:<6} K={k:<5} M={m}: cublas {cublas['us']:7.1f} us "
            f"({100 * cublas['fraction_of_copy_bandwidth']:.1f}% of copy) | best triton "
            + (f"{tuple(best['tile'])} split {best['split']} {best['us']:7.1f} us "
               f"({100 * best['fraction_of_copy_bandwidth']:.1f}%) = {row['triton_over_cublas_speedup']:.2f}x"
               if best else "none ran"))
        del weights, y16, y32
        free_device_memory()
    step_cublas = sum(r["cublas"]["us"] * r["times_per_step"] for r in rows)
    step_best = sum(min(r["cublas"]["us"], (r["best_triton"] or r["cublas"])["us"]) * r["times_per_step"] for r in rows)
    return {"script": "bench/skinny_gemm_probe.py", "title": "Batch-64 bf16 linears: cuBLAS against a Triton GEMM",
            "command": "python3 bench/skinny_gemm_probe.py --out OUT", "environment": environment(),
            "bandwidth_bytes_per_s": bandwidth, "num_sms": num_sms, "m": m, "rows": rows,
            "step_linears_us": {"cublas": step_cublas, "faster_per_shape": step_best,
                                "saving": step_cublas - step_best}}


def markdown(result: dict) -> str:
    lines = [f"# {result['title']}", "",
             f"M = {result['m']}, bf16; {result['environment'].get('gpu', result['environment'].get('device', ''))}, "
             f"copy bandwidth {result['bandwidth_bytes_per_s'] / 1e12:.2f} TB/s; µs per call in graphs of "
             "back-to-back calls over weight copies (beyond the L2).", "",
             "| shape | N x K | cuBLAS µs | % of copy | best Triton launch (BLOCK_N, BLOCK_K, warps, stages; split) | µs | % of copy | speed-up |",
             "|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        c, b = r["cublas"], r["best_triton"]
        lines.append(f"| {r['name']} | {r['n']} x {r['k']} | {c['us']:.1f} | {100 * c['fraction_of_copy_bandwidth']:.1f}% | "
                     + (f"{tuple(b['tile'])}; {b['split']} | {b['us']:.1f} | {100 * b['fraction_of_copy_bandwidth']:.1f}% | "
                        f"{r['triton_over_cublas_speedup']:.2f}x |" if b else "none ran | — | — | — |"))
    s = result["step_linears_us"]
    lines += ["", f"A step's linears (32 layers + lm_head): cuBLAS {s['cublas']:.0f} µs, the faster of the two per "
              f"shape {s['faster_per_shape']:.0f} µs: at most {s['saving']:.0f} µs a step to gain by taking M = 64 "
              "into the small-M kernel."]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--smoke", action="store_true", help="CPU (Triton interpreter), tiny: checks the script")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    t0 = time.time()
    result = run(device, args.smoke)
    result["wall_s"] = time.time() - t0
    write_json("skinny_gemm_probe.json", result, args.out)
    (args.out / "skinny_gemm_probe.md").write_text(markdown(result))
    log(f"skinny GEMM probe: {len(result['rows'])} shapes in {result['wall_s']:.0f} s")
    return 0 if all(r["best_triton"] for r in result["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
