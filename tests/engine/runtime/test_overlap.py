"""The overlapped decode loop (the next step staged while the current one runs, rows.py) gives
exactly what the non-overlapped one gives: the same outputs step for step, for target-only,
EAGLE chain and tree, EAGLE-3, MTP, hc_mult 1 and 4, fused and unfused padded graphs and
adaptive shapes; with requests that finish at different steps, a stop token mid-batch, a
request aborted between steps, requests joining while others decode and seeded sampling. Free
slots and rows come back to where they started, and the staged steps were really used."""

import pytest
import torch
from slot_accounting import check_accounting

from specdeploy.engine.demo.toy import copy_draft, predictable_target, tiny_config
from specdeploy.engine.runtime.runner import Request, Runner
from specdeploy.engine.planner.plan import SpecSettings

_TARGETS = {}


def target_for(hc_mult: int):
    if hc_mult not in _TARGETS:
        _TARGETS[hc_mult] = predictable_target(tiny_config(hc_mult=hc_mult), seed=0, layer_scale=0.5)
    return _TARGETS[hc_mult]


def prompts(n: int, vocab: int = 64) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, vocab, (int(torch.randint(1, 14, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def drive(runner: Runner, reqs: list[Request], late: list[Request] = (), abort: str | None = None,
          abort_at: int = 3) -> list[list[tuple]]:
    """Run to completion: `late` requests join at step 2, `abort` is aborted before step
    abort_at. -> every step's outputs (id, tokens, accepted, finished, reason), in order."""
    rows, free = len(runner.table._free_rows), runner.num_free_slots
    for r in reqs:
        runner.add(r)
    steps = []
    i = 0
    while runner.num_running:
        if i == 2:
            for r in late:
                runner.add(r)
        if abort is not None and i == abort_at and abort in runner._running:
            runner.abort(abort)
        steps.append([(o.req_id, o.token_ids, o.num_accepted_drafts, o.finished, o.finish_reason)
                      for o in runner.step()])
        i += 1
    assert runner.num_free_slots == free and runner.table.num_free == free, "KV slots leaked"
    assert len(runner.table._free_rows) == rows
    assert runner._ahead is None and runner._in_flight is None
    return steps


def tokens_of(steps) -> dict[str, tuple[list[int], str | None]]:
    """Per request: every token it was given and how it finished."""
    out = {}
    for step in steps:
        for rid, toks, _, fin, reason in step:
            prev = out.get(rid, ([], None))
            out[rid] = (prev[0] + toks, reason if fin else prev[1])
    return out


def workload(stop_token: int | None = None, **sampling):
    ps = prompts(6)
    max_tokens = (20, 9, 14, 3, 17, 11)
    reqs = [Request(f"r{i}", p, m, **sampling) for i, (p, m) in enumerate(zip(ps[:4], max_tokens))]
    if stop_token is not None:  # a stop token mid-batch: r1 stops where this token comes out
        reqs[1].stop_token_ids = {stop_token}
    late = [Request(f"r{i + 4}", p, m, **sampling) for i, (p, m) in enumerate(zip(ps[4:], max_tokens[4:]))]
    return reqs, late


def build(algorithm, hc_mult, topk, n, overlap, **kw):
    target, perm = target_for(hc_mult)
    draft = None if algorithm == "NONE" else copy_draft(algorithm, target, perm)
    spec = None if draft is None else SpecSettings(algorithm, 3, topk, n)
    return Runner(target, draft, spec, max_total_tokens=600, max_running_requests=6, context_length=96,
                  overlap=overlap, **kw)


def same_with_and_without_overlap(algorithm, hc_mult, topk, n, abort="r2", **kw):
    """Both runners on the same workload; -> the overlapped runner."""
    first = drive(build(algorithm, hc_mult, topk, n, False, **kw), *workload())
    # The stop token: one that r1 emits on its fourth step (without a stop), so it stops mid-batch.
    r1 = [t for step in first for (rid, toks, *_) in step if rid == "r1" for t in toks]
    stop = r1[3]
    runs = {}
    for overlap in (False, True):
        runner = build(algorithm, hc_mult, topk, n, overlap, **kw)
        runs[overlap] = drive(runner, *workload(stop), abort=abort)
        if overlap:
            assert runner.num_overlapped_steps > 0
        else:
            assert runner.num_overlapped_steps == 0
    assert runs[True] == runs[False]
    reasons = {rid: reason for step in runs[True] for (rid, _, _, fin, reason) in step if fin}
    assert reasons["r1"] == "stop" and abort not in reasons
    return runner


CASES = [("NONE", 1, 1, 1), ("EAGLE", 1, 1, 4), ("EAGLE", 4, 2, 5), ("EAGLE3", 1, 3, 6), ("MTP", 4, 1, 4)]


@pytest.mark.parametrize("algorithm,hc_mult,topk,n", CASES)
def test_overlap_equals_no_overlap_eager(algorithm, hc_mult, topk, n):
    same_with_and_without_overlap(algorithm, hc_mult, topk, n)


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("algorithm,hc_mult,topk,n", [CASES[0], CASES[1], CASES[2]])
def test_overlap_equals_no_overlap_padded_graphs(algorithm, hc_mult, topk, n, fused):
    """The graphs' static buffers and padding (batch buckets 1, 2 and 4), replayed eagerly."""
    same_with_and_without_overlap(algorithm, hc_mult, topk, n, graph_mode="padded",
                                  cuda_graph_batch_sizes=(1, 2, 4), fused_spec_step=fused)


@pytest.mark.parametrize("algorithm,hc_mult,topk,n", [("EAGLE", 1, 2, 4), ("MTP", 4, 1, 4)])
def test_overlap_equals_no_overlap_adaptive(algorithm, hc_mult, topk, n):
    """Adaptive shapes switched every step in a fixed order (NONE included, with catch-ups):
    the staged next step is made for the last step's shape and remade when the shape changes."""
    from specdeploy.engine.speculative.adaptive import NONE, SpecShape

    shapes = [NONE, SpecShape(2, 1, 3), SpecShape(3, topk, n)]
    runners = []
    for overlap in (False, True):
        runner = build(algorithm, hc_mult, topk, n, overlap, adaptive=True, catch_up_tokens=3,
                       adaptive_shapes=shapes, step_costs_s={(s, 1): 1.0 for s in shapes})
        order = [runner.shapes[i % len(runner.shapes)] for i in (0, 0, 1, 1, 1, 2, 0, 2, 2, 1)] * 10
        runner.policy.choose = lambda b, order=order, seen=[]: seen.append(0) or order[len(seen) - 1]
        runners.append(runner)
    outs = [drive(r, *workload(), abort="r2") for r in runners]
    assert outs[0] == outs[1]
    assert NONE in runners[1].shapes and runners[1].num_overlapped_steps > 0


def test_overlap_equals_no_overlap_seeded_sampling():
    """Sampling draws from each request's generator in the same order with and without overlap."""
    runs = []
    for overlap in (False, True):
        runner = build("EAGLE", 1, 1, 4, overlap)
        reqs, late = workload(temperature=0.8, top_p=0.9)
        for i, r in enumerate(reqs + late):
            r.seed = 100 + i
        runs.append(drive(runner, reqs, late))
    assert runs[0] == runs[1]


def test_overlap_stages_from_free_slots_only():
    """A pool exactly as large as the two requests' reservations: near their ends the next
    step cannot be staged from free slots while the running step holds its scratch, so it is
    staged when it runs instead; the output is the same and no slot is lost."""
    target, perm = target_for(1)
    spec = SpecSettings("EAGLE", 3, 2, 6)
    reqs = lambda: [Request(f"r{i}", p, 16) for i, p in enumerate(prompts(2))]  # noqa: E731
    outs, runners = [], []
    for overlap in (False, True):
        runner = Runner(target, copy_draft("EAGLE", target, perm), spec, max_total_tokens=1,
                        max_running_requests=2, context_length=96, overlap=overlap)
        total = sum(runner.slots_needed(len(r.prompt_ids), r.max_tokens) for r in reqs())
        runner = Runner(target, copy_draft("EAGLE", target, perm), spec, max_total_tokens=total,
                        max_running_requests=2, context_length=96, overlap=overlap)
        outs.append(drive(runner, reqs()))
        runners.append(runner)
    assert outs[0] == outs[1]
    assert 0 < runners[1].num_overlapped_steps < runners[1].num_decode_steps


LAUNCH_CASES = [("NONE", 1, 1, 1), ("EAGLE", 1, 1, 4), ("EAGLE", 4, 2, 5), ("MTP", 4, 1, 4)]


@pytest.mark.parametrize("graphs", [False, True])
@pytest.mark.parametrize("algorithm,hc_mult,topk,n", LAUNCH_CASES)
def test_launch_ahead_gives_the_same_tokens(algorithm, hc_mult, topk, n, graphs):
    """Launch-ahead (the next step launched before this one is waited for): every request gets
    the same tokens and finish reason as without overlap, a stop token mid-batch and an abort
    included; the over-run steps of finished and aborted requests give back their slots."""
    kw = dict(graph_mode="padded", cuda_graph_batch_sizes=(1, 2, 4)) if graphs else {}
    first = drive(build(algorithm, hc_mult, topk, n, False, **kw), *workload())
    stop = [t for step in first for (rid, toks, *_) in step if rid == "r1" for t in toks][3]
    want = tokens_of(drive(build(algorithm, hc_mult, topk, n, False, **kw), *workload(stop), abort="r2"))
    runner = build(algorithm, hc_mult, topk, n, False, launch_ahead=True, **kw)
    got = tokens_of(drive(runner, *workload(stop), abort="r2"))
    assert got == want and got["r1"][1] == "stop"
    assert runner.num_overlapped_steps > 0


def test_launch_ahead_seeded_sampling_and_the_extra_context_it_needs():
    runs = []
    for launch in (False, True):
        runner = build("EAGLE", 1, 1, 4, False, launch_ahead=launch)
        reqs, late = workload(temperature=0.8, top_p=0.9)
        for i, r in enumerate(reqs + late):
            r.seed = 100 + i
        runs.append(tokens_of(drive(runner, reqs, late)))
    assert runs[0] == runs[1]
    assert runner.max_sequence_tokens == 96 - 2 * (3 + 1)
    with pytest.raises(ValueError, match="adaptive"):
        build("EAGLE", 1, 1, 4, False, launch_ahead=True, adaptive=True, step_costs_s={})


@pytest.mark.parametrize("launch_ahead", [False, True])
def test_overlap_with_the_prefix_cache(launch_ahead):
    """Requests sharing a system prompt, some finishing while the next step is staged or in
    flight (whose positions go into the cache then): the same tokens as without overlap, and
    every slot free, cached or owned at every step (slot_accounting.check_accounting)."""
    system = prompts(1)[0] * 3
    def reqs():
        return [Request(f"q{i}", system + p, m) for i, (p, m) in enumerate(zip(prompts(5), (6, 11, 3, 9, 14)))]
    outs = []
    for overlap in (False, True):
        runner = build("EAGLE", 1, 2, 5, overlap and not launch_ahead, prefix_cache=True,
                       launch_ahead=overlap and launch_ahead)
        got = {}
        pending = reqs()
        for r in pending[:3]:
            runner.add(r)
        i = 0
        while runner.num_running:
            if i == 2:
                for r in pending[3:]:
                    runner.add(r)
            for o in runner.step():
                got.setdefault(o.req_id, []).extend(o.token_ids)
            check_accounting(runner)
            i += 1
        assert runner.num_free_slots == runner.table.capacity and runner.prefix_cache.cached_slots > 0
        outs.append(got)
    assert outs[0] == outs[1]
