"""The standard serving benchmark cannot rot: bench/serving_bench.py --smoke drives the tiny CPU
pair's `specdeploy engine serve` with guidellm (Poisson arrivals, the shared-prefix chat-like
workload, a handful of requests) and its JSON has every figure filled and every request answered;
bench/report.py renders that JSON as the serving table."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _report_module():
    spec = importlib.util.spec_from_file_location("bench_report", ROOT / "bench" / "report.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_serving_bench_smoke(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-P", "bench/serving_bench.py", "--smoke", "--modes", "fixed",
                           "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=400,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    logs = "".join(p.read_text(errors="replace")[-2000:] for p in sorted((out / "logs").glob("*")) if p.is_file()) \
        if (out / "logs").is_dir() else ""
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:] + logs
    data = json.loads((out / "serving_bench.json").read_text())
    assert data["tool"] == "guidellm" and data["tool_version"]
    assert data["workload"]["prefix_tokens"] > 0 and data["workload"]["prompt_tokens_stdev"] > 0
    rows = data["modes"]["fixed"]["rows"]
    assert [r["rate"] for r in rows] == data["run"]["rates"]
    for r in rows:
        req = r["requests"]
        assert req["successful"] == req["total"] == data["run"]["max_requests"], req
        assert req["errored"] == req["incomplete"] == 0, req
        assert r["output_tokens"] >= req["successful"] * data["workload"]["output_tokens_min"]
        for key in ("achieved_requests_per_s", "output_tok_s", "ttft_ms_p50", "ttft_ms_p99", "itl_ms_p50",
                    "itl_ms_p99"):
            assert isinstance(r[key], float) and r[key] > 0, (key, r[key])
        assert r["ttft_ms_p50"] <= r["ttft_ms_p99"] and r["itl_ms_p50"] <= r["itl_ms_p99"]
    # guidellm's own report is kept beside it, and the serving table renders from the summary.
    assert json.loads((out / "guidellm_fixed.json").read_text())["benchmarks"]
    table = _report_module().serving_table(data)
    assert "| fixed | 4.0 |" in table and f"{rows[0]['output_tok_s']:.1f}" in table
