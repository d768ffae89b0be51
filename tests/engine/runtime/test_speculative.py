"""Speculative decoding is lossless: with greedy sampling the runner's output equals the
target-only output token for token, for every draft kind, chain and tree, hc_mult 1 and 4,
one request and several of different lengths in one batch. The drafts are built to agree with
the target often but not always; the acceptance rate is asserted so that the comparison covers
both accepted and rejected drafts. KV slots must all come back after every request."""

import pytest
import torch

from specdeploy.engine.models.attention import causal_batch
from specdeploy.engine.memory.kv import KVPool
from specdeploy.engine.runtime.runner import NoCapacity, Request, Runner
from specdeploy.engine.planner.plan import SpecSettings
from specdeploy.engine.demo.toy import copy_draft, predictable_target, random_target, tiny_config

PROMPT_LENS = (5, 12, 1, 9)
MAX_TOKENS = 20


def requests(lens=PROMPT_LENS, max_tokens=MAX_TOKENS, vocab=64, **kw):
    return [Request(f"r{i}", torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(i)).tolist(),
                    max_tokens, **kw) for i, n in enumerate(lens)]


def generate(runner: Runner, reqs) -> dict[str, list[int]]:
    free_at_start = runner.num_free_slots
    for r in reqs:
        runner.add(r)
    out = {r.id: [] for r in reqs}
    finished = set()
    while runner.num_running:
        for o in runner.step():
            assert o.req_id not in finished
            out[o.req_id] += o.token_ids
            if o.finished:
                finished.add(o.req_id)
                assert o.finish_reason in ("stop", "length")
    assert finished == set(out)
    assert runner.num_free_slots == free_at_start, "KV slots leaked"
    return out


_TARGETS = {}


def target_for(hc_mult: int):
    if hc_mult not in _TARGETS:
        _TARGETS[hc_mult] = predictable_target(tiny_config(hc_mult=hc_mult), seed=0, layer_scale=0.5)
    return _TARGETS[hc_mult]


def reference_greedy(model, prompt: list[int], max_tokens: int) -> list[int]:
    """Greedy decoding by recomputing the whole sequence each token (no KV reuse)."""
    seq = list(prompt)
    cfg = model.cfg
    for _ in range(max_tokens):
        kv = KVPool(cfg.num_layers, len(seq) + 1, cfg.num_kv_heads, cfg.head_dim, torch.float32, "cpu")
        slots = torch.arange(1, len(seq) + 1)[None]
        batch = causal_batch(slots, torch.tensor([len(seq)]), torch.zeros(1, 0, dtype=torch.int64),
                             torch.tensor([0]))
        with torch.no_grad():
            out = model(torch.tensor([seq]), torch.arange(len(seq))[None], batch, kv)
        seq.append(int(model.logits(out.hidden[0, -1]).argmax()))
    return seq[len(prompt):]


@pytest.mark.parametrize("hc_mult", [1, 4])
def test_plain_decode_matches_recompute(hc_mult):
    target, _ = target_for(hc_mult)
    reqs = requests(max_tokens=8)
    got = generate(Runner(target, max_total_tokens=256, max_running_requests=4), reqs)
    for r in reqs:
        assert got[r.id] == reference_greedy(target, r.prompt_ids, 8)


# (algorithm, hc_mult, topk, num_draft_tokens)
CASES = [
    ("EAGLE", 1, 1, 4), ("EAGLE", 1, 3, 6),
    ("EAGLE3", 1, 1, 4), ("EAGLE3", 1, 2, 5),
    ("MTP", 1, 1, 4),
    ("EAGLE", 4, 1, 4), ("EAGLE", 4, 2, 5),
    ("MTP", 4, 1, 4), ("MTP", 4, 3, 6),
]


@pytest.mark.parametrize("algorithm,hc_mult,topk,num_draft_tokens", CASES)
def test_greedy_speculative_equals_target(algorithm, hc_mult, topk, num_draft_tokens):
    target, perm = target_for(hc_mult)
    plain = generate(Runner(target, max_total_tokens=400, max_running_requests=4), requests())
    kwargs = {}
    if algorithm == "EAGLE3":  # a reduced draft vocabulary: a quarter of the tokens is missing
        kwargs["draft_vocab"] = torch.arange(0, 64)[torch.arange(64) % 4 != 3]
    draft = copy_draft(algorithm, target, perm, **kwargs)
    spec = SpecSettings(algorithm, 3, topk, num_draft_tokens)
    runner = Runner(target, draft, spec, max_total_tokens=400, max_running_requests=4)
    assert generate(runner, requests()) == plain
    rate = runner.num_draft_tokens_accepted / runner.num_draft_tokens_proposed
    assert 0.1 < rate < 0.9, f"acceptance rate {rate:.2f}: the test would not see both outcomes"
    # Batch of one gives the same tokens.
    single = Runner(target, draft, spec, max_total_tokens=400, max_running_requests=1)
    one = requests(lens=(7,))
    assert generate(single, one) == generate(Runner(target, max_total_tokens=400,
                                                    max_running_requests=1), one)


def test_random_draft_is_still_lossless():
    """An untrained (random) EAGLE head is rarely right; output must not change."""
    from specdeploy.engine.models.draft import build_draft
    from specdeploy.engine.demo.toy import init_random_
    target, _ = target_for(1)
    draft = build_draft("EAGLE", target.cfg.__class__(**{**target.cfg.__dict__, "num_layers": 1}),
                        target, torch.float32, "cpu")
    init_random_(draft, torch.Generator().manual_seed(9))
    runner = Runner(target, draft, SpecSettings("EAGLE", 2, 2, 4), max_total_tokens=400, max_running_requests=4)
    plain = generate(Runner(target, max_total_tokens=400, max_running_requests=4), requests())
    assert generate(runner, requests()) == plain


def test_stop_tokens_length_and_abort():
    target, perm = target_for(1)
    draft = copy_draft("EAGLE", target, perm)
    runner = Runner(target, draft, SpecSettings("EAGLE", 3, 1, 4), max_total_tokens=300,
                    max_running_requests=4)
    free = runner.num_free_slots
    plain = generate(Runner(target, max_total_tokens=300, max_running_requests=4), requests(lens=(6,)))
    stop = plain["r0"][5]
    first_stop = plain["r0"].index(stop)
    got = generate(runner, requests(lens=(6,), stop_token_ids={stop}))
    assert got["r0"] == plain["r0"][:first_stop + 1]
    # abort frees the request's slots, running or pending
    runner.add(requests(lens=(6,))[0])
    runner.step()
    runner.step()
    assert runner.num_free_slots < free
    runner.abort("r0")
    assert runner.num_free_slots == free and runner.num_running == 0
    runner.add(requests(lens=(6,))[0])
    runner.abort("r0")
    assert runner.num_running == 0


def test_admission_errors():
    target, perm = target_for(1)
    runner = Runner(target, copy_draft("EAGLE", target, perm), SpecSettings("EAGLE", 3, 1, 4),
                    max_total_tokens=64, max_running_requests=2, context_length=128)
    with pytest.raises(ValueError, match="needs .* KV slots"):
        runner.add(Request("big", [1] * 40, 40))
    with pytest.raises(ValueError, match="context length"):
        runner.add(Request("long", [1] * 100, 40))
    with pytest.raises(ValueError, match="outside"):
        runner.add(Request("bad", [64], 4))
    with pytest.raises(ValueError, match="empty prompt"):
        runner.add(Request("e", [], 4))
    runner.add(Request("a", [1] * 20, 20))
    with pytest.raises(NoCapacity):
        runner.add(Request("b", [1] * 20, 20))
    with pytest.raises(ValueError, match="already in use"):
        runner.add(Request("a", [1], 1))


@pytest.mark.parametrize("topk,num_draft_tokens", [(1, 4), (2, 5)])
def test_sampling_requests_run_and_greedy_rows_stay_exact(topk, num_draft_tokens):
    """Sampling (chain: drafts drawn from the warped draft distribution; tree: top-k drafts)
    in a batch mixed with a greedy request: the greedy request is unchanged, seeded requests
    are reproducible, slots come back."""
    target, perm = target_for(1)
    draft = copy_draft("EAGLE", target, perm)
    spec = SpecSettings("EAGLE", 3, topk, num_draft_tokens)

    def batch():
        reqs = requests(lens=(5, 8, 3))
        reqs[1].temperature, reqs[1].top_p, reqs[1].seed = 0.8, 0.9, 11
        reqs[2].temperature, reqs[2].top_k, reqs[2].seed = 1.2, 5, 12
        return reqs

    plain = generate(Runner(target, max_total_tokens=400, max_running_requests=4), requests(lens=(5,)))
    runner = Runner(target, draft, spec, max_total_tokens=400, max_running_requests=4)
    first = generate(runner, batch())
    assert first["r0"] == plain["r0"]
    assert first == generate(Runner(target, draft, spec, max_total_tokens=400, max_running_requests=4), batch())
    assert runner.num_draft_tokens_accepted > 0
    assert all(0 <= t < 64 for toks in first.values() for t in toks)


@pytest.mark.parametrize("algorithm", [None, "EAGLE3", "MTP"])
def test_chunked_prefill_gives_the_same_tokens(algorithm):
    """Prompts cut into chunks of at most 5 padded tokens (several steps each, mixed with the
    decoding of requests already running) give the unchunked output; aborting a request halfway
    through its prefill returns its slots."""
    target, perm = target_for(1)
    draft = copy_draft(algorithm, target, perm) if algorithm else None
    spec = SpecSettings(algorithm, 3, 1, 4) if algorithm else None
    whole = generate(Runner(target, draft, spec, max_total_tokens=400, max_running_requests=4), requests())
    chunked = Runner(target, draft, spec, max_total_tokens=400, max_running_requests=4,
                     prefill_chunk_tokens=5)
    assert generate(chunked, requests()) == whole
    free = chunked.num_free_slots
    chunked.add(requests(lens=(12,))[0])
    assert chunked.step() == [] and chunked.num_free_slots == free - 5
    chunked.abort("r0")
    assert chunked.num_free_slots == free and chunked.num_running == 0


@pytest.mark.parametrize("hc_mult,algorithm,topk,n", [(1, "EAGLE3", 2, 5), (4, "MTP", 1, 4)])
def test_bfloat16_models_run_greedy_and_sampled(hc_mult, algorithm, topk, n):
    """The serving dtype: pools and draft state in bfloat16 (hyper-connection mixers stay
    float32), greedy and sampled requests complete, drafts are accepted, slots come back."""
    target, perm = predictable_target(tiny_config(hc_mult=hc_mult), seed=0, layer_scale=0.5,
                                      dtype=torch.bfloat16)
    draft = copy_draft(algorithm, target, perm)
    runner = Runner(target, draft, SpecSettings(algorithm, 3, topk, n), max_total_tokens=400,
                    max_running_requests=4)
    assert runner.target_kv.k.dtype == runner.draft_kv.k.dtype == runner.draft_hidden.dtype == torch.bfloat16
    if hc_mult > 1:
        assert target.layers[0].attn_hc.fn.dtype == torch.float32
    greedy = generate(runner, requests())
    sampled = generate(runner, requests(temperature=0.7, top_p=0.9))
    assert all(len(v) == MAX_TOKENS for v in greedy.values())
    assert all(0 <= t < 64 for out in (greedy, sampled) for v in out.values() for t in v)
    assert runner.num_draft_tokens_accepted > 0.1 * runner.num_draft_tokens_proposed


@pytest.mark.parametrize("algorithm,hc_mult", [("EAGLE", 1), ("EAGLE3", 1), ("MTP", 1), ("EAGLE", 4), ("MTP", 4)])
def test_engine_models_are_frozen(algorithm, hc_mult):
    """No engine parameter requires grad (the hyper-connection mixing weights included): a forward
    outside inference mode, such as a CUDA-graph capture, must not record autograd state, which
    would keep every intermediate of the captured forward alive in the graph's pool."""
    from specdeploy.engine.models.draft import build_draft
    target = random_target(tiny_config(hc_mult=hc_mult), seed=0)
    cfg = target.cfg.__class__(**{**target.cfg.__dict__, "num_layers": 1})
    draft = build_draft(algorithm, cfg, target, torch.float32, "cpu")
    trainable = [n for n, p in [*target.named_parameters(), *draft.named_parameters()] if p.requires_grad]
    assert trainable == []
    runner = Runner(target, draft, SpecSettings(algorithm, 2, 1, 3), max_total_tokens=200, max_running_requests=2,
                    cuda_graph_batch_sizes=(2,), graph_mode="padded")
    for r in requests(lens=(4, 6), max_tokens=4):
        runner.add(r)
    runner.step()  # prefill
    # The padded graph body called outside inference mode, as a capture calls it.
    b = runner.calls.spec_step_graphs[False]
    outs = b.fn(**b._views(2))
    assert all(o.grad_fn is None for o in outs if o is not None)
