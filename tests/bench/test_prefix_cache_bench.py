"""bench/prefix_cache_bench.py runs end to end on CPU (--smoke) before device time is spent on
it: every measurement is recorded, the cache hit happens, and outputs agree."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_prefix_cache_bench_smoke(tmp_path):
    proc = subprocess.run([sys.executable, "-P", "bench/prefix_cache_bench.py", "--smoke", "--out", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "SUMMARY" in proc.stdout
    res = json.loads((tmp_path / "prefix_cache.json").read_text())
    system = res["profile"]["system_tokens"]
    assert res["ttft"]["on"]["cached_tokens"] == [system - 1] * res["profile"]["ttft_reps"]  # bigram keys
    assert all(c == 0 for c in res["ttft"]["off"]["cached_tokens"])
    assert res["shared"]["on"]["cached_tokens"] > 0 and res["unique"]["on"]["cached_tokens"] == 0
    for name in ("ttft", "shared", "unique"):
        assert res[name]["requests_with_equal_outputs"] == res[name]["requests"]
    for name in ("shared", "unique"):
        assert res[name]["on"]["tok_s"] > 0 and res[name]["off"]["tok_s"] > 0
        # rounds of off then on: each side's record is its median round's
        rounds = res[name]["rounds"]
        assert len(rounds) == res["profile"]["rounds"] > 1
        for side in ("off", "on"):
            assert res[name][side]["tok_s"] == sorted(r[side] for r in rounds)[(len(rounds) - 1) // 2]
        assert res[name]["requests"] == res["profile"]["requests"] * len(rounds)
