"""The standard serving benchmark: guidellm (the vLLM project's load generator) against
`specdeploy engine serve`'s OpenAI server, for target-only, fixed speculation and adaptive
speculation, at a few Poisson request rates up to saturation.

    python3 bench/serving_bench.py --out DIR --budget-s 200   # on a GPU: 3 modes, ends within 200 s
    python3 bench/serving_bench.py --smoke --out DIR          # CPU, tiny pair, one rate, a handful of requests

The workload is generated locally by guidellm's synthetic_text source (no data set download): a
chat-like length distribution (prompt and output lengths drawn around a mean with a spread, clipped
to a range) behind a shared prefix (a few system prompts, one per request, so the prefix cache sees
reuse). Requests go to /v1/completions, streamed, with ignore_eos so each produces its sampled
length. The pair is the one bench/disagg_serving.py serves: a predictable target and an EAGLE head
copied from it (built in seconds, no training), so the draft is accepted as it would be for a
well-trained head; the figures measure the serving path, not a head's quality.

No figure is cold: before guidellm, each server answers a few unmeasured requests of the
workload's shortest, mean and longest prompts (kernels compiled, caches allocated), and every rate
starts with guidellm's own warm-up phase (profile `warmup`, excluded from its metrics), so each
rate is measured in its steady state and not while the queue fills from empty.

Per mode, one server (its log in DIR/logs/MODE.log) and one guidellm run over every rate (its own
report in DIR/guidellm_MODE.json). DIR/serving_bench.json is written before the first mode and
again the moment each mode is summarized (before its server stops), so a run cut short keeps every
mode it finished. Per mode and rate: the offered and achieved request rate, output tok/s (output
tokens over the measured window), TTFT and ITL p50/p99 (ms), and the requests answered, refused by
the server (HTTP 429/503: its waiting-queue cap shedding load, as it should past saturation),
failed (any other error, by kind) and still in flight when the window closed. With --budget-s the
rates' durations are sized so the whole run ends within it (each mode's fixed cost, server start,
guidellm start and drain, measured on the modes before it); a mode that cannot fit is recorded as
skipped, not started.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import os
import re
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
# max_seconds: each rate's duration (its warm-up included), the cap --budget-s sizes below;
# warmup_s: guidellm's warm-up phase at the start of each rate, at most a quarter of its duration
# (smoke: one request instead, so the phase is exercised without a duration to spare).
RUNS = {"device": {"rates": [4.0, 16.0, 64.0], "max_seconds": 20, "max_requests": 1000,
                   "max_running_requests": 64, "warmup_s": 3.0},
        "smoke": {"rates": [4.0], "max_seconds": 60, "max_requests": 6, "max_running_requests": 8,
                  "warmup_requests": 1}}
# Unmeasured requests each server answers before guidellm starts (concurrently): the workload's
# shortest, mean and longest prompts.
PRIME_REQUESTS = {"device": 12, "smoke": 3}
# --budget-s: a mode's cost beyond its rates' durations (server start and stop, guidellm's start,
# data generation and drain at each rate) before one has been measured, and the least a rate may
# run; the run's last seconds are kept for writing and teardown.
FIRST_MODE_OVERHEAD_S = {"device": 40.0, "smoke": 30.0}
MIN_RATE_S = 3.0
HTTP_TIMEOUT_S = 600
BUDGET_RESERVE_S = 5.0
# Statuses with which the server refuses a request it cannot queue (engine/serving/limits.py and
# scheduler.py: the waiting-queue and concurrency caps answer 429, draining or stalled 503).
REFUSED_STATUS = (429, 503)


def server_argv(mode: str, port: int, target_dir: Path, draft_dir: Path, size: dict, max_running: int) -> list[str]:
    argv = [sys.executable, "-P", "-m", "specdeploy.cli", "engine", "serve", "--target", str(target_dir),
            "--dtype", size["dtype"], "--served-model-name", "bench", "--max-running-requests", str(max_running),
            "--max-total-tokens", str(size["max_total_tokens"]),
            "--context-length", str(size["model"]["max_position_embeddings"]),
            "--host", "127.0.0.1", "--port", str(port), *MODE_FLAGS[mode]]
    if mode != "target-only":
        argv[argv.index("--dtype"):argv.index("--dtype")] = ["--draft", str(draft_dir)]
    return argv


def warmup_phase(run: dict, seconds: float) -> dict:
    """guidellm's warm-up phase (TransientPhaseConfig) for a rate of `seconds`: requests in it are
    sent but left out of the metrics."""
    if run.get("warmup_requests"):
        return {"mode": "requests", "value": int(run["warmup_requests"])}
    return {"mode": "duration", "value": round(min(run.get("warmup_s", 0.0), seconds / 4), 3)}


def scenario(url: str, tokenizer_dir: Path, workload: dict, run: dict, report: Path) -> dict:
    """guidellm's scenario file: one Poisson benchmark per rate, each starting with its warm-up
    phase and stopped at max_seconds or max_requests, whichever comes first. The HTTP timeout
    outlasts any rate, so no request is cut by the client: one in flight at a rate's end is
    guidellm's incomplete, not an error."""
    return {"spec": {
        "backend": {"kind": "openai_http", "target": url, "model": "bench", "request_format": "/v1/completions",
                    "timeout": HTTP_TIMEOUT_S},
        "tokenizer": {"kind": "huggingface_auto", "model": str(tokenizer_dir)},
        "profile": {"kind": "poisson", "rate": run["rates"], "warmup": warmup_phase(run, run["max_seconds"])},
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


def error_kind(message: str | None) -> str:
    """An errored request's kind from guidellm's error text: "http <status>" for an HTTP error
    (guidellm keeps repr() of httpx's HTTPStatusError, "Client error '429 Too Many Requests' for
    url ..."), else cancelled, timeout, connection or other."""
    text = message or ""
    status = re.search(r"\b([1-5]\d\d) [A-Z][A-Za-z -]*'", text) or re.search(r"status(?: code)?[ =:]+([1-5]\d\d)", text)
    if status:
        return f"http {status.group(1)}"
    low = text.lower()
    if "cancelled" in low:
        return "cancelled"
    if "timeout" in low or "timed out" in low:
        return "timeout"
    if any(w in low for w in ("connect", "reset", "protocol", "disconnect", "closed")):
        return "connection"
    return "other"


STATUSES = ("successful", "errored", "incomplete")


def _started(rec: dict) -> float | None:
    t = (rec.get("info") or {}).get("timings") or {}
    return t.get("request_start") or t.get("resolve_start")


def measured_requests(benchmark: dict) -> dict[str, list[dict]] | None:
    """guidellm's request records of one benchmark started inside its measured window, by
    status: the warm-up's are left out (guidellm 0.8.1 leaves them out of its latency
    distributions but counts them in request_totals and the token sums). A record that never
    started (queued at the end) counts as measured. None where the report carries no records."""
    recs = benchmark.get("requests") or {}
    if not any(recs.get(k) for k in STATUSES):
        return None
    since = benchmark["scheduler_metrics"]["measure_start_time"] - 1e-6
    return {k: [r for r in (recs.get(k) or []) if _started(r) is None or _started(r) >= since] for k in STATUSES}


def error_breakdown(records: list[dict]) -> dict:
    """Errored request records by kind; refused: those the server answered with a status of
    REFUSED_STATUS (load shed past its queue cap), failed: the rest."""
    kinds: dict[str, int] = {}
    for rec in records:
        kind = error_kind((rec.get("info") or {}).get("error"))
        kinds[kind] = kinds.get(kind, 0) + 1
    refused = sum(n for k, n in kinds.items() if k in {f"http {c}" for c in REFUSED_STATUS})
    return {"kinds": dict(sorted(kinds.items())), "refused": refused, "failed": len(records) - refused}


def summarize(report: dict) -> list[dict]:
    """guidellm's report -> one row per benchmark (rate): the figures the serving table shows,
    counts and tokens over the requests of the measured window (after the warm-up)."""
    rows = []
    for b in report["benchmarks"]:
        m = b["metrics"]
        sched = b["scheduler_metrics"]
        window = sched["measure_end_time"] - sched["measure_start_time"]
        measured = measured_requests(b)
        if measured is None:  # no records: guidellm's totals (the warm-up's requests among them)
            totals = m["request_totals"]
            requests = {k: totals[k] for k in (*STATUSES, "total")}
            output_tokens = m["output_token_count"]["successful"]["total_sum"]
            errors = {"kinds": {}, "refused": 0, "failed": requests["errored"]}
            warmup_requests = None
        else:
            requests = {k: len(v) for k, v in measured.items()}
            requests["total"] = sum(requests.values())
            output_tokens = float(sum((r.get("output_metrics") or {}).get("text_tokens") or 0
                                      for r in measured["successful"]))
            errors = error_breakdown(measured["errored"])
            warmup_requests = m["request_totals"]["total"] - requests["total"]

        def pct(key, p):
            ok = m[key]["successful"]
            return ok["percentiles"][p] if ok.get("count") else None

        rows.append({
            "rate": b["config"]["strategy"]["rate"],
            "achieved_requests_per_s": requests["successful"] / window if window > 0 else None,
            "output_tok_s": output_tokens / window if window > 0 else None,
            "ttft_ms_p50": pct("time_to_first_token_ms", "p50"), "ttft_ms_p99": pct("time_to_first_token_ms", "p99"),
            "itl_ms_p50": pct("inter_token_latency_ms", "p50"), "itl_ms_p99": pct("inter_token_latency_ms", "p99"),
            "requests": requests, "errors": errors, "warmup_requests": warmup_requests,
            "output_tokens": output_tokens, "window_s": window,
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


def prime(url: str, workload: dict, vocab_size: int, count: int) -> int:
    """Unmeasured requests before guidellm, `count` at once: prompts of the workload's shortest,
    mean and longest lengths in turn, each answering its mean output length. Returns how many
    were answered; a server that refuses them fails here, before any figure."""
    import httpx

    lengths = [workload["prompt_tokens_min"], workload["prompt_tokens"],
               workload["prompt_tokens_max"] - workload["output_tokens_max"]]

    def one(i: int) -> int:
        n = max(1, lengths[i % len(lengths)])
        body = {"model": "bench", "prompt": [(7 * i + j) % vocab_size for j in range(n)],
                "max_tokens": workload["output_tokens"], "ignore_eos": True}
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=HTTP_TIMEOUT_S)
        r.raise_for_status()
        return 1

    with concurrent.futures.ThreadPoolExecutor(max_workers=count) as pool:
        return sum(pool.map(one, range(count)))


def spec_metrics(url: str) -> list[str]:
    """The server's speculation lines of /metrics at a mode's end (adaptive: the shape it chose
    last, steps per shape, acceptance, the crossover batch); [] where none or unreachable."""
    import httpx

    try:
        text = httpx.get(f"{url}/metrics", timeout=10).text
    except httpx.HTTPError:
        return []
    return [x for x in text.splitlines() if "spec_decode" in x and not x.startswith("#")]


def rate_seconds(budget_left_s: float, modes_left: int, num_rates: int, overhead_s: float, cap_s: float,
                 floor_s: float = MIN_RATE_S) -> float | None:
    """Each rate's duration for the next mode so it and the modes after it fit the budget left:
    an equal share per mode, less a mode's fixed cost, over its rates, at most cap_s; None where
    even floor_s per rate does not fit."""
    if modes_left < 1 or num_rates < 1:
        raise ValueError(f"modes_left and num_rates must be >= 1, got {modes_left}, {num_rates}")
    share = (budget_left_s / modes_left - overhead_s) / num_rates
    seconds = min(cap_s, share)
    return round(seconds, 1) if seconds >= floor_s else None


def measure_mode(srv, rec: dict, mode: str, mode_run: dict, target_dir: Path, workload: dict, size: dict,
                 kind: str, out_dir: Path, workers: int, deadline: float | None, save) -> None:
    """One mode on its started server: ready, primed, guidellm over every rate (cut at the
    deadline), its rows and speculation metrics into `rec`, saved before the server stops."""
    mode_t0 = time.monotonic()
    wait_ready(srv, timeout_s=600 if deadline is None else max(1.0, deadline - time.monotonic()))
    rec["start_s"] = time.monotonic() - mode_t0
    rec["primed"] = prime(srv.url, workload, size["vocab_size"], PRIME_REQUESTS[kind])
    t0 = time.monotonic()
    timeout = len(mode_run["rates"]) * (mode_run["max_seconds"] + 300)
    if deadline is not None:
        timeout = max(1.0, deadline - time.monotonic())
    report_path = out_dir / f"guidellm_{mode}.json"
    try:
        report = run_guidellm(scenario(srv.url, target_dir, workload, mode_run, report_path),
                              out_dir, mode, workers, timeout_s=timeout)
    except subprocess.TimeoutExpired:
        rec["cut"] = f"guidellm still running at the time budget's end ({timeout:.0f} s)"
        report = json.loads(report_path.read_text()) if report_path.is_file() else {"benchmarks": []}
    rec["wall_s"] = time.monotonic() - t0
    rec["rows"] = summarize(report)
    rec["spec_metrics"] = spec_metrics(srv.url)
    # Each mode's rows as soon as they exist, before its server stops: a run cut short keeps
    # what it measured.
    save()


def bench(out_dir: Path, smoke: bool, modes: list[str], workers: int, run_overrides: dict | None = None,
          budget_s: float | None = None, command: str | None = None) -> dict:
    import disagg_serving
    import torch

    started = time.monotonic()
    kind = "smoke" if smoke else "device"
    size = disagg_serving.SIZES[kind]
    run, workload = {**RUNS[kind], **(run_overrides or {})}, WORKLOADS[kind]
    if budget_s is not None:
        run["budget_s"] = budget_s
    logs = out_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    result = {"tool": "guidellm", "tool_version": guidellm_version(), "size": kind,
              "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
              "environment": {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                              "commit": commit()},
              "command": command,
              "model": {**size["model"], "vocab_size": size["vocab_size"], "dtype": size["dtype"],
                        "pair": "predictable target + EAGLE head copied from it (bench/disagg_serving.py)"},
              "workload": {"request_format": "/v1/completions", "stream": True, **workload},
              "run": {**run, "prime_requests": PRIME_REQUESTS[kind], "http_timeout_s": HTTP_TIMEOUT_S},
              "modes": {}}
    out = out_dir / "serving_bench.json"

    def save() -> None:
        tmp = out.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(result, indent=2))
        tmp.replace(out)

    save()
    overhead = FIRST_MODE_OVERHEAD_S[kind]
    with tempfile.TemporaryDirectory() as tmp:
        target_dir, draft_dir = build_models(Path(tmp), size)
        for i, mode in enumerate(modes):
            mode_run = dict(run)
            deadline = None
            if budget_s is not None:
                left = budget_s - BUDGET_RESERVE_S - (time.monotonic() - started)
                seconds = rate_seconds(left, len(modes) - i, len(run["rates"]), overhead, run["max_seconds"])
                if seconds is None:
                    result["modes"][mode] = {"skipped": f"{left:.0f} s of the {budget_s:.0f} s budget left, "
                                                        f"{MIN_RATE_S:.0f} s per rate and {overhead:.0f} s of a "
                                                        "mode's own cost do not fit", "rows": []}
                    save()
                    continue
                mode_run["max_seconds"] = seconds
                deadline = started + budget_s - BUDGET_RESERVE_S
            mode_t0 = time.monotonic()
            (port,) = free_ports(1)
            srv = spawn(mode, server_argv(mode, port, target_dir, draft_dir, size, run["max_running_requests"]),
                        f"http://127.0.0.1:{port}", logs)
            rec = {"server": srv.proc.args[3:], "max_seconds": mode_run["max_seconds"],
                   "warmup": warmup_phase(mode_run, mode_run["max_seconds"]), "rows": []}
            result["modes"][mode] = rec
            with running(srv):
                try:
                    measure_mode(srv, rec, mode, mode_run, target_dir, workload, size, kind, out_dir, workers,
                                 deadline, save)
                except Exception as e:  # noqa: BLE001 - recorded: the modes before and after stand
                    over_budget = deadline is not None and time.monotonic() >= deadline - 1.0
                    rec["cut" if over_budget else "error"] = (
                        f"{'the time budget ran out: ' if over_budget else ''}{type(e).__name__}: {e}"[:2000])
                    print(f"serving_bench: {mode}: {rec.get('cut') or rec.get('error')}\n{srv.tail()}",
                          file=sys.stderr)
                save()
            rec["mode_wall_s"] = time.monotonic() - mode_t0
            overhead = max(0.0, rec["mode_wall_s"] - len(run["rates"]) * mode_run["max_seconds"])
            save()
    result["wall_s"] = time.monotonic() - started
    save()
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny pair, one rate, a handful of requests")
    ap.add_argument("--out", default=".")
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    ap.add_argument("--workers", type=int, default=None, help="guidellm worker processes (default: 1 smoke, 4 device)")
    ap.add_argument("--rates", default=None, help="comma-separated offered request rates (default: the size's)")
    ap.add_argument("--max-seconds", type=float, default=None,
                    help="each rate's duration, its warm-up included (default: the size's; with --budget-s, the cap)")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="the whole run's wall time: the rates' durations are sized so it ends within it")
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
    if args.rates is not None and (not overrides.get("rates") or min(overrides["rates"]) <= 0):
        print(f"serving_bench: --rates needs positive rates, got {args.rates!r}", file=sys.stderr)
        return 2
    if args.max_seconds is not None:
        if args.max_seconds <= 0:
            print("serving_bench: --max-seconds must be positive", file=sys.stderr)
            return 2
        overrides["max_seconds"] = args.max_seconds
    if args.budget_s is not None and args.budget_s <= 0:
        print("serving_bench: --budget-s must be positive", file=sys.stderr)
        return 2
    out_dir = Path(args.out)
    argv = [a if a != args.out else "OUT" for a in sys.argv[1:]]
    command = " ".join(["python3", "bench/serving_bench.py", *argv])
    result = bench(out_dir, args.smoke, modes, args.workers or (1 if args.smoke else 4), overrides,
                   args.budget_s, command)
    out = out_dir / "serving_bench.json"
    print(f"{'mode':<12} {'rate':>6} {'req/s':>6} {'out tok/s':>10} {'TTFT p50':>9} {'p99':>8} {'ITL p50':>8} {'p99':>7}"
          f" {'refused':>7} {'failed':>6}")
    for mode, rec in result["modes"].items():
        if rec.get("skipped") or rec.get("cut") or rec.get("error"):
            print(f"{mode:<12} {rec.get('skipped') or rec.get('cut') or rec.get('error')}")
        for r in rec["rows"]:
            print(f"{mode:<12} {r['rate']:6.1f} {r['achieved_requests_per_s'] or 0:6.2f} {r['output_tok_s'] or 0:10.1f} "
                  f"{r['ttft_ms_p50'] or 0:9.1f} {r['ttft_ms_p99'] or 0:8.1f} {r['itl_ms_p50'] or 0:8.2f} "
                  f"{r['itl_ms_p99'] or 0:7.2f} {r['errors']['refused']:7d} {r['errors']['failed']:6d}")
    print(f"wrote {out} ({result['wall_s']:.0f} s)")
    failed = [m for m, rec in result["modes"].items() if rec.get("error")]
    if failed:
        print(f"serving_bench: {', '.join(failed)} failed (see the JSON and DIR/logs)", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
