"""bench/gemm_choice.py's pure parts on CPU: the step table's winners, the BLOCK_ROUTE they imply
(only options the engine can call, neighbours merged, the last open-ended), the goals in the form
bench/report.py reads, the .md it renders beside a JSON, and the tolerances."""

from __future__ import annotations

from pathlib import Path

import pytest
from bench_scripts import load_bench

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def choice():
    return load_bench("gemm_choice")


def _layers(us_by_m: dict) -> dict:
    """Two layers with the same per-layer microseconds."""
    return {name: {"rows": {str(m): {"us": dict(us)} for m, us in us_by_m.items()}} for name in ("a", "b")}


def test_winners_and_the_route_they_imply(choice):
    rows = (1, 16, 256, 2048, 8192)
    per_layer = _layers({
        1: {"bf16": 10, "gemv": 5, "torch_block": 9, "engine": 5},
        16: {"bf16": 10, "gemv": 7, "torch_block": 8, "engine": 7},
        256: {"bf16": 10, "torch_block": 6, "torch_block_private": 5.5, "flashinfer": 1, "engine": 6},
        2048: {"bf16": 10, "w8a8": 6, "torch_block": 7, "engine": 7},
        8192: {"bf16": 10, "torch_block": 7, "deep_gemm": 5, "engine": 7},
    })
    table = choice.step_table(per_layer, rows)
    assert [e["winner"] for e in table] == ["gemv", "gemv", "flashinfer", "w8a8", "deep_gemm"]
    assert table[0]["us"]["bf16"] == choice.LAYERS * 20
    assert table[3]["speedup_vs_bf16"]["w8a8"] == pytest.approx(10 / 6)
    # flashinfer and torch's private API are not routes the engine calls; DeepGEMM is
    assert [choice.routable_winner(e) for e in table][2:] == ["torch_block", "w8a8", "deep_gemm"]
    assert choice.implied_route(table) == [[16, "gemv"], [256, "torch_block"], [2048, "triton"], [None, "deep_gemm"]]


def test_goals_in_the_form_the_report_reads(choice):
    per_layer = _layers({1: {"bf16": 9, "engine": 5}, 2048: {"bf16": 15, "engine": 10},
                         8192: {"bf16": 16, "engine": 10}})
    goals = choice.goals(choice.step_table(per_layer, (1, 2048, 8192)))
    assert set(goals) == set(choice.GOALS)
    for g in goals.values():
        assert set(g) == {"figure", "goal", "measured", "unit", "better"} and g["unit"] == "x" and g["better"] == "higher"
    assert goals["prefill_1_5x_at_m_ge_2048"]["measured"] == pytest.approx(1.5)
    assert goals["never_slower_than_bf16"]["measured"] == pytest.approx(1.5)
    assert goals["decode_m1_1_8x"]["measured"] == pytest.approx(1.8)
    # a run without M 1 (the smoke form) did not measure that goal
    assert choice.goals(choice.step_table(_layers({16: {"bf16": 9, "engine": 5}}), (16,)))["decode_m1_1_8x"]["measured"] is None


def test_render_writes_the_table_beside_the_json(choice, tmp_path):
    per_layer = _layers({1: {"bf16": 10, "gemv": 5, "engine": 5}, 64: {"bf16": 10, "torch_block": 8, "engine": 8}})
    result = {"step_linears": choice.step_table(per_layer, (1, 64))}
    path = tmp_path / "gemm_choice.json"
    path.write_text(__import__("json").dumps(result))
    assert choice.render(path) == 0
    title, blank, header, rule, m1, m64 = (tmp_path / "gemm_choice.md").read_text().splitlines()
    assert title == f"# {choice.TITLE}" and blank == ""
    assert header == "| M | `bf16` | `gemv` | `engine` | `torch_block` | fastest block-scaled |"
    assert rule.count("---") == 6
    assert m1 == f"| 1 | {choice.LAYERS * 20} (1.00×) | {choice.LAYERS * 10} (2.00×) | {choice.LAYERS * 10} (2.00×) | — | `gemv` |"
    assert m64.endswith(f"| {choice.LAYERS * 16} (1.25×) | `torch_block` |") and "| — |" in m64
    # bad input: a clear refusal, no .md
    bad = tmp_path / "other.json"
    bad.write_text("{}")
    assert choice.render(bad) == 2 and not (tmp_path / "other.md").exists()


def test_an_option_missing_at_one_layer_is_not_in_the_step(choice):
    per_layer = _layers({64: {"bf16": 10, "w8a8": 12, "torch_block": 9}})
    del per_layer["b"]["rows"]["64"]["us"]["torch_block"]
    (entry,) = choice.step_table(per_layer, (64,))
    assert "torch_block" not in entry["us"] and entry["winner"] == "w8a8"
    assert choice.implied_route([entry]) == [[None, "triton"]]


def test_tolerances_follow_the_numerics(choice):
    k = 4096
    assert choice.tolerance("gemv", k) < 2**-7 < choice.tolerance("w8a8", k) < 2**-3
    assert choice.tolerance("torch_block_private", k) == choice.tolerance("torch_block", k)
    assert choice.tolerance("w8a8", 14336) > choice.tolerance("w8a8", 4096)
