"""Graphed short prefill chunks (extend_graphs.py) on CPU: the bucket choice and padding, and
the padded graph bodies (graph_mode "padded": the captured code run eagerly on the static
buffers) give the same tokens, the same acceptance and the same cache hits as the eager prefill,
for the target alone and with each draft kind, with the feature on and off."""

import prefix_runs
import pytest
from specdeploy.engine.demo.toy import copy_draft, predictable_target, tiny_config
from specdeploy.engine.memory.kv import PAD_SLOT
from specdeploy.engine.planner.plan import SpecSettings
from specdeploy.engine.runtime.extend_graphs import EXTEND_GRAPH_TOKENS, extend_bucket
from specdeploy.engine.runtime.runner import Request, Runner

VOCAB = 64


def test_bucket_is_the_smallest_that_holds_the_chunk():
    assert extend_bucket(1) == EXTEND_GRAPH_TOKENS[0]
    assert extend_bucket(16, (16, 32)) == 16
    assert extend_bucket(17, (16, 32)) == 32
    assert extend_bucket(33, (16, 32)) is None
    assert extend_bucket(5, (32, 8)) == 8  # order of the buckets given does not matter
    with pytest.raises(ValueError):
        extend_bucket(0)


def test_static_buffers_padded_past_the_chunk():
    runner = make("EAGLE", True)
    graphs = runner.extend_graphs
    run(runner, [Request("long", tokens(30, 6), 2)])   # 30 tokens: bucket 32
    assert graphs._q == 32
    run(runner, [Request("short", tokens(5, 7), 2)])   # then 5: bucket 16, a longer one's data past it
    assert graphs._q == 16
    assert graphs.tokens[0, 5:16].eq(0).all() and graphs.positions[0, 5:16].eq(0).all()
    assert graphs.slots[0, 5:16].eq(PAD_SLOT).all() and graphs.shifted[0, 5:16].eq(0).all()
    assert graphs.prefix[0].eq(PAD_SLOT).all()   # no cached prefix: every column is the pad slot
    assert graphs.takes.item() == 5 and graphs.starts.item() == 0


def tokens(n: int, seed: int) -> list[int]:
    return prefix_runs.tokens(n, seed, VOCAB)


def make(algorithm: str, graphs: bool) -> Runner:
    target, perm = predictable_target(tiny_config(), seed=0, layer_scale=0.5)
    kw = dict(max_total_tokens=900, max_running_requests=4, cuda_graph_batch_sizes=(1, 2, 4),
              graph_mode="padded", prefix_cache=True, extend_graphs=graphs)
    if algorithm == "NONE":
        return Runner(target, **kw)
    draft = copy_draft(algorithm, target, perm)
    return Runner(target, draft, SpecSettings(algorithm, 3, 1, 4), **kw)


run = prefix_runs.run_one_by_one  # one at a time: each prefill chunk is one request's


@pytest.mark.parametrize("algorithm", ["NONE", "EAGLE", "EAGLE3"])
def test_graphed_chunks_equal_eager(algorithm):
    system = tokens(40, 100)
    reqs = [Request("first", system + tokens(5, 1), 10), Request("hit", system + tokens(9, 2), 10),
            Request("same", system + tokens(5, 1), 10), Request("short", tokens(7, 3), 10),
            Request("long", tokens(300, 4), 6)]   # above the largest bucket: eager either way
    off_runner, on_runner = make(algorithm, False), make(algorithm, True)
    assert off_runner.extend_graphs is None and on_runner.extend_graphs is not None
    off, on = run(off_runner, reqs), run(on_runner, reqs)
    assert on == off
    assert on["hit"][2] > 0 and on["same"][2] == len(reqs[2].prompt_ids) - 1
    # first, hit, same, short replayed; long ran eagerly
    assert on_runner.extend_graphs.replays == 4


def test_switched_off_at_run_time_and_not_where_it_does_not_apply():
    runner = make("EAGLE", True)
    runner.use_extend_graphs = False
    run(runner, [Request("a", tokens(9, 5), 4)])
    assert runner.extend_graphs.replays == 0
    target, _ = predictable_target(tiny_config(), seed=0, layer_scale=0.5)
    eager = Runner(target, max_total_tokens=200, max_running_requests=2, extend_graphs=True)  # graph_mode off
    assert eager.extend_graphs is None
