"""At start-up on a GPU the engine measures the memory its weights, pools and graphs left and fits
the prefill chunk to it (engine/serving/cli.py: _fit_prefill_chunk)."""

import logging
from types import SimpleNamespace

import pytest

from specdeploy.engine.planner.plan import MIB, PREFILL_FIT_MARGIN_BYTES
from specdeploy.engine.runtime.runner import Runner
from specdeploy.engine.serving.boot import _fit_prefill_chunk
from specdeploy.engine.demo.toy import predictable_target, tiny_config


def runner_and_plan(workspace_bytes):
    target, _ = predictable_target(tiny_config(), seed=0)
    runner = Runner(target, max_total_tokens=64, max_running_requests=2, prefill_chunk_tokens=8192)
    return runner, SimpleNamespace(memory_per_gpu=SimpleNamespace(activation_workspace_bytes=workspace_bytes))


def test_the_plans_workspace_fits():
    runner, plan = runner_and_plan(1024 * MIB)
    _fit_prefill_chunk(runner, plan, 1024 * MIB + PREFILL_FIT_MARGIN_BYTES)
    assert runner.prefill_chunk_tokens == 8192


def test_less_memory_shrinks_the_chunk_and_says_so(caplog):
    runner, plan = runner_and_plan(1024 * MIB)
    with caplog.at_level(logging.WARNING, logger="specdeploy.engine"):
        _fit_prefill_chunk(runner, plan, 256 * MIB + PREFILL_FIT_MARGIN_BYTES)
    assert runner.prefill_chunk_tokens == 2048
    assert "prefill chunk reduced from 8192 to 2048 tokens" in caplog.text


def test_no_room_for_a_useful_chunk_refuses_to_start():
    runner, plan = runner_and_plan(1024 * MIB)
    with pytest.raises(RuntimeError, match="lower --max-total-tokens"):
        _fit_prefill_chunk(runner, plan, 8 * MIB)
