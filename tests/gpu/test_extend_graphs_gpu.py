"""Graphed short prefill chunks (engine/runtime/extend_graphs.py) on the device: with the
prefix cache on, a hit's remainder (and a short prompt) replays the captured target forward and
draft extend; tokens and acceptance equal the eager prefill's, float32, for the target alone and
with EAGLE / EAGLE-3 heads, on both attention backends, and the replays happened (counted)."""

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from prefix_runs import run_one_by_one, tokens  # noqa: E402
from specdeploy.engine.demo.toy import copy_draft, predictable_target, tiny_config  # noqa: E402
from specdeploy.engine.models import attention  # noqa: E402
from specdeploy.engine.planner.plan import SpecSettings  # noqa: E402
from specdeploy.engine.runtime.runner import Request, Runner  # noqa: E402

DEV = "cuda"


@pytest.fixture(params=["reference", "fast"])
def backend(request):
    attention.set_backend(request.param)
    yield request.param
    attention.set_backend("auto")


@pytest.mark.parametrize("algorithm,topk,n", [("NONE", 1, 1), ("EAGLE", 1, 4), ("EAGLE3", 2, 5)])
def test_graphed_prefix_hit_equals_eager(algorithm, topk, n, backend):
    target, perm = predictable_target(tiny_config(hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16,
                                                  intermediate_size=128), seed=0, device=DEV)
    draft = None if algorithm == "NONE" else copy_draft(algorithm, target, perm)
    spec = SpecSettings(algorithm, 3 if draft else 0, topk, n)
    system = tokens(300, 100)
    reqs = [Request("warm", system + tokens(6, 1), 12), Request("hit", system + tokens(40, 2), 12),
            Request("same", system + tokens(6, 1), 12), Request("short", tokens(20, 3), 12)]
    results, replays = [], []
    for graphs in (False, True):
        runner = Runner(target, draft, spec, max_total_tokens=4000, max_running_requests=4, device=DEV,
                        cuda_graph_batch_sizes=(1, 2, 4), graph_mode="capture", prefix_cache=True,
                        extend_graphs=graphs)
        results.append(run_one_by_one(runner, reqs))
        if graphs:
            eg = runner.extend_graphs
            assert eg.target_graphs and (draft is None or eg.draft_graphs)  # captured, not padded-eager
            replays.append(eg.replays)
        else:
            assert runner.extend_graphs is None
    off, on = results
    assert on == off
    assert on["hit"][2] == len(system) - (draft is not None) and on["same"][2] == len(reqs[2].prompt_ids) - 1
    # warm (306 tokens) is above the largest bucket: eager; hit, same and short replayed
    assert replays == [3]
