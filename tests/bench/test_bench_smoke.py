"""The benchmark suite runs end to end before device time is spent on it: bench/run.py --smoke
executes every section on CPU with tiny shapes, and bench/report.py renders its JSON."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from bench_scripts import load_bench

ROOT = Path(__file__).resolve().parents[2]
SECTIONS = ("1_roofline", "2_decode", "3_spec_step", "4_graphs_vs_eager", "5_acceptance", "6_planner", "7_e2e8b")


def _missing_engine_pieces() -> list[str]:
    needed = ["torch", "transformers", "tokenizers", "specdeploy.engine.runtime.runner", "specdeploy.engine.runtime.calls",
              "specdeploy.engine.runtime.graphs", "specdeploy.engine.demo.train", "specdeploy.engine.planner.plan"]
    missing = []
    for name in needed:
        try:
            if importlib.util.find_spec(name) is None:
                missing.append(name)
        except ModuleNotFoundError:
            missing.append(name)
    return missing


def test_bench_smoke(tmp_path):
    missing = _missing_engine_pieces()
    if missing:
        pytest.skip(f"engine pieces the bench needs are not importable: {missing}")
    out = tmp_path / "out"
    cache = tmp_path / "pairs"
    proc = subprocess.run([sys.executable, "-P", "bench/run.py", "--smoke", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "SPECDEPLOY_BENCH_CACHE": str(cache)})
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "SUMMARY" in proc.stdout
    env = json.loads((out / "env.json").read_text())
    assert env["device"] == "cpu"
    for name in SECTIONS:
        rec = json.loads((out / f"{name}.json").read_text())
        assert rec["status"] == "ok", (name, rec.get("error"), rec.get("traceback", "")[-2000:])
        assert rec["smoke"] is True and rec["command"].startswith("PYTHONUNBUFFERED=1 python3 bench/run.py")
        assert rec["results"]["summary"]

    decode = json.loads((out / "2_decode.json").read_text())["results"]
    assert [r["batch"] for r in decode["ours"]] == [1, 2]
    assert all(r["tok_s"] > 0 and r["roofline_tok_s"] > 0 for r in decode["ours"])
    assert decode["transformers"]["parity"]["argmax_agreement"] > 0.9  # same weights, same model

    spec = json.loads((out / "3_spec_step.json").read_text())["results"]
    ok = [r for r in spec["rows"] if "error" not in r]
    assert {(r["algorithm"], r["shape"]) for r in ok} >= {("EAGLE", "chain"), ("EAGLE3", "tree"), ("MTP", "chain")}
    assert {r["graph_mode"] for r in ok} == {"fused", "split", "off"}
    for r in ok:
        assert r["whole_ms"] > 0
        if r["graph_mode"] == "fused":  # one graph: timed whole
            assert r["draft_ms"] is None and (r["goal_met"] is not None) == (r["shape"] != "tree-deep")
            continue
        assert r["verify_ms"] > 0 and r["draft_ms"] > 0 and r["extend_ms"] > 0 and r["tree_ms"] > 0
        assert r["draft_ms"] + r["verify_ms"] + r["extend_ms"] <= r["whole_ms"] * 1.05

    accept = json.loads((out / "5_acceptance.json").read_text())["results"]
    systems = {r["system"] for r in accept["rows"]}
    assert {"engine target-only", "engine EAGLE chain", "transformers", "transformers assisted"} <= systems
    chain = next(r for r in accept["rows"] if r["system"] == "engine EAGLE chain")
    assert chain["accept_length"] >= 1.0
    # the same head quantized at load: greedy output still the target's, never the headline
    fp8_head = next(r for r in accept["rows"] if r["system"].startswith("engine EAGLE chain, head quantized"))
    same = fp8_head["same_output_as_engine_target_only"]
    assert same["equal_outputs"] == same["of"] and fp8_head["accept_length"] >= 1.0
    assert accept["goal"]["system"] != fp8_head["system"]
    # the head's draft logits through an FP8 copy of its lm_head, on held-out positions
    lm = accept["fp8_lm_head"]
    assert lm["positions"] > 0 and lm["lm_head_shape"][0] == accept["corpus"]["vocab_size"]
    assert 0.5 < lm["same_draft_token"] <= 1.0
    assert 0.0 <= lm["first_token_agreement_fp8"] <= 1.0
    # trained for fixed steps from a fixed seed, and cached for the next run
    assert accept["recipe"]["mode"] == "fixed steps" and accept["recipe"]["seed"] == 0
    assert accept["pair_cache"]["hit"] is False and Path(accept["pair_cache"]["path"]).parent == cache
    assert Path(accept["pair_cache"]["path"]).is_file()
    assert accept["target_training"]["last_progress"].startswith(f"target: step {accept['recipe']['target_steps']}/")

    e2e = json.loads((out / "7_e2e8b.json").read_text())["results"]
    assert e2e["trained_in"] == "section 5 of this run"  # the pair is section 5's, not trained twice
    assert e2e["parity"]["argmax_agreement"] > 0.9 and e2e["parity"]["padded_logits_max_abs"] == 0
    assert {r["system"] for r in e2e["rows"]} >= {"engine target-only", "engine EAGLE chain",
                                                  "engine EAGLE adaptive", "transformers"}
    assert [r["batch"] for r in e2e["sweep_table"]] == [1, 2]
    assert all(r["adaptive_tok_s"] > 0 and r["adaptive_shapes"] for r in e2e["sweep_table"])
    assert len(e2e["goals"]) == 3
    # headline figures: medians of three runs, their spread beside them
    tree_deep = next(r for r in e2e["rows"] if r["system"] == "engine EAGLE tree-deep")
    assert tree_deep["runs"] == 3 and tree_deep["tok_s_min"] <= tree_deep["tok_s"] <= tree_deep["tok_s_max"]
    assert all(g["runs"] == 3 for g in e2e["goals"])
    low, high = e2e["goals"][0]["range"]  # the speed-up of run k over target-only run k, min and max
    assert 0 < low <= high

    planner = json.loads((out / "6_planner.json").read_text())["results"]
    for row in planner["rows"]:
        assert "error" not in row, row.get("traceback")
        assert row["terms"]["kv_pools"]["measured_over_predicted"] == pytest.approx(1.0, rel=0.01)

    md = tmp_path / "benchmarks.md"
    proc = subprocess.run([sys.executable, "-P", "bench/report.py", str(out), "--out", str(md), "--no-figures"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    text = md.read_text()
    assert "Smoke run" in text and "How to read these numbers" in text
    for heading in ("## 1.", "## 2.", "## 3.", "## 4.", "## 5.", "## 6.", "## 7.", "## Goals"):
        assert heading in text


def test_fp8_bench_smoke(tmp_path):
    """bench/fp8_bench.py (FP8 against bf16 decode, EAGLE-3 on the FP8 target, FP8 planner truth)
    runs on CPU with the tiny shape and writes every section."""
    missing = _missing_engine_pieces()
    if missing:
        pytest.skip(f"engine pieces the bench needs are not importable: {missing}")
    proc = subprocess.run([sys.executable, "-P", "bench/fp8_bench.py", "--smoke", "--out", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    result = json.loads((tmp_path / "fp8.json").read_text())
    assert not result["errors"]
    assert {r["weights"] for r in result["decode"]} == {"bf16", "fp8"}
    fp8_b1 = next(r for r in result["decode"] if r["weights"] == "fp8" and r["batch"] == 1)
    bf16_b1 = next(r for r in result["decode"] if r["weights"] == "bf16" and r["batch"] == 1)
    assert fp8_b1["bytes_per_step"] < bf16_b1["bytes_per_step"]  # the FP8 roofline counts e4m3 codes
    quantized_head = "fp8 target, head quantized at load (--draft-quantization fp8)"
    assert [s["weights"] for s in result["speculative"]] == ["bf16", "fp8", quantized_head]
    assert all("error" not in s for s in result["speculative"]), result["speculative"]
    runner = {s["weights"]: s["runner"] for s in result["speculative"]}
    assert all(r["rounds"] >= 3 and r["step_ms"] > 0 for r in runner.values()), runner
    kept = result["goals"]["eagle3_multiple_fp8_over_bf16"]
    assert kept["better"] == "lower" and kept["measured"] == pytest.approx(
        runner["fp8"]["step_over_decode"] / runner["bf16"]["step_over_decode"])
    quantized = result["goals"]["eagle3_multiple_fp8_draft_fp8_over_bf16"]
    assert quantized["measured"] == pytest.approx(
        runner[quantized_head]["step_over_decode"] / runner["bf16"]["step_over_decode"])
    assert result["eagle3_multiple_fp8_over_bf16_call"] == pytest.approx(
        result["speculative"][1]["step_over_decode"] / result["speculative"][0]["step_over_decode"])
    terms = result["planner_truth"]["terms"]
    assert terms["weights"]["measured_over_predicted"] == pytest.approx(1.0, abs=0.05)
    assert result["planner_truth"]["plan"]["target"]["weight_source"] == "quantization_config"


def test_skinny_gemm_probe_smoke(tmp_path):
    """bench/skinny_gemm_probe.py (batch-64 linears, cuBLAS against a Triton GEMM) runs on CPU
    under the interpreter: every Triton launch checked against the float32 product, both the
    stored (one split) and the atomic (split-K) form."""
    proc = subprocess.run([sys.executable, "-P", "bench/skinny_gemm_probe.py", "--smoke", "--out", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    result = json.loads((tmp_path / "skinny_gemm_probe.json").read_text())
    launches = [r for row in result["rows"] for r in row["all"] if r["kernel"] == "triton"]
    assert launches and all("error" not in r and r["relative_error"] < 1e-4 for r in launches), launches
    assert {r["split"] for r in launches} == {1, 2}
    assert result["step_linears_us"]["saving"] >= 0
    assert (tmp_path / "skinny_gemm_probe.md").read_text().startswith("# Batch-64")


def test_gemv_sweep_smoke(tmp_path):
    """bench/gemv_sweep.py times its configurations (Triton's interpreter on CPU, a tiny shape),
    writes every timing and a table that engine/kernels/gemv.py accepts as it is pasted."""
    pytest.importorskip("triton")
    proc = subprocess.run([sys.executable, "-P", "bench/gemv_sweep.py", "--smoke", "--out", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    result = json.loads((tmp_path / "gemv_sweep.json").read_text())
    assert {(r["weights"], r["m"]) for r in result["rows"]} == {("fp8", 1), ("fp8", 4), ("plain", 1), ("plain", 4)}
    for row in result["rows"]:
        assert row["baseline"]["us"] > 0 and row["best"]["us"] > 0 and row["chosen"]
    source = (tmp_path / "gemv_table.py").read_text()
    scope: dict = {}
    exec(source, scope)  # the literal as it would be pasted into gemv.py
    table = scope["GEMV_TABLE"]
    assert set(table) == {("fp8", 64, 512, 1), ("fp8", 64, 512, 4), ("plain", 64, 512, 1), ("plain", 64, 512, 4)}
    assert all(cfg[0] in ("fma", "dot", "cublas") and len(cfg) == 6 for cfg in table.values())
    gemv_sweep = load_bench("gemv_sweep")
    assert gemv_sweep.load_table(tmp_path / "gemv_table.py") == table  # what --gemv-table installs


def test_decode_kernels_smoke(tmp_path):
    """bench/decode_kernels.py times every decode kernel form (Triton's interpreter on CPU, tiny
    shapes) and writes them with an environment block: the engine's attention launch (one split
    at these shapes, its wider key tile) beside a previous-launch stand-in that splits (the
    combine kernel), and the one-launch add + norm beside the two-launch one."""
    pytest.importorskip("triton")
    proc = subprocess.run([sys.executable, "-P", "bench/decode_kernels.py", "--smoke", "--out", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    result = json.loads((tmp_path / "decode_kernels.json").read_text())
    assert result["smoke"] is True and result["environment"]["date"]
    rows = result["rows"]
    assert {r["batch"] for r in rows} == {1, 2}
    assert all(r["us"] > 0 and r["bytes"] > 0 for r in rows)
    attention = [r for r in rows if r["kernel"] == "attention"]
    assert {(r["batch"], r["splits"], r["block_k"]) for r in attention} == {
        (b, s, k) for b in (1, 2) for s, k in ((1, 64), (8, 16), (1, 32))}
    for batch in (1, 2):
        engine = [r for r in attention if r["batch"] == batch and r["engine_launch"]]
        previous = [r for r in attention if r["batch"] == batch and r["previous_launch"]]
        assert [(r["splits"], r["block_k"]) for r in engine] == [(1, 64)]
        assert [(r["splits"], r["block_k"]) for r in previous] == [(8, 16)]
    assert not any("fused_combine" in r for r in attention)
    assert {r["form"] for r in rows if r["kernel"] == "add + rms_norm"} == {
        "torch add, then norm (2)", "add_rms_norm (1)"}
