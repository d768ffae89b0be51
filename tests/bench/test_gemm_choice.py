"""bench/gemm_choice.py's pure parts on CPU: the step table's winners, the BLOCK_ROUTE they imply
(only options the engine can call, neighbours merged, the last open-ended) and the tolerances."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def choice():
    spec = importlib.util.spec_from_file_location("bench_gemm_choice", ROOT / "bench" / "gemm_choice.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _layers(us_by_m: dict) -> dict:
    """Two layers with the same per-layer microseconds."""
    return {name: {"rows": {str(m): {"us": dict(us)} for m, us in us_by_m.items()}} for name in ("a", "b")}


def test_winners_and_the_route_they_imply(choice):
    rows = (1, 16, 256, 2048, 8192)
    per_layer = _layers({
        1: {"bf16": 10, "gemv": 5, "tma_m64n128": 9, "engine": 5},
        16: {"bf16": 10, "gemv": 7, "torch_block": 8, "engine": 7},
        256: {"bf16": 10, "torch_block": 6, "tma_m128n128": 7, "flashinfer": 1, "engine": 6},
        2048: {"bf16": 10, "torch_block": 7, "tma_m128n128": 6, "tma_m64n128": 6.5, "engine": 7},
        8192: {"bf16": 10, "torch_block": 7, "tma_m128n128s5": 5, "engine": 7},
    })
    table = choice.step_table(per_layer, rows)
    assert [e["winner"] for e in table] == ["gemv", "gemv", "flashinfer", "tma_m128n128", "tma_m128n128s5"]
    assert table[0]["us"]["bf16"] == choice.LAYERS * 20
    assert table[3]["speedup_vs_bf16"]["tma_m128n128"] == pytest.approx(10 / 6)
    # flashinfer wins at 256 but the engine does not call it: torch_block is the routable winner there
    assert [choice.routable_winner(e) for e in table][2:] == ["torch_block", "tma_m128n128", "tma_m128n128s5"]
    assert choice.implied_route(table) == [[16, "gemv"], [256, "torch_block"], [None, "tma"]]


def test_an_option_missing_at_one_layer_is_not_in_the_step(choice):
    per_layer = _layers({64: {"bf16": 10, "w8a8": 12, "torch_block": 9}})
    del per_layer["b"]["rows"]["64"]["us"]["torch_block"]
    (entry,) = choice.step_table(per_layer, (64,))
    assert "torch_block" not in entry["us"] and entry["winner"] == "w8a8"
    assert choice.implied_route([entry]) == [[None, "triton"]]


def test_tolerances_follow_the_numerics(choice):
    k = 4096
    assert choice.tolerance("gemv", k) < 2**-7 < choice.tolerance("w8a8", k) < 2**-3
    assert choice.tolerance("tma_m128n128", k) == choice.tolerance("torch_block", k)
    assert choice.tolerance("w8a8", 14336) > choice.tolerance("w8a8", 4096)
