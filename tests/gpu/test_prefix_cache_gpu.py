"""The prefix cache on the device: CUDA graphs captured, the Triton slot-pool attention (and the
reference) reading cached slots; cache on equals cache off token for token and step for step in
acceptance, float32, with the free slots poisoned before the hits (tests/engine/runtime/
test_prefix_cache.py has the CPU version and the reasons)."""

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from prefix_runs import tokens  # noqa: E402
from specdeploy.engine.demo.toy import copy_draft, predictable_target, tiny_config  # noqa: E402
from specdeploy.engine.models import attention  # noqa: E402
from specdeploy.engine.runtime.runner import Request, Runner  # noqa: E402
from specdeploy.engine.planner.plan import SpecSettings  # noqa: E402

DEV = "cuda"


@pytest.fixture(params=["reference", "fast"])
def backend(request):
    attention.set_backend(request.param)
    yield request.param
    attention.set_backend("auto")


def run(runner, reqs):
    for r in reqs:
        runner.add(r)
    out = {r.id: ([], [], None) for r in reqs}
    while runner.num_running:
        for o in runner.step():
            toks, acc, cached = out[o.req_id]
            out[o.req_id] = (toks + o.token_ids, acc + ([o.num_accepted_drafts] if cached is not None else []),
                             o.num_cached_tokens if cached is None else cached)
    return out


def poison(runner):
    free = runner.table._stack[:runner.table.num_free]
    for pool in (runner.target_kv, runner.draft_kv):
        if pool is not None:
            for cache in (pool.k, pool.v):
                cache[:, free] = 1e3 * torch.randn_like(cache[:, free])


@pytest.mark.parametrize("algorithm,hc_mult,topk,n", [("NONE", 1, 1, 1), ("EAGLE", 1, 1, 4), ("EAGLE3", 1, 2, 5),
                                                      ("MTP", 4, 1, 4), ("EAGLE", 4, 3, 6)])
def test_cache_on_equals_cache_off_under_graphs(algorithm, hc_mult, topk, n, backend):
    target, perm = predictable_target(tiny_config(hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16,
                                                  intermediate_size=128, hc_mult=hc_mult), seed=0, device=DEV)
    draft = None if algorithm == "NONE" else copy_draft(algorithm, target, perm)
    spec = SpecSettings(algorithm, 3 if draft else 0, topk, n)
    system = tokens(300, 100)
    a = Request("a", system + tokens(6, 1), 16)
    second = lambda out_a: [  # noqa: E731
        Request("same", list(a.prompt_ids), 12), Request("shared", system + tokens(20, 2), 12),
        Request("unrelated", tokens(40, 3), 12), Request("multi_turn", a.prompt_ids + out_a + tokens(4, 5), 12)]
    results = []
    for cache in (False, True):
        runner = Runner(target, draft, spec, max_total_tokens=4000, max_running_requests=8, device=DEV,
                        cuda_graph_batch_sizes=(1, 2, 4, 8), graph_mode="capture", prefix_cache=cache)
        out = run(runner, [a])
        if cache:
            poison(runner)
        out.update(run(runner, second(out["a"][0])))
        results.append(out)
    off, on = results
    for rid in off:
        assert on[rid][:2] == off[rid][:2], rid
    assert on["same"][2] == len(a.prompt_ids) - 1 and on["unrelated"][2] == 0
    assert on["shared"][2] == len(system) - (draft is not None)
    assert on["multi_turn"][2] > len(a.prompt_ids)
