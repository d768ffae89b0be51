"""The overlapped decode loop under captured CUDA graphs (run on the device): overlap on equals
overlap off token for token and step for step (target-only, EAGLE chain and tree fused and
unfused, MTP with hc_mult 4, adaptive shapes), with finishes at different steps, a stop token
mid-batch, an abort between steps and requests joining; slots come back. Launch-ahead gives
every request the same tokens. A steady greedy decode step launches one graph, copies once each
way and launches no other kernel, in both overlap modes."""

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from specdeploy.engine.demo.toy import copy_draft, predictable_target, tiny_config  # noqa: E402
from specdeploy.engine.runtime.runner import Request, Runner  # noqa: E402
from specdeploy.engine.planner.plan import SpecSettings  # noqa: E402

DEV = "cuda"
BUCKETS = (1, 2, 4)


def gpu_config(hc_mult=1):
    return tiny_config(hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, vocab_size=64,
                       intermediate_size=128, hc_mult=hc_mult)


def prompts(n):
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, 64, (int(torch.randint(1, 14, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def workload(stop=None):
    ps, max_tokens = prompts(6), (20, 9, 14, 3, 17, 11)
    reqs = [Request(f"r{i}", p, m) for i, (p, m) in enumerate(zip(ps, max_tokens))]
    if stop is not None:
        reqs[1].stop_token_ids = {stop}
    return reqs[:4], reqs[4:]


def drive(runner, reqs, late=(), abort=None):
    free = runner.num_free_slots
    for r in reqs:
        runner.add(r)
    steps, i = [], 0
    while runner.num_running:
        if i == 2:
            for r in late:
                runner.add(r)
        if abort is not None and i == 3 and abort in runner._running:
            runner.abort(abort)
        steps.append([(o.req_id, o.token_ids, o.num_accepted_drafts, o.finished, o.finish_reason)
                      for o in runner.step()])
        i += 1
    assert runner.num_free_slots == free == runner.table.num_free
    return steps


_MODELS = {}


def models(algorithm, hc_mult):
    if hc_mult not in _MODELS:
        _MODELS[hc_mult] = predictable_target(gpu_config(hc_mult), seed=0, layer_scale=0.25, device=DEV)
    target, perm = _MODELS[hc_mult]
    return target, None if algorithm == "NONE" else copy_draft(algorithm, target, perm)


def build(algorithm, hc_mult, topk, n, overlap, **kw):
    target, draft = models(algorithm, hc_mult)
    spec = None if draft is None else SpecSettings(algorithm, 3, topk, n)
    return Runner(target, draft, spec, max_total_tokens=1200, max_running_requests=6, context_length=96,
                  device=DEV, cuda_graph_batch_sizes=BUCKETS, overlap=overlap, **kw)


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("algorithm,hc_mult,topk,n", [("NONE", 1, 1, 1), ("EAGLE", 1, 1, 4),
                                                      ("EAGLE", 1, 4, 8), ("MTP", 4, 1, 4)])
def test_overlap_equals_no_overlap_under_graphs(algorithm, hc_mult, topk, n, fused):
    if algorithm == "NONE" and not fused:
        pytest.skip("plain decode has one graph either way")
    first = drive(build(algorithm, hc_mult, topk, n, False, fused_spec_step=fused), *workload())
    stop = [t for step in first for (rid, toks, *_) in step if rid == "r1" for t in toks][3]
    runs = {}
    for overlap in (False, True):
        runner = build(algorithm, hc_mult, topk, n, overlap, fused_spec_step=fused)
        runs[overlap] = drive(runner, *workload(stop), abort="r2")
    assert runs[True] == runs[False]
    assert runner.num_overlapped_steps > 0


def test_overlap_equals_no_overlap_adaptive_under_graphs():
    from specdeploy.engine.speculative.adaptive import NONE, SpecShape

    shapes = [NONE, SpecShape(2, 1, 3), SpecShape(3, 2, 4)]
    outs = []
    for overlap in (False, True):
        runner = build("EAGLE", 1, 2, 4, overlap, adaptive=True, adaptive_shapes=shapes, catch_up_tokens=3)
        order = [shapes[i % 3] for i in (0, 0, 1, 1, 1, 2, 0, 2, 2, 1)] * 10
        runner.policy.choose = lambda b, order=order, seen=[]: seen.append(0) or order[len(seen) - 1]
        outs.append(drive(runner, *workload(), abort="r2"))
    assert outs[0] == outs[1]


def tokens_of(steps):
    out = {}
    for step in steps:
        for rid, toks, _, fin, reason in step:
            prev = out.get(rid, ([], None))
            out[rid] = (prev[0] + toks, reason if fin else prev[1])
    return out


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("algorithm,hc_mult,topk,n", [("NONE", 1, 1, 1), ("EAGLE", 1, 1, 4),
                                                      ("EAGLE", 1, 4, 8), ("MTP", 4, 1, 4)])
def test_launch_ahead_gives_the_same_tokens_under_graphs(algorithm, hc_mult, topk, n, fused):
    if algorithm == "NONE" and not fused:
        pytest.skip("plain decode has one graph either way")
    first = drive(build(algorithm, hc_mult, topk, n, False, fused_spec_step=fused), *workload())
    stop = [t for step in first for (rid, toks, *_) in step if rid == "r1" for t in toks][3]
    want = tokens_of(drive(build(algorithm, hc_mult, topk, n, False, fused_spec_step=fused),
                           *workload(stop), abort="r2"))
    runner = build(algorithm, hc_mult, topk, n, False, fused_spec_step=fused, launch_ahead=True)
    assert tokens_of(drive(runner, *workload(stop), abort="r2")) == want
    assert runner.num_overlapped_steps > 0 and runner._in_flight is None


@pytest.mark.parametrize("launch_ahead", [False, True])
@pytest.mark.parametrize("algorithm,topk,n", [("NONE", 1, 1), ("EAGLE", 1, 4), ("EAGLE", 4, 8)])
def test_steady_decode_step_is_one_graph_and_two_copies(algorithm, topk, n, launch_ahead):
    """No kernel outside the graph, one host-to-device copy (the staged next step) and one
    device-to-host copy (the packed output) per steady greedy step, overlap on or launch-ahead."""
    from torch.profiler import ProfilerActivity, profile

    runner = build(algorithm, 1, topk, n, not launch_ahead, launch_ahead=launch_ahead)
    for r in workload()[0][:2]:
        r.max_tokens = 60
        runner.add(r)
    for _ in range(4):  # prefill, then steady decode
        runner.step()
    reps = 3
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            runner.step()
        torch.cuda.synchronize()
    counts = {}
    for ev in prof.events():
        for key in ("LaunchKernel", "GraphLaunch", "Memcpy"):
            if key in ev.name and ev.name.startswith("cu"):
                counts[key] = counts.get(key, 0) + 1
    assert runner.num_running == 2
    assert counts.get("GraphLaunch") == reps, counts
    assert counts.get("Memcpy", 0) == 2 * reps, counts
    assert counts.get("LaunchKernel", 0) == 0, counts
