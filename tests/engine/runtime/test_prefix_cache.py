"""The prefix cache keeps speculative decoding exact.

A cache hit must leave a request in the state it would have reached by prefilling its whole
prompt: the same target and draft K/V at every committed position, the same carried draft state,
hence the same tokens (greedy, every draft kind, hc_mult 1 and 4) and the same draft proposals
(the same acceptance, step by step). Matches of every length are exercised: none, part of a
prompt, the whole prompt but its last token, and past a previous request's prompt into its
output. The bigram key is pinned down by a request that shares all tokens of a cached prompt but
the next one, and by a naive token-keyed cache, which the state check must catch. Freed slots
are poisoned with large random values so that reading any slot the cache did not fill shows. A random stress of
admissions, aborts and evictions in a small pool checks the accounting: no slot is lost or held
twice, and outputs stay exact."""

import random

import pytest
import torch
from slot_accounting import check_accounting
from specdeploy.engine.demo.toy import copy_draft, predictable_target, tiny_config
from specdeploy.engine.memory.kv import SlotTable
from specdeploy.engine.runtime.prefix_cache import PrefixCache, shared_prefix_len
from specdeploy.engine.runtime.runner import NoCapacity, Request, Runner
from specdeploy.engine.planner.plan import SpecSettings
from specdeploy.engine.speculative.adaptive import NONE, AdaptivePolicy, candidate_shapes

VOCAB = 64
_TARGETS = {}


def target_for(hc_mult: int):
    if hc_mult not in _TARGETS:
        _TARGETS[hc_mult] = predictable_target(tiny_config(hc_mult=hc_mult), seed=0, layer_scale=0.5)
    return _TARGETS[hc_mult]


def make_runner(algorithm: str, hc_mult: int, cache: bool, topk: int = 1, n: int = 4, **kw) -> Runner:
    target, perm = target_for(hc_mult)
    kw = {"max_total_tokens": 600, "max_running_requests": 6, **kw}
    if algorithm == "NONE":
        return Runner(target, prefix_cache=cache, **kw)
    extra = {"draft_vocab": torch.arange(VOCAB)[torch.arange(VOCAB) % 4 != 3]} if algorithm == "EAGLE3" else {}
    draft = copy_draft(algorithm, target, perm, **extra)
    return Runner(target, draft, SpecSettings(algorithm, 3, topk, n), prefix_cache=cache, **kw)


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def run(runner: Runner, reqs) -> dict[str, dict]:
    """Run requests to the end; -> per id: tokens, acceptance per step, cached prompt tokens."""
    for r in reqs:
        runner.add(r)
    out = {r.id: {"tokens": [], "accepted": [], "cached": None} for r in reqs}
    while runner.num_running:
        for o in runner.step():
            rec = out.setdefault(o.req_id, {"tokens": [], "accepted": [], "cached": None})
            if rec["cached"] is None:
                rec["cached"] = o.num_cached_tokens
            else:
                rec["accepted"].append(o.num_accepted_drafts)
            rec["tokens"] += o.token_ids
        check_accounting(runner)
    return out


SYSTEM = tokens(40, 100)


def phases(first_output: list[int] | None = None):
    """Phase 1 caches one request; phase 2 asks for every kind of match against it."""
    a = Request("a", SYSTEM + tokens(6, 1), 12)
    yield [a]
    other_next = (SYSTEM[20] + 1) % VOCAB
    yield [
        Request("same_prompt", list(a.prompt_ids), 10),                      # all but the last token
        Request("shared_system", SYSTEM + tokens(9, 2), 10),                 # the system prompt
        Request("unrelated", tokens(17, 3), 10),                             # nothing
        Request("next_token_differs", SYSTEM[:20] + [other_next] + tokens(5, 4), 10),
        Request("multi_turn", a.prompt_ids + (first_output or []) + tokens(4, 5), 8),
        Request("one_token", [SYSTEM[0]], 5),                                # nothing can match
    ]


def run_phases(runner: Runner, poison: bool = False) -> dict[str, dict]:
    first, second = phases(), None
    out = run(runner, next(first))
    second = list(phases(out["a"]["tokens"]))[1]
    if poison:
        poison_free_slots(runner)
    out.update(run(runner, second))
    return out


def poison_free_slots(runner: Runner) -> None:
    """Large random K/V in both pools at every slot nobody holds: attending to one that was not
    written since changes the output. (Finite, not NaN: attention reads masked-out keys by
    design, e.g. a reused row's stale tail under prefix_lens, and relies on 0 x finite = 0.)"""
    free = runner.table._stack[:runner.table.num_free]
    g = torch.Generator().manual_seed(99)
    for pool in (runner.target_kv, runner.draft_kv):
        if pool is not None:
            for cache in (pool.k, pool.v):
                cache[:, free] = 1e3 * torch.randn(cache[:, free].shape, generator=g)


CASES = [("NONE", 1, 1, 1), ("NONE", 4, 1, 1),
         ("EAGLE", 1, 1, 4), ("EAGLE", 1, 3, 6), ("EAGLE", 4, 2, 5),
         ("EAGLE3", 1, 1, 4), ("EAGLE3", 1, 2, 5),
         ("MTP", 1, 1, 4), ("MTP", 4, 1, 4), ("MTP", 4, 3, 6)]


@pytest.mark.parametrize("algorithm,hc_mult,topk,n", CASES)
def test_cache_on_equals_cache_off(algorithm, hc_mult, topk, n):
    off = run_phases(make_runner(algorithm, hc_mult, False, topk, n))
    cached_runner = make_runner(algorithm, hc_mult, True, topk, n)
    on = run_phases(cached_runner, poison=True)
    for rid in off:
        assert on[rid]["tokens"] == off[rid]["tokens"], rid
        # The draft proposes the same tokens at every step: acceptance is unchanged.
        assert on[rid]["accepted"] == off[rid]["accepted"], rid
    draft = algorithm != "NONE"
    lookahead = int(draft)
    cached = {rid: on[rid]["cached"] for rid in on}
    a_len = len(SYSTEM) + 6
    assert cached["a"] == 0 and cached["unrelated"] == 0 and cached["one_token"] == 0
    assert cached["same_prompt"] == a_len - 1
    # The last system-prompt position pairs with the next token, which differs, under a draft.
    assert cached["shared_system"] == len(SYSTEM) - lookahead
    assert cached["next_token_differs"] == 20 - lookahead
    assert cached["multi_turn"] >= a_len + len(on["a"]["tokens"]) - 1
    assert all(v == 0 for v in off_cached(off))
    if draft:
        assert cached_runner.num_draft_tokens_accepted > 0
    # All finished: nothing locked, every slot free or cached.
    cache = cached_runner.prefix_cache
    assert cache.locked_slots == 0
    assert cached_runner.table.num_free + cache.cached_slots == cached_runner.table.capacity


def test_cache_on_equals_cache_off_through_padded_graph_calls():
    """The graph layer's static buffers and padding (what CUDA replays), with hits."""
    kw = {"graph_mode": "padded", "cuda_graph_batch_sizes": (1, 2, 4, 8)}
    off = run_phases(make_runner("EAGLE", 1, False, 2, 5, **kw))
    on = run_phases(make_runner("EAGLE", 1, True, 2, 5, **kw), poison=True)
    assert on == {rid: {**rec, "cached": on[rid]["cached"]} for rid, rec in off.items()}
    assert on["same_prompt"]["cached"] > 0


class CyclingPolicy(AdaptivePolicy):
    """Plain (NONE) steps only for the first request ("a": 11 decode steps, so with catch-ups
    every 8 it ends 3 plain steps after its catch-up at the 9th), then three times in four, the
    other shapes in turn."""

    def __init__(self, shapes):
        super().__init__(shapes, {(sh, 1): 1.0 for sh in shapes})
        others = [sh for sh in self.shapes if sh != NONE]
        self._cycle = [NONE] * 11 + [x for sh in others for x in (NONE, NONE, NONE, sh)] * 100
        self._i = 0

    def choose(self, batch_size):
        self._i += 1
        return self._cycle[self._i - 1]


@pytest.mark.parametrize("algorithm,hc_mult", [("EAGLE", 1), ("MTP", 4)])
def test_adaptive_plain_steps_cache_only_what_the_draft_has_run_over(algorithm, hc_mult):
    """Adaptive speculation's plain steps leave the draft's entries of their tokens for a later
    catch-up; a request that finishes before it caches only the positions the draft has
    written, and hits give the same tokens and acceptance as without the cache."""
    def runner(cache):
        shapes = candidate_shapes(3, 1, 4)
        r = make_runner(algorithm, hc_mult, cache, adaptive=True, adaptive_shapes=shapes, catch_up_tokens=8,
                        step_costs_s={(sh, 1): 1.0 for sh in [NONE, *shapes]})
        r.policy = CyclingPolicy(r.shapes)
        return r

    off = run_phases(runner(False))
    on_runner = runner(True)
    on = run_phases(on_runner, poison=True)
    for rid in off:
        assert on[rid]["tokens"] == off[rid]["tokens"], rid
        assert on[rid]["accepted"] == off[rid]["accepted"], rid
    assert on["same_prompt"]["cached"] == len(SYSTEM) + 6 - 1
    # "a" (46 prompt + 11 decoded positions) ended 3 plain steps after its catch-up: the draft had
    # not run over those 3 positions, so they were not cached.
    assert on["multi_turn"]["cached"] == len(SYSTEM) + 6 + 11 - 3
    assert on_runner.prefix_cache.locked_slots == 0


def off_cached(out):
    return [rec["cached"] for rec in out.values()]


def prefill_state(runner: Runner, req: Request):
    """Add req, run its prefill only; -> (target K, target V, draft K, draft V) at its positions
    and its carried draft state. The request is then aborted."""
    runner.add(req)
    runner.step()
    seq = runner._running[req.id]
    slots = runner.table.req_to_slot[seq.row, :seq.length]
    state = [runner.target_kv.k[:, slots], runner.target_kv.v[:, slots],
             runner.draft_kv.k[:, slots], runner.draft_kv.v[:, slots], runner.draft_hidden[seq.row]]
    state = [t.clone() for t in state]
    runner.abort(req.id)
    return state


@pytest.mark.parametrize("algorithm,hc_mult", [("EAGLE", 1), ("EAGLE3", 1), ("MTP", 4)])
def test_a_hit_leaves_the_state_of_a_full_prefill(algorithm, hc_mult):
    """Both models' K/V at every position and the carried draft state equal a full prefill's;
    a token-keyed cache (the draft entry at the last matched position made with another next
    token) is caught by the same check."""
    first = Request("first", SYSTEM + tokens(6, 1), 4)
    probe = Request("probe", SYSTEM[:20] + [(SYSTEM[20] + 1) % VOCAB] + tokens(5, 4), 4)
    off = make_runner(algorithm, hc_mult, False)
    run(off, [first])
    want = prefill_state(off, probe)

    on = make_runner(algorithm, hc_mult, True)
    run(on, [first])
    poison_free_slots(on)
    got = prefill_state(on, probe)
    for w, g in zip(want, got):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)

    naive = make_runner(algorithm, hc_mult, True)
    naive.prefix_cache.lookahead = 0    # keyed on tokens: position 19 reused with a stale draft entry
    run(naive, [first])
    stale = prefill_state(naive, probe)
    torch.testing.assert_close(stale[0], want[0], atol=1e-5, rtol=1e-5)   # the target does not care
    draft_k_error = (stale[2] - want[2]).abs().amax(dim=(0, 2, 3))         # per position
    assert draft_k_error[19] > 1e-3 and draft_k_error[:19].max() < 1e-5


def test_seeded_sampling_is_unchanged_by_a_hit():
    def reqs():
        return [Request(f"s{i}", SYSTEM + tokens(5, 10 + i), 10, temperature=0.8, top_p=0.9, seed=i)
                for i in range(3)]
    off = make_runner("EAGLE", 1, False)
    on = make_runner("EAGLE", 1, True)
    for runner in (off, on):
        run(runner, reqs()[:1])
    want, got = run(off, reqs()), run(on, reqs())
    assert {k: v["tokens"] for k, v in got.items()} == {k: v["tokens"] for k, v in want.items()}
    assert got["s1"]["cached"] == len(SYSTEM) - 1


def test_concurrent_requests_share_a_prefix_written_in_an_earlier_chunk():
    """A prompt prefilled over several chunks is cached chunk by chunk: a request admitted
    meanwhile matches what is written so far, and the running request's slots become the tree's."""
    long_prompt = SYSTEM + tokens(40, 7)
    runner = make_runner("EAGLE", 1, True, prefill_chunk_tokens=32)
    runner.add(Request("long", long_prompt, 6))
    runner.step()                                              # first 32 positions written
    runner.step()                                              # 64
    got = run(runner, [Request("late", long_prompt[:70] + tokens(3, 8), 6)])
    assert got["late"]["cached"] == 64       # its token 64 is the one the draft entry at 63 saw
    ref = run(make_runner("EAGLE", 1, False), [Request("late", long_prompt[:70] + tokens(3, 8), 6)])
    assert got["late"]["tokens"] == ref["late"]["tokens"]
    assert runner.prefix_cache.locked_slots == 0


@pytest.mark.parametrize("algorithm", ["NONE", "EAGLE"])
def test_requests_sent_together_compute_a_shared_prompt_once(algorithm):
    """Four requests with one system prompt on a cold cache, admitted at once: the first is
    prefilled alone, the others wait one step and match what it wrote; tokens are unchanged."""
    reqs = [Request(f"t{i}", SYSTEM + tokens(5, 40 + i), 6) for i in range(4)]
    on = make_runner(algorithm, 1, True)
    got = run(on, reqs)
    want = run(make_runner(algorithm, 1, False), reqs)
    assert {k: v["tokens"] for k, v in got.items()} == {k: v["tokens"] for k, v in want.items()}
    lookahead = int(algorithm != "NONE")
    assert [got[r.id]["cached"] for r in reqs] == [0] + [len(SYSTEM) - lookahead] * 3


def test_a_failed_prefill_of_a_hit_is_retried_exactly(monkeypatch):
    """A forward that raises while a request's prefill starts from a cache hit leaves the hit
    locked and the pool whole; the next step redoes it and gives the cache-off tokens."""
    runner = make_runner("EAGLE", 1, True)
    run(runner, [Request("a", SYSTEM + tokens(6, 1), 8)])
    req = Request("b", SYSTEM + tokens(6, 2), 8)
    want = run(make_runner("EAGLE", 1, False), [req])
    real, calls = runner.target.forward, [0]

    def failing(*args, **kwargs):
        calls[0] += 1
        if calls[0] == 1:
            raise RuntimeError("CUDA out of memory (injected)")
        return real(*args, **kwargs)
    monkeypatch.setattr(runner.target, "forward", failing)
    runner.add(req)
    with pytest.raises(RuntimeError, match="injected"):
        runner.step()
    check_accounting(runner)
    assert runner.prefix_cache.locked_slots == len(SYSTEM) - 1
    got = run(runner, [])
    assert got["b"]["tokens"] == want["b"]["tokens"] and got["b"]["cached"] == len(SYSTEM) - 1
    assert runner.prefix_cache.locked_slots == 0


def test_shared_prefix_len():
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(0, 40)
        a = [rng.randint(0, 3) for _ in range(n)]
        b = a[:rng.randint(0, n)] + [rng.randint(0, 3) for _ in range(rng.randint(0, 5))]
        want = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        assert shared_prefix_len(a, b) == want


def test_radix_tree_split_lock_and_lru():
    table = SlotTable(64, 4, 64, "cpu")
    cache = PrefixCache(table, lookahead=0)
    s1 = table.alloc(6)
    assert cache.insert([1, 2, 3, 4, 5, 6], s1)[0] == 0
    s2 = table.alloc(5)
    existed, m = cache.insert([1, 2, 3, 9, 9], s2)
    assert existed == 3 and m.length == 5                     # the first three were there
    assert m.slots.tolist() == s1[:3].tolist() + s2[3:].tolist()
    table.free(s2[:3])                                        # the caller's copies
    cache.check()
    m = cache.match([1, 2, 3, 4, 7], 10)
    assert m.length == 4 and m.slots.tolist() == s1[:4].tolist()
    assert cache.match([1, 2, 3, 9, 9, 9], 3).length == 3     # capped
    cache.lock(m.node)                                        # [1 2 3 4] locked
    assert cache.locked_slots == 4 and cache.evictable_slots == 4
    assert cache.evict(100) == 4                              # only the unlocked leaves go
    cache.check()
    assert cache.match([1, 2, 3, 9, 9], 10).length == 3
    assert cache.match([1, 2, 3, 4, 5, 6], 10).length == 4
    cache.unlock(m.node)
    assert cache.evict(4) == 4 and cache.cached_slots == 0     # the leaf [4], then [1 2 3]
    assert table.num_free == table.capacity
    with pytest.raises(RuntimeError):
        cache.unlock(m.node)

    # LRU: the leaf touched last survives.
    a, b = table.alloc(3), table.alloc(3)
    cache.insert([10, 11, 12], a)
    cache.insert([20, 21, 22], b)
    cache.match([10, 11, 12], 3)
    assert cache.evict(1) == 3
    assert cache.match([10, 11, 12], 3).length == 3 and cache.match([20, 21, 22], 3).length == 0


def test_bigram_keys_need_the_next_token():
    table = SlotTable(16, 2, 16, "cpu")
    cache = PrefixCache(table, lookahead=1)
    keys = cache.keys
    assert keys([5, 6, 7]) == keys([5, 6]) + keys([6, 7])    # built piecewise
    cache.insert(keys([5, 6, 7, 8]), table.alloc(3))          # positions 0..2, tokens 0..3
    assert cache.match(keys([5, 6, 7, 8, 1]), 10).length == 3
    assert cache.match(keys([5, 6, 7, 9, 1]), 10).length == 2  # position 2 was made with token 8 next
    assert cache.match(keys([5, 6]), 10).length == 1
    assert cache.match(keys([5]), 10).length == 0
    big = 128255
    assert keys([big, 1]) != keys([1, big]) and len(set(keys([big, 0, big, 1]))) == 3


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_eviction_stress_loses_no_slot(seed):
    """A pool of 160 slots, prompts from three shared prefixes, random lengths, admissions that
    wait for room, aborts at random steps: after every step every slot is free, cached or owned
    exactly once; outputs equal a cache-off run's; at the end nothing is locked."""
    rng = random.Random(seed)
    bases = [tokens(30, 200 + i) for i in range(3)]
    reqs = []
    for i in range(24):
        base = rng.choice(bases)
        prompt = base[:rng.randint(1, len(base))] + tokens(rng.randint(0, 12), 300 + i)
        reqs.append(Request(f"q{i}", prompt or [1], rng.randint(1, 12)))
    aborted = {r.id for r in reqs if rng.random() < 0.2}

    on = make_runner("EAGLE", 1, True, topk=2, n=5, max_total_tokens=160, max_running_requests=4)
    queue, out, steps = list(reqs), {r.id: [] for r in reqs}, {}
    hits = 0
    while queue or on.num_running:
        while queue:
            try:
                on.add(queue[0])
            except NoCapacity:
                break
            steps[queue.pop(0).id] = 0
        for o in on.step():
            out[o.req_id] += o.token_ids
            hits += o.num_cached_tokens
        for rid in list(steps):
            steps[rid] += 1
            live = rid in on._running or any(s.req.id == rid for s in on._pending)
            if not live:
                del steps[rid]
            elif rid in aborted and steps[rid] == 2:
                on.abort(rid)
                del steps[rid]
        check_accounting(on)
    assert hits > 0, "the stress saw no cache hit"
    assert on.prefix_cache.evicted_slots > 0, "the stress never evicted"
    cache = on.prefix_cache
    assert cache.locked_slots == 0
    assert on.table.num_free + cache.cached_slots == on.table.capacity

    off = make_runner("EAGLE", 1, False, topk=2, n=5, max_total_tokens=2000, max_running_requests=len(reqs))
    ref = run(off, [r for r in reqs if r.id not in aborted])
    for rid, rec in ref.items():
        assert out[rid] == rec["tokens"], rid


@pytest.mark.parametrize("bad", [{"seed": 2**64}, {"seed": -2**63 - 1}, {"top_k": 2**63},
                                 {"temperature": float("nan")}, {"top_p": 0.0}])
def test_a_refused_request_on_a_hit_takes_nothing(bad):
    """Admission refuses a request whose fields the step cannot use, after its prompt matched the
    cache or not, and leaves no lock, slot or reservation behind: eight of them in a row leave
    the pool as they found it and the next long request runs."""
    runner = make_runner("EAGLE", 1, cache=True)
    run(runner, [Request("warm", SYSTEM + tokens(6, 1), 4)])
    free, locked, reserved = runner.num_free_slots, runner.prefix_cache.locked_slots, runner._reserved
    for i in range(8):
        with pytest.raises(ValueError):
            runner.add(Request(f"bad{i}", SYSTEM + tokens(6, 2 + i), 4, **{"temperature": 1.0, **bad}))
        assert (runner.num_free_slots, runner.prefix_cache.locked_slots, runner._reserved) == (free, locked, reserved)
        assert runner.num_running == 0
    check_accounting(runner)
    out = run(runner, [Request("long", SYSTEM + tokens(6, 50), runner.max_new_tokens(46) - 8)])
    assert out["long"]["cached"] > 0 and len(out["long"]["tokens"]) >= runner.max_new_tokens(46) - 8


def test_a_failure_inside_admission_gives_back_the_cache_lock(monkeypatch):
    """Whatever raises after the prefix matched (here the capacity check itself), the lock the
    match took is given back."""
    runner = make_runner("EAGLE", 1, cache=True)
    run(runner, [Request("warm", SYSTEM + tokens(6, 1), 4)])
    locked = runner.prefix_cache.locked_slots

    def broken():
        raise RuntimeError("boom")
    monkeypatch.setattr(runner, "_all_seqs", broken)
    with pytest.raises(RuntimeError, match="boom"):
        runner.add(Request("x", SYSTEM + tokens(6, 3), 4))
    assert runner.prefix_cache.locked_slots == locked == 0
    monkeypatch.undo()
    check_accounting(runner)
