"""bench/fp4_moe_bench.py runs end to end on CPU (--smoke: tiny shapes, the fused kernel through
Triton's interpreter, a sweep of one config) and writes its JSON with the goals."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_fp4_moe_bench_smoke(tmp_path):
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-P", "bench/fp4_moe_bench.py", "--smoke", "--configs", "m16n16k128",
                           "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads((tmp_path / "fp4_moe.json").read_text())
    assert data["environment"]["commit"] is not None or "date" in data["environment"]
    assert [r["batch"] for r in data["rows"]] == [1, 3]
    for row in data["rows"]:
        assert row["bf16_ms"] > 0 and row["fp4_old_ms"] > 0 and row["fp4_fused_ms"] > 0
        assert len(row["table_configs"]) == 2
        assert set(row["sweep_ms"]) == {"m16n16k128"} and row["bf16_over_fp4_best"] > 0
    assert set(data["goals"]) == {"fp4_over_bf16_batch1", "fp4_over_bf16_min_1_64"}
    assert data["goals"]["fp4_over_bf16_batch1"]["goal"] == 1.3
