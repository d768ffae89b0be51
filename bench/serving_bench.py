"""The standard serving benchmark: guidellm (the vLLM project's load generator) against
`specdeploy engine serve`'s OpenAI server, for target-only, fixed speculation and adaptive
speculation, at a few Poisson request rates up to saturation.

    python3 bench/serving_bench.py --out DIR          # on a GPU: 3 modes x 4 rates, ~6 min
    python3 bench/serving_bench.py --smoke --out DIR  # CPU, tiny pair, one rate, a handful of requests

The workload is generated locally by guidellm's synthetic_text source (no data set download): a
chat-like length distribution (prompt and output lengths drawn around a mean with a spread, clipped
to a range) behind a shared prefix (a few system prompts, one per request, so the prefix cache sees
reuse). Requests go to /v1/completions, streamed, with ignore_eos so each produces its sampled
length. The pair is the one bench/disagg_serving.py serves: a predictable target and an EAGLE head
copied from it (built in seconds, no training), so the draft is accepted as it would be for a
well-trained head; the figures measure the serving path, not a head's quality.

Per mode, one server (its log in DIR/logs/MODE.log) and one guidellm run over every rate (its own
report in DIR/guidellm_MODE.json). Writes DIR/serving_bench.json: per mode and rate the offered and
achieved request rate, output tok/s (output tokens over the measured window), TTFT and ITL p50/p99
(ms), and the requests answered, errored and left incomplete. bench/report.py renders it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import REPO_ROOT  # noqa: E402
from disagg_serving import build_models, free_ports, running, spawn, wait_ready  # noqa: E402

MODES = ("target-only", "fixed", "adaptive")
# Engine flags per mode: fixed is the EAGLE chain bench/disagg_serving.py serves; adaptive lets the
# engine choose NONE, shorter chains or that shape each step (docs/engine.md, adaptive speculation).
MODE_FLAGS = {"target-only": ["--algorithm", "NONE"],
              "fixed": ["--algorithm", "EAGLE", "--num-steps", "3", "--topk", "1", "--num-draft-tokens", "4"],
              "adaptive": ["--algorithm", "EAGLE", "--num-steps", "3", "--topk", "1", "--num-draft-tokens", "4",
                           "--adaptive-speculation"]}
WORKLOADS = {
    # Chat-like: prompts around 512 tokens (wide spread), answers around 128, behind one of 4
    # shared 256-token system prompts. Rates up to past saturation of the 1B-class pair.
    "device": {"prompt_tokens": 512, "prompt_tokens_stdev": 384, "prompt_tokens_min": 32, "prompt_tokens_max": 3072,
               "output_tokens": 128, "output_tokens_stdev": 96, "output_tokens_min": 8, "output_tokens_max": 512,
               "prefix_tokens": 256, "prefix_count": 4},
    "smoke": {"prompt_tokens": 40, "prompt_tokens_stdev": 20, "prompt_tokens_min": 8, "prompt_tokens_max": 120,
              "output_tokens": 12, "output_tokens_stdev": 6, "output_tokens_min": 4, "output_tokens_max": 24,
              "prefix_tokens": 32, "prefix_count": 2},
}
RUNS = {"device": {"rates": [2.0, 8.0, 32.0, 128.0], "max_seconds": 20, "max_requests": 1000,
                   "max_running_requests": 64},
        "smoke": {"rates": [4.0], "max_seconds": 60, "max_requests": 5, "max_running_requests": 8}}


def server_argv(mode: str, port: int, target_dir: Path, draft_dir: Path, size: dict, max_running: int) -> list[str]:
    argv = [sys.executable, "-P", "-m", "specdeploy.cli", "engine", "serve", "--target", str(target_dir),
            "--dtype", size["dtype"], "--served-model-name", "bench", "--max-running-requests", str(max_running),
            "--max-total-tokens", str(size["max_total_tokens"]),
            "--context-length", str(size["model"]["max_position_embeddings"]),
            "--host", "127.0.0.1", "--port", str(port), *MODE_FLAGS[mode]]
    if mode != "target-only":
        argv[argv.index("--dtype"):argv.index("--dtype")] = ["--draft", str(draft_dir)]
    return argv


def scenario(url: str, tokenizer_dir: Path, workload: dict, run: dict, report: Path) -> dict:
    """guidellm's scenario file: one Poisson benchmark per rate, each stopped at max_seconds or
    max_requests, whichever comes first."""
    return {"spec": {
        "backend": {"kind": "openai_http", "target": url, "model": "bench", "request_format": "/v1/completions",
                    "timeout": 600},
        "tokenizer": {"kind": "huggingface_auto", "model": str(tokenizer_dir)},
        "profile": {"kind": "poisson", "rate": run["rates"]},
        "data": [{"kind": "synthetic_text", **workload}],
        "seed": {"kind": "static", "value": 0},
        "constraints": [{"kind": "max_duration", "seconds": run["max_seconds"]},
                        {"kind": "max_requests", "count": run["max_requests"]}],
        "outputs": [{"kind": "json", "path": str(report)}]}}


def guidellm_command() -> list[str]:
    exe = shutil.which("guidellm", path=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))
    return [exe] if exe else [sys.executable, "-m", "guidellm"]


def run_guidellm(scen: dict, work: Path, name: str, workers: int, timeout_s: float) -> dict:
    path = work / f"scenario_{name}.json"
    path.write_text(json.dumps(scen, indent=1))
    env = dict(os.environ, GUIDELLM__LOGGING__LOG_FILE=str(work / "logs" / f"guidellm_{name}.log"),
               GUIDELLM__MAX_WORKER_PROCESSES=str(workers),
               # forkserver: workers fork from one warm interpreter instead of each re-importing
               GUIDELLM__MP_CONTEXT_TYPE="forkserver")
    with open(work / "logs" / f"guidellm_{name}.out", "w") as out:
        proc = subprocess.run([*guidellm_command(), "run", "-c", str(path), "--disable-console-interactive"],
                              stdout=out, stderr=subprocess.STDOUT, env=env, cwd=work, timeout=timeout_s)
    report = Path(scen["spec"]["outputs"][0]["path"])
    if proc.returncode != 0 or not report.is_file():
        tail = (work / "logs" / f"guidellm_{name}.out").read_text(errors="replace")[-3000:]
        raise RuntimeError(f"guidellm exited with {proc.returncode} for {name}:\n{tail}")
    return json.loads(report.read_text())


def summarize(report: dict) -> list[dict]:
    """guidellm's report -> one row per benchmark (rate): the figures the serving table shows."""
    rows = []
    for b in report["benchmarks"]:
        m = b["metrics"]
        sched = b["scheduler_metrics"]
        window = sched["measure_end_time"] - sched["measure_start_time"]
        totals = m["request_totals"]

        def pct(key, p):
            ok = m[key]["successful"]
            return ok["percentiles"][p] if ok.get("count") else None

        rows.append({
            "rate": b["config"]["strategy"]["rate"],
            "achieved_requests_per_s": totals["successful"] / window if window > 0 else None,
            "output_tok_s": m["output_token_count"]["successful"]["total_sum"] / window if window > 0 else None,
            "ttft_ms_p50": pct("time_to_first_token_ms", "p50"), "ttft_ms_p99": pct("time_to_first_token_ms", "p99"),
            "itl_ms_p50": pct("inter_token_latency_ms", "p50"), "itl_ms_p99": pct("inter_token_latency_ms", "p99"),
            "requests": {k: totals[k] for k in ("successful", "errored", "incomplete", "total")},
            "output_tokens": m["output_token_count"]["successful"]["total_sum"],
            "window_s": window,
        })
    return rows


def guidellm_version() -> str | None:
    try:
        from importlib.metadata import version
        return version("guidellm")
    except Exception:  # noqa: BLE001 - the version is a label, the run stands without it
        return None


def commit() -> str | None:
    """This checkout's commit; None where it has no .git of its own (a copied tree would otherwise
    report the commit of whatever checkout encloses it)."""
    if not (REPO_ROOT / ".git").exists():
        return None
    try:
        out = subprocess.run(["git", "-C", str(REPO_ROOT), "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, timeout=10)
        return out.stdout.strip() or None
    except OSError:
        return None


def bench(out_dir: Path, smoke: bool, modes: list[str], workers: int, run_overrides: dict | None = None) -> dict:
    import disagg_serving
    import torch

    kind = "smoke" if smoke else "device"
    size = disagg_serving.SIZES[kind]
    run, workload = {**RUNS[kind], **(run_overrides or {})}, WORKLOADS[kind]
    logs = out_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    result = {"tool": "guidellm", "tool_version": guidellm_version(), "size": kind,
              "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
              "environment": {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                              "commit": commit()},
              "model": {**size["model"], "vocab_size": size["vocab_size"], "dtype": size["dtype"],
                        "pair": "predictable target + EAGLE head copied from it (bench/disagg_serving.py)"},
              "workload": {"request_format": "/v1/completions", "stream": True, **workload}, "run": run,
              "modes": {}}
    with tempfile.TemporaryDirectory() as tmp:
        target_dir, draft_dir = build_models(Path(tmp), size)
        for mode in modes:
            (port,) = free_ports(1)
            srv = spawn(mode, server_argv(mode, port, target_dir, draft_dir, size, run["max_running_requests"]),
                        f"http://127.0.0.1:{port}", logs)
            with running(srv):
                wait_ready(srv)
                t0 = time.monotonic()
                report = run_guidellm(scenario(srv.url, target_dir, workload, run, out_dir / f"guidellm_{mode}.json"),
                                      out_dir, mode, workers, timeout_s=len(run["rates"]) * (run["max_seconds"] + 300))
                result["modes"][mode] = {"server": srv.proc.args[3:], "wall_s": time.monotonic() - t0,
                                         "rows": summarize(report)}
            # Each mode's rows as soon as they exist: a sweep cut short keeps what it measured.
            (out_dir / "serving_bench.json").write_text(json.dumps(result, indent=2))
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny pair, one rate, a handful of requests")
    ap.add_argument("--out", default=".")
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    ap.add_argument("--workers", type=int, default=None, help="guidellm worker processes (default: 1 smoke, 4 device)")
    ap.add_argument("--rates", default=None, help="comma-separated offered request rates (default: the size's)")
    ap.add_argument("--max-seconds", type=float, default=None, help="each rate's duration cap (default: the size's)")
    args = ap.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        print(f"serving_bench: unknown mode(s) {', '.join(bad) or '(none)'}; choose from {', '.join(MODES)}",
              file=sys.stderr)
        return 2
    overrides = {}
    try:
        if args.rates:
            overrides["rates"] = [float(x) for x in args.rates.split(",") if x]
    except ValueError:
        print(f"serving_bench: --rates takes numbers separated by commas, not {args.rates!r}", file=sys.stderr)
        return 2
    if args.max_seconds:
        overrides["max_seconds"] = args.max_seconds
    out_dir = Path(args.out)
    result = bench(out_dir, args.smoke, modes, args.workers or (1 if args.smoke else 4), overrides)
    out = out_dir / "serving_bench.json"
    out.write_text(json.dumps(result, indent=2))
    print(f"{'mode':<12} {'rate':>6} {'req/s':>6} {'out tok/s':>10} {'TTFT p50':>9} {'p99':>8} {'ITL p50':>8} {'p99':>7}")
    for mode, rec in result["modes"].items():
        for r in rec["rows"]:
            print(f"{mode:<12} {r['rate']:6.1f} {r['achieved_requests_per_s'] or 0:6.2f} {r['output_tok_s'] or 0:10.1f} "
                  f"{r['ttft_ms_p50'] or 0:9.1f} {r['ttft_ms_p99'] or 0:8.1f} {r['itl_ms_p50'] or 0:8.2f} "
                  f"{r['itl_ms_p99'] or 0:7.2f}")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
