"""The small-M linear kernel's launch table, measured: every Llama-3.1-8B linear shape at M = 1 / 4
/ 8 / 16, FP8 block weights and bf16 weights, over a selective configuration space.

    python3 bench/gemv_sweep.py --out RESULTS_DIR          # device, <= ~120 s on an H200
    python3 bench/gemv_sweep.py --smoke --out RESULTS_DIR  # CPU (Triton interpreter), tiny, seconds

Per (weights, N, K, M): ~15-40 launch configurations (variant, BLOCK_N, BLOCK_K, SPLIT_K,
num_warps, num_stages) of engine/kernels/gemv.py, each timed as a CUDA graph of back-to-back
calls over enough weight copies that the bytes exceed the L2 many times (what a graphed decode
step does: every layer's weights once), median of >= 30 replays after warm-up; against cuBLAS
F.linear (bf16 weights) and the weight-only `_w8a16_kernel` at its default tiles (FP8), timed the
same way. Achieved bandwidth = (weight + scale + x + y bytes) / time, as TB/s and as a fraction of
the measured device copy bandwidth (read + write, bench/common.py).

The kernels compile first in parallel worker processes (Triton's on-disk cache), so the sweep
itself only loads them. Writes gemv_sweep.json (every timing) and gemv_table.py (the best table
as the Python literal engine/kernels/gemv.py's GEMV_TABLE takes: paste it there) into
RESULTS_DIR, prints one line per shape and the table. Other benchmarks call `sweep()` and
`install()` to run with the just-measured table in-process (bench/fp8_bench.py --gemv-sweep), or
`load_table()` + `install()` for a table measured before (bench/fp8_bench.py --gemv-table FILE).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

if "--smoke" in sys.argv:  # chosen when Triton is first imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import bootstrap_specdeploy  # noqa: E402

bootstrap_specdeploy()

import torch  # noqa: E402

from common import calls_ms, copy_bandwidth_bytes_per_s, environment, free_device_memory, log, write_json  # noqa: E402

# (name, N, K, weight kinds): Llama-3.1-8B's fused qkv, o, fused gate/up, down; lm_head (bf16 only)
SHAPES = {
    "device": [("qkv", 6144, 4096, ("fp8", "plain")), ("o", 4096, 4096, ("fp8", "plain")),
               ("gate_up", 28672, 4096, ("fp8", "plain")), ("down", 4096, 14336, ("fp8", "plain")),
               ("lm_head", 128256, 4096, ("plain",))],
    "smoke": [("tiny", 64, 512, ("fp8", "plain"))],
}
M_VALUES = {"device": (1, 4, 8, 16), "smoke": (1, 4)}
L2_MULTIPLE_BYTES = 512 << 20  # weight copies per graph: at least this many bytes (the L2 is 50-60 MB)
REPS, WARMUP = 30, 5
BUDGET_S = 105.0  # the whole sweep stays within ~2 minutes on the device
SPLITS = (1, 2, 4, 8)


def candidates(kind: str, n: int, k: int, m: int, num_sms: int, smoke: bool = False) -> list[tuple]:
    """The configurations worth timing for one shape: a fixed base per (weights, M bucket), times
    the split-K values that leave 2-8 programs per SM and >= 2 BLOCK_Ks per split."""
    if smoke:
        return [("fma" if m <= 4 else "dot", 16, 256, s, 4, 2) for s in (1, 2)]
    # Every program re-reads x ([M, its K range]) from L2: BLOCK_N well above 2 * M keeps that
    # traffic below the weight bytes; shared memory holds (num_stages - 1) x and W tiles.
    # At ~4.8 TB/s an SM must retire ~18 e4m3 weights per clock.
    # The fma loop spends ~2.5 instructions per weight on its own plus ~2 per x element a thread
    # holds, so tiles where each thread owns several rows (BLOCK_N large for its warps) are
    # leaner; the dot loop converts only W (the tensor cores do the rest).
    if m == 1:
        base = [("fma", 8, 512, 2, 3), ("fma", 16, 512, 2, 3), ("fma", 16, 512, 4, 3), ("fma", 16, 512, 4, 4),
                ("fma", 32, 512, 2, 3), ("fma", 32, 512, 4, 3), ("fma", 32, 256, 4, 3), ("fma", 64, 256, 4, 3),
                ("dot", 16, 256, 4, 3), ("dot", 32, 256, 4, 3), ("dot", 64, 256, 4, 3)]
    elif m <= 4:
        base = [("fma", 8, 512, 4, 3), ("fma", 16, 512, 4, 3), ("fma", 16, 256, 4, 3), ("fma", 16, 512, 8, 3),
                ("fma", 16, 256, 4, 5), ("fma", 32, 256, 8, 3),
                ("dot", 16, 256, 4, 3), ("dot", 32, 256, 4, 3), ("dot", 64, 256, 4, 3), ("dot", 64, 128, 4, 4)]
    else:
        base = [("dot", bn, b, 4, 3) for bn in (32, 64) for b in (128, 256)]
        base += [("dot", 64, 256, 4, 4), ("dot", 128, 256, 8, 3), ("dot", 16, 256, 4, 3), ("dot", 32, 128, 4, 5),
                 ("dot", 64, 512, 4, 2), ("dot", 64, 128, 4, 5)]
    if kind == "fp8":
        # FP8 codes: the f16 tensor cores (dot16) take the bf16 dot's place, the same product with
        # one e4m3 -> f16 cvt per two codes instead of three per code (bf16); more of them.
        base = [("dot16", *c[1:]) if c[0] == "dot" else c for c in base]
        base += [("dot16", bn, b, w, st) for bn, b, w, st in
                 ((32, 512, 4, 3), (64, 512, 4, 3), (64, 256, 8, 3), (128, 256, 8, 3))
                 if ("dot16", bn, b, w, st) not in base]
        # ... padded to 64 rows: f16 wgmma (W converted into shared memory)
        base += [("wg16", bn, b, w, st) for bn, b, w, st in ((64, 128, 4, 3), (128, 128, 8, 3), (64, 256, 4, 2))]
        # e4m3 x e4m3 on the tensor cores (x quantized in-kernel, lossy): BLOCK_M is 16 whatever M is
        base += [("dot8", bn, b, w, st) for bn, b, w, st in ((32, 256, 4, 3), (64, 256, 4, 3))]
        # the same padded to 64 rows: Hopper's native e4m3 wgmma
        base += [("wg8", bn, b, w, st) for bn, b, w, st in
                 ((32, 128, 4, 3), (64, 128, 4, 3), (128, 128, 8, 3), (64, 256, 4, 2))]
        # the product swapped (W the wgmma's 64-row operand straight from shared memory, x its
        # 16 columns): native e4m3 without padding x to 64 rows
        base += [("sw8", bn, b, w, st) for bn, b, w, st in
                 ((64, 128, 4, 3), (64, 256, 4, 3), (64, 512, 4, 2), (128, 256, 4, 3), (128, 256, 8, 3))]
    out = []
    for variant, bn, b, w, st in base:
        tiles = -(-n // bn)
        k_blocks = -(-k // b)
        for s in SPLITS:
            if s > 1 and (k_blocks // s < 2 or n > 65536):
                continue
            if not 2 * num_sms <= tiles * s <= 8 * num_sms and not (s == 1 and tiles > 8 * num_sms):
                continue
            out.append((variant, bn, b, s, w, st))
    if kind == "fp8" and m <= MMA_MAX_M:
        out += mma_candidates(n, k, num_sms)
    return out


MMA_MAX_M = 8  # engine/kernels/fp8_mma.py's MAX_M (not imported here: candidates() is called before torch loads)
# (BLOCK_N rows a CTA, BLOCK_K k a warp's step, warps, weight buffers) of the CUDA mma kernel;
# 32-row CTAs only single-buffered (two buffers of 32 x 512 codes a lane would spill).
MMA_BASE = [(16, 256, 8, 2), (16, 256, 4, 2), (16, 128, 8, 2), (16, 512, 8, 1), (16, 256, 8, 1),
            (16, 512, 4, 2), (32, 256, 8, 1), (32, 256, 4, 1)]


def mma_candidates(n: int, k: int, num_sms: int) -> list[tuple]:
    """The mma kernel's launches worth timing: MMA_BASE times the splits that give at least one
    CTA per SM without leaving a warp of a CTA no k step (k_split >= warps x BLOCK_K)."""
    out = []
    for bn, bk, w, st in MMA_BASE:
        tiles = -(-n // bn)
        for s in (1, 2, 4):
            if s > 1 and (tiles * s > 8 * num_sms or k // s < w * bk or (k // s) % 128):
                continue
            if tiles * s < num_sms and s < 4:
                continue
            out.append(("mma", bn, bk, s, w, st))
    return out


def _effective(cfg: tuple, k: int) -> tuple:
    """The launch gemv.launch actually makes of cfg for K (split clamped, no empty splits)."""
    from specdeploy.engine.kernels import gemv
    variant, bn, bk, s, w, st = cfg
    k_blocks = -(-k // bk)
    s = max(1, min(s, k_blocks, gemv.GEMV_MAX_SPLIT_K))
    k_split = -(-k_blocks // s) * bk
    return (variant, bn, bk, -(-k // k_split), w, st)


def _tensors(kind: str, n: int, k: int, device, copies: int = 1):
    """`copies` equal weights [N, K] (e4m3 codes + block scales, or bf16) as (weight, scale) pairs."""
    from specdeploy.engine.models import fp8
    g = torch.Generator(device=device).manual_seed(0)
    base = torch.randn(n, k, device=device, generator=g) * 0.02
    if kind == "fp8":
        codes, scale = fp8.quantize_fp8_block(base, (128, 128))
    else:
        codes, scale = base.to(torch.bfloat16), None
    del base
    return [(codes, scale)] + [(codes.clone(), scale) for _ in range(copies - 1)]


def _call(kind, x, w, s, y, cfg):
    from specdeploy.engine.kernels import gemv
    if cfg[0] == "cublas":
        torch.mm(x, w.t(), out=y)  # F.linear's cuBLAS GEMM, into y
    elif cfg[0] == "w8a16":
        from specdeploy.engine.kernels import fp8 as fp8_kernels
        fp8_kernels.w8a16(x, w, s, 128, None, y, *fp8_kernels._decode_tiles(x.shape[0], w.shape[0]))
    else:
        gemv.launch(x, w, s, 128, None, y, *cfg)


def _reference(kind, x, w, s):
    """x @ W^T in float32 over the dequantized weights: what every launch is checked against."""
    from specdeploy.engine.models import fp8
    wd = fp8.dequantize_fp8(w, s, (128, 128), torch.float32) if kind == "fp8" else w.float()
    return torch.nn.functional.linear(x.float(), wd)


def _relative_error(got, want) -> float:
    return float((got.float() - want).norm() / want.norm())


def _tolerance(cfg) -> float:
    """Relative L2 a launch may be off: 2^-7 for the weight-only product (bf16 output rounding,
    f16 x), 0.04 where the kernel quantizes x to e4m3 (3 mantissa bits)."""
    from specdeploy.engine.kernels import gemv
    return 0.04 if cfg[0] in gemv.QUANTIZING_VARIANTS else 2**-7


def _time_without_early_loads(calls_for, cfg, device, copies) -> float | None:
    """µs of the mma launch `cfg` with its first weight loads after the PDL wait instead of before
    (fp8_mma.EARLY_LOADS off), to say whether the early loads pay."""
    from specdeploy.engine.kernels import fp8_mma
    saved = fp8_mma.EARLY_LOADS
    fp8_mma.EARLY_LOADS = False
    try:
        return calls_ms(calls_for(tuple(cfg)), device, warmup=WARMUP, reps=REPS) / copies * 1e3
    except Exception:  # noqa: BLE001 - recorded as not measured
        return None
    finally:
        fp8_mma.EARLY_LOADS = saved


def _compile_jobs(jobs: list, device) -> None:
    """Launch each (kind, k, m, cfg) once on a narrow weight (256 rows: the same specialization as
    the real N) so that Triton compiles and caches it."""
    for kind, k, m, cfg in jobs:
        ((w, s),) = _tensors(kind, 256, k, device)
        x = torch.randn(m, k, device=device).to(torch.bfloat16)
        y = torch.empty(m, 256, device=device, dtype=torch.bfloat16)
        try:
            _call(kind, x, w, s, y, cfg)
        except Exception as e:  # a configuration the compiler refuses: the sweep records it
            print(f"compile {kind} {k} {m} {cfg}: {str(e)[:120]}", flush=True)
    torch.cuda.synchronize()


def precompile(jobs: list, workers: int) -> float:
    """Compile every job in `workers` processes in parallel; returns the seconds it took."""
    t0 = time.time()
    jobs = sorted(set(jobs))
    path = Path(os.environ.get("TMPDIR", "/tmp")) / f"gemv_jobs_{os.getpid()}.json"
    path.write_text(json.dumps(jobs))
    procs = [subprocess.Popen([sys.executable, __file__, "--compile-worker", str(path), str(i), str(workers)])
             for i in range(workers)]
    for p in procs:
        p.wait()
    path.unlink(missing_ok=True)
    return time.time() - t0


def sweep(device, out_dir: Path | None = None, smoke: bool = False, workers: int | None = None,
          budget_s: float = BUDGET_S, kinds: tuple[str, ...] = ("fp8", "plain"), m_values: tuple[int, ...] | None = None) -> dict:
    """Time the configuration space at every shape; returns {"rows": [...], "table": {...}} with the
    best launch per (kind, N, K, M bucket) (bucket 8 takes bucket 16's winner where M 8 is not timed). Past `budget_s`
    the remaining shapes time only the baseline and the heuristic's launch (the row says so)."""
    from specdeploy.engine.kernels import gemv
    size = "smoke" if smoke else "device"
    t0 = time.time()
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132
    bandwidth = copy_bandwidth_bytes_per_s(device=device) if device.type == "cuda" else 1e11
    plan = []  # FP8 shapes first: past the budget only the plain-weight (cuBLAS-or-not) rows are cut
    for kind in kinds:
        for name, n, k, shape_kinds in SHAPES[size]:
            for m in (m_values or M_VALUES[size]) if kind in shape_kinds else ():
                plan.append((name, n, k, kind, m, candidates(kind, n, k, m, num_sms, smoke)))
    if device.type == "cuda":
        jobs = [(kind, k, m, _effective(c, k)) for _, n, k, kind, m, cands in plan for c in cands if c[0] != "mma"]
        jobs += [("fp8", k, m, ("w8a16",)) for _, n, k, kind, m, _ in plan if kind == "fp8"]
        secs = precompile([(a, b, c, tuple(d)) for a, b, c, d in jobs], workers or min(16, os.cpu_count() or 1))
        log(f"compiled {len(set(jobs))} launches in {secs:.0f} s")
    rows, table = [], {}
    for name, n, k, kind, m, cands in plan:
        w_bytes = n * k * (1 if kind == "fp8" else 2)
        copies = max(1, -(-L2_MULTIPLE_BYTES // w_bytes)) if device.type == "cuda" else 1
        weights = _tensors(kind, n, k, device, copies)
        x = torch.randn(m, k, device=device).to(torch.bfloat16)
        ys = [torch.empty(m, n, device=device, dtype=torch.bfloat16) for _ in range(copies)]
        moved = w_bytes + (weights[0][1].numel() * 4 if kind == "fp8" else 0) + 2 * m * (k + n)
        want = _reference(kind, x, *weights[0])
        results = []
        baseline_cfg = ("w8a16",) if kind == "fp8" else ("cublas",)
        over_budget = time.time() - t0 > budget_s
        if over_budget:
            cands = [tuple(gemv.heuristic_config("fp8", n, k, m, num_sms))]
        def make_calls(cfg, kind=kind, x=x, weights=weights, ys=ys):
            return [lambda w=w, s=s, y=y: _call(kind, x, w, s, y, cfg) for (w, s), y in zip(weights, ys)]

        for cfg in [baseline_cfg] + cands:
            calls = make_calls(cfg)
            try:
                ys[0].fill_(float("nan"))
                calls[0]()
                err = _relative_error(ys[0], want)
                # judged on the device; under the smoke run's interpreter the w8a16 baseline reads
                # garbage at one row (the GPU tests hold it to the weight-only bound)
                if device.type == "cuda" and not err <= _tolerance(cfg):
                    results.append({"config": list(cfg), "relative_error": err, "error": "wrong result"})
                    continue
                ms = calls_ms(calls, device, warmup=WARMUP, reps=REPS, cpu_reps=3) / copies
            except Exception as e:  # a configuration the compiler or the device refuses
                results.append({"config": list(cfg), "error": str(e)[:200]})
                continue
            results.append({"config": list(cfg), "us": ms * 1e3, "tb_s": moved / (ms / 1e3) / 1e12,
                            "fraction_of_copy_bandwidth": moved / (ms / 1e3) / bandwidth, "relative_error": err})
        ok = [r for r in results if "us" in r]
        base = next((r for r in ok if tuple(r["config"]) == baseline_cfg), None)
        kernel = [r for r in ok if r["config"][0] not in ("cublas", "w8a16", "mma")]
        best = min(kernel, key=lambda r: r["us"]) if kernel else None
        mma = [r for r in ok if r["config"][0] == "mma"]
        best_mma = min(mma, key=lambda r: r["us"]) if mma else None
        early_off = (_time_without_early_loads(make_calls, best_mma["config"], device, copies)
                     if best_mma and device.type == "cuda" else None)
        choice = best
        if kind == "plain" and base is not None and (best is None or base["us"] <= best["us"]):
            choice = {"config": ["cublas", 0, 0, 1, 0, 0], "us": base["us"]}
        for key_kind, pick in ((kind, choice), ("mma", best_mma if best_mma and (best is None or best_mma["us"] < best["us"]) else None)):
            if pick is not None:
                table[(key_kind, n, k, gemv.m_bucket(m))] = tuple(pick["config"])
                if m == 16 and 8 not in (m_values or M_VALUES[size]) and key_kind != "mma":
                    table[(key_kind, n, k, 8)] = tuple(pick["config"])
        default = gemv.config_for(kind, n, k, m, device) if not gemv.GEMV_TABLE else None
        row = {"name": name, "n": n, "k": k, "m": m, "weights": kind, "bytes": moved, "copies": copies,
               "baseline": base, "best": best, "best_mma": best_mma, "best_mma_us_without_early_loads": early_off,
               "chosen": list(choice["config"]) if choice else None,
               "heuristic": list(default) if default else None, "over_budget": over_budget, "all": results}
        rows.append(row)
        speedup = base["us"] / best["us"] if base and best else float("nan")
        log(f"{kind:<5} {name:<8} N={n:<6} K={k:<5} M={m:<2} "
            f"{baseline_cfg[0]} {base['us'] if base else float('nan'):7.1f} us "
            f"{base['tb_s'] if base else float('nan'):.2f} TB/s | best {tuple(best['config']) if best else None} "
            f"{best['us'] if best else float('nan'):7.1f} us {best['tb_s'] if best else float('nan'):.2f} TB/s "
            f"= {100 * (best['fraction_of_copy_bandwidth'] if best else float('nan')):.1f}% of copy | "
            f"{speedup:.2f}x {baseline_cfg[0]} | table {tuple(choice['config']) if choice else None}"
            + (f" | mma {tuple(best_mma['config'])} {best_mma['us']:7.1f} us = "
               f"{100 * best_mma['fraction_of_copy_bandwidth']:.1f}% of copy (without early loads "
               f"{early_off if early_off is None else round(early_off, 1)} us)" if best_mma else "")
            + (" (over budget: heuristic only)" if over_budget else ""))
        del weights, ys, make_calls
        free_device_memory()
    result = {"environment": environment(), "bandwidth_bytes_per_s": bandwidth, "num_sms": num_sms,
              "rows": rows, "table": {repr(k): list(v) for k, v in table.items()},
              "wall_s": time.time() - t0}
    literal = table_literal(table)
    if out_dir is not None:
        write_json("gemv_sweep.json", result, out_dir)
        (out_dir / "gemv_table.py").write_text(literal)
    print(literal, flush=True)
    result["table_tuples"] = table
    log(f"gemv sweep: {len(rows)} shapes in {result['wall_s']:.0f} s")
    return result


def table_literal(table: dict) -> str:
    """GEMV_TABLE as Python source, one entry a line, ready to paste into engine/kernels/gemv.py."""
    lines = ["GEMV_TABLE: dict[tuple[str, int, int, int], tuple[str, int, int, int, int, int]] = {"]
    for key in sorted(table):
        lines.append(f"    {key!r}: {tuple(table[key])!r},")
    lines.append("}")
    return "\n".join(lines) + "\n"


def load_table(path: Path) -> dict:
    """The GEMV_TABLE literal of a gemv_table.py this script wrote (or any file assigning one)."""
    import ast
    for node in ast.parse(Path(path).read_text()).body:
        target = node.target if isinstance(node, ast.AnnAssign) else (node.targets[0] if isinstance(node, ast.Assign) else None)
        if isinstance(target, ast.Name) and target.id == "GEMV_TABLE":
            return ast.literal_eval(node.value)
    raise ValueError(f"{path}: no GEMV_TABLE assignment")


def install(table: dict) -> None:
    """Use `table` ((kind, N, K, M bucket) -> launch) for this process's gemv launches."""
    from specdeploy.engine.kernels import gemv
    gemv.install_table(table)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--smoke", action="store_true", help="CPU (Triton interpreter), tiny: checks the script")
    parser.add_argument("--workers", type=int, default=None, help="compile processes (default: min(16, cores))")
    parser.add_argument("--budget-s", type=float, default=BUDGET_S,
                        help="seconds after which the remaining shapes time only the heuristic launch")
    parser.add_argument("--weights", default="fp8,plain", help="weight kinds to sweep (comma-separated: fp8, plain)")
    parser.add_argument("--m", default=None, help="rows to sweep (comma-separated; default 1,4,8,16)")
    parser.add_argument("--compile-worker", nargs=3, metavar=("JOBS", "INDEX", "COUNT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.compile_worker:
        path, index, count = args.compile_worker
        jobs = [(a, b, c, tuple(d)) for a, b, c, d in json.loads(Path(path).read_text())]
        _compile_jobs(jobs[int(index)::int(count)], torch.device("cuda"))
        return 0
    if args.out is None:
        parser.error("--out is required")
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    result = sweep(device, args.out, smoke=args.smoke, workers=args.workers, budget_s=args.budget_s,
                   kinds=tuple(args.weights.split(",")), m_values=tuple(int(v) for v in args.m.split(",")) if args.m else None)
    return 0 if result["rows"] and all(r["best"] for r in result["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
