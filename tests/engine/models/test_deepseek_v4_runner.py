"""DeepSeek-V4 served by the engine's Runner: greedy MTP speculation (chain and trees) emits the
target-only tokens exactly, chunked prefill changes nothing, and every slot and pool row comes
back; the pools the runner allocates are the plan's terms."""

from __future__ import annotations

import copy

import pytest
import torch

from specdeploy.engine.planner.deepseek_v4 import (SLOT_INDEX_BYTES, read_v4_config, v4_in_flight_rows,
                                                   v4_pool_rows, v4_pools)
from specdeploy.engine.planner.plan import GIB, Limits, SpecSettings, custom_gpu, plan_from_configs
from specdeploy.engine.runtime.runner import Request, Runner

from v4_tiny import SMALL_VOCAB, TINY, target_and_mtp

pytest.importorskip("transformers.models.deepseek_v4")

CONFIG = {**copy.deepcopy(TINY), "vocab_size": SMALL_VOCAB}


@pytest.fixture(scope="module")
def models():
    return target_and_mtp(CONFIG)


@pytest.fixture(scope="module")
def reference(models):
    """Target-only greedy outputs (plain decode, eager)."""
    return serve(models[0], None, SpecSettings("NONE"))[0]


def prompts():
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, CONFIG["vocab_size"], (n,), generator=g).tolist() for n in (9, 17, 3)]


def serve(target, draft, spec, prefill_chunk_tokens=8192, temperature=0.0, policy=None, **kwargs):
    runner = Runner(target, draft, spec, max_total_tokens=300, max_running_requests=4, context_length=96,
                    prefill_chunk_tokens=prefill_chunk_tokens, **kwargs)
    if policy is not None:
        runner.policy = policy(runner.shapes)
    pools = [kv for kv in (runner.target_kv, runner.draft_kv) if kv is not None]
    baseline = runner.num_free_slots, [{n: kv.free_rows(n) for n in kv.pools} for kv in pools]
    for i, p in enumerate(prompts()):
        runner.add(Request(str(i), p, max_tokens=20, temperature=temperature, seed=i if temperature else None))
    out = {str(i): [] for i in range(len(prompts()))}
    while runner.num_running:
        for o in runner.step():
            out[o.req_id] += o.token_ids
    after = runner.num_free_slots, [{n: kv.free_rows(n) for n in kv.pools} for kv in pools]
    assert after == baseline, "slots or DeepSeek-V4 pool rows were not all given back"
    return out, runner


@pytest.mark.parametrize("spec", [SpecSettings("MTP", 3, 1, 4), SpecSettings("MTP", 2, 1, 3),
                                  SpecSettings("MTP", 3, 2, 6), SpecSettings("MTP", 2, 3, 7)],
                         ids=["chain3", "chain2", "tree3x2", "tree2x3"])
def test_greedy_mtp_equals_target_only(models, reference, spec):
    target, mtp = models
    out, runner = serve(target, mtp, spec)
    assert out == reference
    assert runner.num_draft_tokens_accepted > 0  # accepted paths were committed, not only roots


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_adaptive_speculation_equals_target_only(models, reference, seed):
    """Whatever shape each step runs (no speculation, chains, a tree, in a seeded random mix),
    greedy output is target-only's: after plain steps the MTP layer catches up over positions
    its pools kept for it (they trim as the draft runs, not as tokens are committed), and every
    slot and pool row comes back (serve checks)."""
    from scripted_policy import ScriptedPolicy  # tests/support/scripted_policy.py

    from specdeploy.engine.speculative.adaptive import NONE, candidate_shapes

    target, mtp = models
    shapes = candidate_shapes(3, 2, 6)
    out, runner = serve(target, mtp, SpecSettings("MTP", 3, 2, 6), adaptive=True, adaptive_shapes=shapes,
                        step_costs_s={(sh, 1): 1.0 for sh in shapes}, catch_up_tokens=4,
                        policy=lambda shapes: ScriptedPolicy(shapes, seed, [3] + [1] * (len(shapes) - 1)))
    assert out == reference
    chosen = runner.policy.chosen
    assert NONE in chosen and any(not sh.is_none for sh in chosen)
    assert runner.num_draft_tokens_accepted > 0


def test_catch_up_leaves_the_mtp_state_a_full_extend_gives(models):
    """A request decoded by plain steps only, then caught up: the MTP layer's kept rows of every
    pool and its carried streams are what prefilling the whole committed sequence gives. (Were
    its pools trimmed as tokens are committed, the catch-up would read rows already given back.)"""
    from scripted_policy import ScriptedPolicy  # tests/support/scripted_policy.py

    from specdeploy.engine.speculative.adaptive import NONE

    target, mtp = models
    spec = SpecSettings("MTP", 2, 1, 3)
    runner = Runner(target, mtp, spec, max_total_tokens=300, max_running_requests=4, context_length=96,
                    adaptive=True, step_costs_s={(sh, 1): 1.0 for sh in (NONE,)}, adaptive_shapes=[NONE],
                    catch_up_tokens=6)
    runner.policy = ScriptedPolicy(runner.shapes, 0)
    runner.policy.choose = lambda b: NONE
    req = Request("r", prompts()[1], max_tokens=40)
    runner.add(req)
    tokens = []
    for _ in range(11):  # prefill + 10 plain steps: the buffer filled once (6) and holds 4
        tokens += runner.step()[0].token_ids
    seq = runner._running["r"]
    assert seq.pending == 4
    runner._catch_up([seq])

    def mtp_state(r, req_id):
        s = r._running[req_id]
        slots = r.table.req_to_slot[s.row, :s.length]
        return [t[:, i].clone() for t, i in r.draft_kv.staged_pieces(slots, s.length)], r.draft_hidden[s.row].clone(), s.length

    rows, hidden, length = mtp_state(runner, "r")
    assert length == len(req.prompt_ids) + len(tokens) - 1 > 8  # past every pool's keep
    fresh = Runner(target, mtp, spec, max_total_tokens=300, max_running_requests=4, context_length=96)
    fresh.add(Request("whole", req.prompt_ids + tokens[:-1], 2))
    assert fresh.step()[0].token_ids == [tokens[-1]]  # the same root
    want_rows, want_hidden, want_length = mtp_state(fresh, "whole")
    assert want_length == length
    torch.testing.assert_close(hidden, want_hidden, atol=2e-5, rtol=1e-4)
    for a, b in zip(rows, want_rows, strict=True):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-4)


def test_graph_buffers_and_padded_batches_change_nothing(models, reference):
    """graph_mode "padded": the CUDA graphs' static buffers, batch-size buckets and padded rows,
    replayed eagerly (any device): the fixed-shape path the graphs capture on the GPU."""
    target, mtp = models
    for spec in (SpecSettings("MTP", 3, 1, 4), SpecSettings("MTP", 2, 2, 4)):
        out, _ = serve(target, mtp, spec, graph_mode="padded", cuda_graph_batch_sizes=(1, 2, 4))
        assert out == reference
    out, _ = serve(target, None, SpecSettings("NONE"), graph_mode="padded", cuda_graph_batch_sizes=(1, 2, 4))
    assert out == reference


def test_rejection_sampling_gives_every_row_back(models):
    """Sampled speculation (chain sampling and a sampled tree) rejects at random depths: slots
    and pool rows still all come back (serve() checks), and seeded requests repeat exactly."""
    target, mtp = models
    for spec in (SpecSettings("MTP", 3, 1, 4), SpecSettings("MTP", 2, 2, 4)):
        first, runner = serve(target, mtp, spec, temperature=0.8)
        again, _ = serve(target, mtp, spec, temperature=0.8)
        assert first == again and all(len(t) == 20 for t in first.values())
        assert runner.num_draft_tokens_accepted > 0


def test_chunked_prefill_changes_nothing(models, reference):
    chunked, _ = serve(models[0], None, SpecSettings("NONE"), prefill_chunk_tokens=5)
    assert chunked == reference


def test_attention_blocks_over_prompts_and_queries_change_nothing(models, reference, monkeypatch):
    """Attention blocks of at most QUERY_BLOCK query rows: a prefill of the three prompts splits
    over prompts and over each prompt's queries; eager decode and verify of a batch as well."""
    import specdeploy.engine.models.deepseek_v4 as v4mod

    monkeypatch.setattr(v4mod, "QUERY_BLOCK", 4)
    out, _ = serve(models[0], None, SpecSettings("NONE"))
    assert out == reference
    out, _ = serve(*models, SpecSettings("MTP", 2, 2, 4))
    assert out == reference


def test_runner_allocates_the_plan(models):
    """A plan for this config on a GPU just big enough for a few thousand tokens, served by the
    Runner: its pools are exactly v4_pool_rows of the planner's widths, and the plan's KV terms
    (per token x max_total_tokens + per-request state) count them up to each pool's padding row
    and the rounding of ceil(tokens / ratio)."""
    target, mtp = models
    spec, limits = SpecSettings("MTP", 2, 2, 4), Limits(max_running_requests=4, context_length=96, cuda_graph_max_bs=4)
    probe = plan_from_configs(CONFIG, None, spec, custom_gpu(200), limits)
    m = probe.memory_per_gpu
    fixed = m.gpu_memory_bytes - m.kv_cache_budget_bytes
    p = plan_from_configs(CONFIG, None, spec, custom_gpu((fixed + 3000 * m.kv_cache_bytes_per_token) / GIB), limits)
    assert 2000 < p.max_total_tokens < 4000
    runner = Runner(target, mtp, plan=p)
    # a step holds a prefill chunk, or 4 requests x (4 tree nodes + 1 x 2 draft scratch) slots
    in_flight = v4_in_flight_rows(runner.prefill_chunk_tokens, 4, spec.num_draft_tokens + (spec.num_steps - 1) * spec.topk)
    engine_bytes = slack = 0
    v4 = read_v4_config(CONFIG)
    for kv, role in ((runner.target_kv, "target"), (runner.draft_kv, "MTP")):
        pools = v4_pools(v4, role)
        assert set(kv.pools) == {q.name for q in pools}
        for q in pools:
            rows = v4_pool_rows(q, p.max_total_tokens, 4, in_flight)
            assert tuple(kv.data[q.name].shape) == (len(q.layers), rows, q.width)
            slack += 2 * len(q.layers) * q.width * 4
        engine_bytes += kv.nbytes
        slack += (1 + len(pools)) * SLOT_INDEX_BYTES  # the pad slot's maps
    planned = p.max_total_tokens * m.kv_cache_bytes_per_token + m.per_request_state_bytes
    assert 0 <= engine_bytes - planned <= slack
