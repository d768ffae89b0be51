"""bench/dsv4_bench.py runs end to end on CPU (--smoke) before device time is spent on it: decode,
every MTP shape, planner truth and the FP4 experts' step are measured, and the engine's pools
are the plan's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_dsv4_bench_smoke(tmp_path):
    proc = subprocess.run([sys.executable, "-P", "bench/dsv4_bench.py", "--smoke", "--out", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    record = json.loads((tmp_path / "8_dsv4.json").read_text())
    assert record["section"] == "8" and record["status"] == "ok"
    res = record["results"]
    rows = res["rows"]
    assert not [r for r in rows if "error" in r]
    assert {r["shape"] for r in rows if r["kind"] == "mtp"} == {"chain1", "chain3", "tree3x2"}
    assert all(r["step_ms"] > 0 for r in rows)
    truth = res["planner_truth"]
    assert abs(truth["kv_pools_vs_plan"] - 1) < 1e-3 and abs(truth["weights_vs_plan"] - 1) < 0.01
    fp4 = res["fp4"]
    assert fp4 and all(r["fp4_step_ms"] > 0 and 0 < r["dequant_ms"] for r in fp4)
    assert sum(line.startswith("SUMMARY") for line in proc.stdout.splitlines()) == len(rows) + len(fp4) + 1
    page = tmp_path / "benchmarks.md"
    proc = subprocess.run([sys.executable, "-P", "bench/report.py", str(tmp_path), "--out", str(page), "--no-figures"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    text = page.read_text()
    assert "## 8. DeepSeek-V4-Flash" in text and "tree3x2" in text and "could not render" not in text
    assert "FP4 routed experts" in text
