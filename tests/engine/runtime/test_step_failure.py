"""A failed engine step (a forward that raises, e.g. CUDA out of memory) loses no KV slot: the
step gives back what it took, so aborting the requests afterwards returns the pool to its initial
size and later requests still run losslessly. The admission limits the scheduler applies up front
are the runner's own."""

import pytest
import torch

from specdeploy.engine.runtime.runner import NoCapacity, Request, Runner
from specdeploy.engine.planner.plan import SpecSettings
from specdeploy.engine.demo.toy import copy_draft, predictable_target, run_to_completion, tiny_config

_TARGET = {}


def target_and_perm():
    if not _TARGET:
        _TARGET["pair"] = predictable_target(tiny_config(), seed=0, layer_scale=0.5)
    return _TARGET["pair"]


def make_runner(algorithm: str, **kw) -> Runner:
    target, perm = target_and_perm()
    if algorithm == "NONE":
        return Runner(target, max_total_tokens=200, max_running_requests=4, **kw)
    return Runner(target, copy_draft(algorithm, target, perm), SpecSettings(algorithm, 3, 2, 5),
                  max_total_tokens=200, max_running_requests=4, **kw)


def prompts():
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, 64, (n,), generator=g).tolist() for n in (9, 14)]


def fail_on_call(monkeypatch, obj, name: str, nth: int) -> None:
    """Make obj.<name> raise on its nth call from now on (the calls before and after run)."""
    real, count = getattr(obj, name), [0]

    def call(*args, **kwargs):
        count[0] += 1
        if count[0] == nth:
            raise RuntimeError("CUDA out of memory (injected)")
        return real(*args, **kwargs)
    monkeypatch.setattr(obj, name, call)


# (algorithm, failing call, which call fails, prefill chunk). "target" is the target model's
# forward, which only the prefill calls directly (a single chunk, or the second of two, whose
# request already holds a row); draft_extend's first calls are the prefill's too, later ones
# belong to speculative steps, like target_verify and draft_multi_step.
CASES = [
    ("EAGLE", "target", 1, 64),
    ("EAGLE", "target", 2, 8),
    ("NONE", "target", 1, 64),
    ("EAGLE", "draft_extend", 1, 64),
    ("EAGLE", "draft_extend", 2, 8),
    ("EAGLE", "target_verify", 1, 64),
    ("EAGLE", "target_verify", 2, 64),
    ("EAGLE3", "draft_multi_step", 2, 64),
    ("EAGLE", "draft_extend", 3, 64),
    ("NONE", "target_decode", 2, 64),
]


@pytest.mark.parametrize("launch_ahead", [False, True], ids=["", "launch-ahead"])
@pytest.mark.parametrize("cache", [False, True], ids=["no-cache", "prefix-cache"])
@pytest.mark.parametrize("algorithm,name,nth,chunk", CASES)
def test_failed_step_frees_its_slots(monkeypatch, algorithm, name, nth, chunk, cache, launch_ahead):
    """With the prefix cache, the aborted requests leave what they wrote in the tree and the
    last run hits it; free counts the cache's unlocked slots (a request may take them)."""
    runner = make_runner(algorithm, prefill_chunk_tokens=chunk, prefix_cache=cache, launch_ahead=launch_ahead)
    free = runner.num_free_slots
    expected = run_to_completion(make_runner(algorithm), [Request(f"r{i}", p, 12) for i, p in enumerate(prompts())])
    assert runner.num_free_slots == free

    if name == "target":
        fail_on_call(monkeypatch, runner.target, "forward", nth)
    else:
        fail_on_call(monkeypatch, runner.calls, name, nth)
    reqs = [Request(f"r{i}", p, 12) for i, p in enumerate(prompts())]
    for r in reqs:
        runner.add(r)
    with pytest.raises(RuntimeError, match="injected"):
        for _ in range(20):
            runner.step()
    for r in reqs:
        runner.abort(r.id)
    assert runner.num_running == 0
    assert runner.num_free_slots == free, "KV slots lost by the failed step"
    # Every reservation is back: a request needing the whole pool is admitted.
    big = Request("big", prompts()[0], runner.max_new_tokens(len(prompts()[0])))
    runner.add(big)
    runner.abort("big")
    # And the runner still decodes exactly.
    again = run_to_completion(runner, [Request(f"r{i}", p, 12) for i, p in enumerate(prompts())])
    assert again == expected
    assert runner.num_free_slots == free
    if cache:
        assert runner.prefix_cache.locked_slots == 0 and runner.prefix_cache.cached_slots > 0
        runner.prefix_cache.check()


@pytest.mark.parametrize("launch_ahead", [False, True], ids=["", "launch-ahead"])
@pytest.mark.parametrize("cache", [False, True], ids=["no-cache", "prefix-cache"])
def test_failed_step_can_be_retried(monkeypatch, cache, launch_ahead):
    """The failed phase leaves its requests as they were: stepping on gives the same tokens.
    With launch-ahead the step that fails is the one launched ahead: the step before it is
    still collected, and its outputs come with the next call."""
    runner = make_runner("EAGLE", prefix_cache=cache, launch_ahead=launch_ahead)
    expected = run_to_completion(make_runner("EAGLE"), [Request(f"r{i}", p, 12) for i, p in enumerate(prompts())])
    fail_on_call(monkeypatch, runner.calls, "target_verify", 2)
    reqs = [Request(f"r{i}", p, 12) for i, p in enumerate(prompts())]
    for r in reqs:
        runner.add(r)
    out = {r.id: [] for r in reqs}
    failures = 0
    while runner.num_running:
        try:
            outs = runner.step()
        except RuntimeError:
            failures += 1
            continue
        for o in outs:
            out[o.req_id] += o.token_ids
    assert failures == 1 and out == expected
    assert runner.num_free_slots == runner.table.capacity


@pytest.mark.parametrize("algorithm", ["EAGLE", "NONE"])
def test_admission_limits_are_the_helpers(algorithm):
    runner = make_runner(algorithm, context_length=160)
    prompt = [1] * 10
    # Context: prompt + max_tokens up to max_sequence_tokens, not one more.
    most = runner.max_sequence_tokens - len(prompt)
    assert most == 160 - runner.num_steps - 1 - len(prompt)
    with pytest.raises(ValueError, match="context length"):
        runner.add(Request("a", prompt, most + 1))
    # Pool: the admitted request reserves exactly slots_needed; the largest max_tokens fills the pool.
    small = make_runner(algorithm, context_length=1000)
    fill = small.max_new_tokens(len(prompt))
    assert small.slots_needed(len(prompt), fill) == small.table.capacity
    with pytest.raises(ValueError, match="KV slots"):
        small.add(Request("b", prompt, fill + 1))
    small.add(Request("b", prompt, fill))
    with pytest.raises(NoCapacity):
        small.add(Request("c", [1], 1))
