"""bench/tp_bench.py runs end to end before device time is spent on it: --smoke runs the same
code on a tiny model over gloo (two CPU ranks) and writes every section's figures."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_tp_bench_smoke(tmp_path):
    out = tmp_path / "tp.json"
    proc = subprocess.run([sys.executable, "-P", "bench/tp_bench.py", "--smoke", "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["tp"] == 2
    assert set(result["decode"]) == {"1", "2"} and all(r["tok_s"] > 0 for r in result["decode"].values())
    for shape in ("chain (3,1,4)", "tree (3,4,8)"):
        assert all(r["multiple_of_decode"] > 0 for r in result["spec_step"][shape].values())
    assert len(result["all_reduce_us"]["nccl"]) == 7
    memory = result["memory"]
    # The smoke model is float32 and the plan is made for the config's bfloat16: twice the bytes.
    assert memory["weights_target"]["held"] == 2 * memory["weights_target"]["plan"]
    assert memory["kv_per_token_target"]["held"] == 2 * memory["kv_per_token_target"]["plan"]
