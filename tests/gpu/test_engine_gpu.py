"""GPU checks of the engine (run on the device): CUDA-graph replay equals eager execution for
every captured batch size, padded batches included; the Triton slot-pool attention equals the
reference attention; speculative decoding under graphs + fast attention stays lossless."""

import pytest
import torch
from tolerance import bound, max_gap, relative_gap

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from specdeploy.engine.models import attention  # noqa: E402
from specdeploy.engine.models.attention import AttnBatch, reference  # noqa: E402
from specdeploy.engine.runtime.runner import Runner  # noqa: E402
from specdeploy.engine.planner.plan import SpecSettings  # noqa: E402
from specdeploy.engine.demo.toy import (copy_draft, predictable_target, random_requests,  # noqa: E402
                                   run_to_completion, tiny_config)

DEV = "cuda"
BUCKETS = (1, 2, 4, 8)


def gpu_config(hc_mult=1):
    return tiny_config(hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, vocab_size=64,
                       intermediate_size=128, hc_mult=hc_mult)


@pytest.fixture(params=["reference", "fast"])
def backend(request):
    attention.set_backend(request.param)
    yield request.param
    attention.set_backend("auto")


def _attention_inputs(b, num_q, hq, hkv, d, prefix_max, dtype, seed=0, slots=4096):
    g = torch.Generator(device=DEV).manual_seed(seed)
    k = torch.randn(slots, hkv, d, device=DEV, generator=g).to(dtype)
    v = torch.randn(slots, hkv, d, device=DEV, generator=g).to(dtype)
    q = torch.randn(b, num_q, hq, d, device=DEV, generator=g).to(dtype)
    lens = torch.randint(0, prefix_max + 1, (b,), device=DEV, generator=g)
    prefix = torch.randint(1, slots, (b, max(prefix_max, 1)), device=DEV, generator=g)
    new = torch.randint(1, slots, (b, num_q), device=DEV, generator=g)
    mask = ((torch.rand(b, num_q, num_q, device=DEV, generator=g) < 0.5).tril()
            | torch.eye(num_q, dtype=torch.bool, device=DEV))
    return q, k, v, AttnBatch(new, prefix, lens, new, mask)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("b,num_q,hq,hkv,prefix_max,splits", [
    (5, 1, 8, 2, 300, None), (5, 6, 8, 2, 200, None), (5, 37, 8, 2, 0, None), (5, 5, 8, 2, 1, None),
    (1, 1, 32, 8, 1024, None), (1, 8, 32, 8, 2048, None), (3, 1, 4, 4, 700, 16), (2, 4, 8, 1, 513, 8),
    (64, 1, 32, 8, 1024, None), (2, 300, 8, 2, 100, 2)])
def test_fast_attention_matches_reference(dtype, b, num_q, hq, hkv, prefix_max, splits):
    """Decode, verify (tree mask) and prefill shapes; GQA 1, 4, 8; chosen and forced splits."""
    from specdeploy.engine.kernels import attention as attention_triton
    d = 64 if hq < 32 else 128
    q, k, v, batch = _attention_inputs(b, num_q, hq, hkv, d, prefix_max, dtype)
    ref = reference(q.float(), k.float(), v.float(), batch, d ** -0.5)
    fast = attention_triton.attend(q, k, v, batch, d ** -0.5, num_splits=splits).float()
    # Reductions: the d-long q.k dots and the softmax-weighted sum over every key; stores: the
    # probabilities and the output in `dtype` (split partials stay float32).
    assert max_gap(fast, ref) < bound(dtype, max(d, prefix_max + num_q), roundings=2)


def test_fast_attention_graph_replays_for_other_lengths():
    """The split count and partials depend on shapes only: a graph captured at one set of prefix
    lengths gives the reference answer after the lengths and slots change in place."""
    from specdeploy.engine.kernels import attention as attention_triton
    q, k, v, batch = _attention_inputs(2, 4, 32, 8, 128, 1024, torch.bfloat16)
    attention_triton.attend(q, k, v, batch, 0.1)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = attention_triton.attend(q, k, v, batch, 0.1)
    for lens in ([1024, 0], [1, 1000], [77, 513]):
        batch.prefix_lens.copy_(torch.tensor(lens, device=DEV))
        batch.prefix_slots.random_(1, k.shape[0])
        graph.replay()
        ref = reference(q.float(), k.float(), v.float(), batch, 0.1)
        assert max_gap(out.float(), ref) < bound(torch.bfloat16, max(lens) + 4, roundings=2), lens


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_elementwise_kernels_match_torch(dtype):
    """RMSNorm (also after a residual add) and SiLU-times-up take the Triton kernels on CUDA
    without autograd; with a gradient to track (or on CPU) the torch code. Both must agree."""
    from specdeploy.engine.models.layers import GatedMLP, RMSNorm
    g = torch.Generator(device=DEV).manual_seed(3)
    norm = RMSNorm(4096, 1e-5).to(DEV, dtype)
    norm.weight.copy_(1 + 0.1 * torch.randn(4096, device=DEV, generator=g))
    mlp = GatedMLP(4096, 14336).to(DEV, dtype)
    for p in mlp.parameters():
        p.copy_(0.02 * torch.randn(p.shape, device=DEV, generator=g))
    x = torch.randn(3, 5, 4096, device=DEV, generator=g).to(dtype)
    delta = torch.randn(3, 5, 4096, device=DEV, generator=g).to(dtype)
    with torch.no_grad():
        fast_norm, fast_mlp = norm(x), mlp(x)
        fast_sum, fast_added = norm.add_forward(x, delta)
    x.requires_grad_()   # autograd: the torch code
    slow_norm, slow_mlp = norm(x), mlp(x)
    slow_sum, slow_added = norm.add_forward(x, delta)
    assert slow_norm.requires_grad and slow_mlp.requires_grad and slow_added.requires_grad
    # The norm reduces 4096 squares and stores its output; the MLP's longest reduction is down's
    # 14336 inputs, after SiLU-times-up is stored once (tests/support/tolerance.py).
    assert max_gap(fast_norm, slow_norm.detach()) < bound(dtype, 4096, roundings=2)
    assert max_gap(fast_added, slow_added.detach()) < bound(dtype, 4096, roundings=2)
    assert torch.equal(fast_sum, slow_sum.detach())
    assert max_gap(fast_mlp, slow_mlp.detach()) < bound(dtype, 14336, roundings=2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hyper_connection_kernels_match_torch(dtype):
    """A DeepSeek-V4-wide hyper-connection sublayer and head (hc 4, H 7168) take the Triton
    kernels on CUDA without autograd and the torch code with it: both must agree."""
    from specdeploy.engine.models.hc import HCConfig, HyperConnection, HyperHead
    g = torch.Generator(device=DEV).manual_seed(4)
    cfg = HCConfig(hidden_size=7168, hc_mult=4)
    hc, head = HyperConnection(cfg).to(DEV), HyperHead(cfg).to(DEV)
    for p in [*hc.parameters(), *head.parameters()]:
        p.copy_(torch.randn(p.shape, device=DEV, generator=g) * (0.02 if p.dim() == 2 else 1.0))
    streams = torch.randn(3, 5, 4, 7168, device=DEV, generator=g).to(dtype)
    proj = torch.randn(7168, 7168, device=DEV, generator=g).to(dtype) * 7168 ** -0.5

    def sublayer(x):
        return x @ proj

    from specdeploy.engine import kernels
    from specdeploy.engine.models.layers import fused_kernels
    with torch.no_grad():
        assert fused_kernels(streams, hc.fn, ops=kernels.hc_ops) is not None  # the kernels do run
        fast, fast_head = hc(streams, sublayer), head(streams)
    # Frozen mixing, trainable sublayer: the kernels mix, and the sublayer still gets its gradient.
    proj.requires_grad_()
    hc(streams, sublayer).float().square().mean().backward()
    assert proj.grad is not None and proj.grad.abs().sum() > 0
    proj.requires_grad_(False)
    for p in [*hc.parameters(), *head.parameters()]:
        p.requires_grad_()   # autograd: the torch code
    slow, slow_head = hc(streams, sublayer), head(streams)
    assert slow.requires_grad and slow_head.requires_grad
    # Longest reductions: the sublayer's 7168-wide matmul and the mixes over hc x 7168 inputs;
    # stores: the mixed input, the sublayer's output and the combined streams.
    assert max_gap(fast, slow.detach()) < bound(dtype, 4 * 7168, roundings=3)
    assert max_gap(fast_head, slow_head.detach()) < bound(dtype, 4 * 7168, roundings=3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_store_kernel_matches_torch(dtype):
    """The attention block's fused rope + K/V write (CUDA, no autograd) against its torch code
    (taken when a gradient is tracked): the same pool contents and output."""
    from specdeploy.engine.models.llama import Attention, rope_tables
    from specdeploy.engine.demo.toy import init_random_
    cfg = tiny_config(hidden_size=1024, num_heads=8, num_kv_heads=2, head_dim=128, qkv_bias=True)
    attn = Attention(cfg)
    init_random_(attn, torch.Generator().manual_seed(1), std=0.05)
    attn.to(DEV, dtype)
    g = torch.Generator(device=DEV).manual_seed(4)
    b, q = 3, 5
    x = torch.randn(b, q, 1024, device=DEV, generator=g).to(dtype)
    positions = torch.randint(0, 4000, (b, q), device=DEV, generator=g)
    cos, sin = rope_tables(attn_inv_freq(cfg).to(DEV), positions, dtype)
    slots = torch.randperm(100, device=DEV, generator=g)[:b * q].view(b, q) + 1
    batch = AttnBatch(slots, slots[:, :1], torch.zeros(b, dtype=torch.int64, device=DEV), slots,
                      torch.ones(b, q, q, dtype=torch.bool, device=DEV).tril())
    results = []
    for grad in (False, True):
        k_cache = torch.zeros(128, 2, 128, dtype=dtype, device=DEV)
        v_cache = torch.zeros_like(k_cache)
        with torch.set_grad_enabled(grad):
            out = attn(x.clone().requires_grad_(grad), cos, sin, k_cache, v_cache, batch)
        results.append((out.detach(), k_cache.detach(), v_cache.detach()))
    # Relative error of the output (the 1024-wide projections, attention over <= 5 keys; stores of
    # q/k/v, the attention output and the projection) and of the pool's K and V (a rotation).
    for name, fast, slow in zip(("out", "k", "v"), *results):
        err = relative_gap(fast, slow)
        assert err < bound(dtype, 1024, roundings=4 if name == "out" else 2), (name, err)


def attn_inv_freq(cfg):
    from specdeploy.engine.models.layers import rope_inv_freq
    return rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)


CASES = [("EAGLE", 1, 1, 4), ("EAGLE", 4, 2, 5), ("EAGLE3", 1, 1, 4), ("MTP", 4, 3, 6)]


def _graphed(runner, fused=True):
    """A runner's eager calls wrapped in GraphedCalls with every graph of its own (the runner
    captures whole steps by request row instead, rows.py: the runner tests cover those)."""
    from types import SimpleNamespace

    from specdeploy.engine.runtime.graphs import GraphedCalls

    calls = GraphedCalls(runner.calls, BUCKETS, runner.context_length, fused=fused)
    return SimpleNamespace(calls=calls, target_kv=runner.target_kv, draft_kv=runner.draft_kv)


def graphed_and_eager(algorithm, hc_mult, topk, n, fused):
    """-> (target, draft, graphed calls, eager ModelCalls reading and writing the graphed
    calls' K/V pools)."""
    target, perm = predictable_target(gpu_config(hc_mult), seed=0, layer_scale=0.25, device=DEV)
    draft = copy_draft(algorithm, target, perm)
    spec = SpecSettings(algorithm, 3, topk, n)
    graphed = _graphed(Runner(target, draft, spec, max_total_tokens=4000, max_running_requests=8,
                              context_length=256, device=DEV, graph_mode="off"), fused)
    eager_calls = Runner(target, draft, spec, max_total_tokens=4000, max_running_requests=8,
                         context_length=256, device=DEV, graph_mode="off").calls
    eager_calls.target_kv, eager_calls.draft_kv = graphed.target_kv, graphed.draft_kv
    return target, draft, graphed, eager_calls


def _same_drafts(got, want, topk, where):
    """Draft candidates (tokens, scores, parents) from a graph replay and from eager calls. The
    two differ in rounding (the graph attends over its static prefix width), which may flip the
    choice between two nearly equal draft logits on random inputs, after which a row drafts from
    another token. Step 0 reads no attention: equal. Later steps: equal up to a row's first
    difference, in at least half the rows."""
    tokens, scores, parents = got[0], got[1], got[2]
    assert torch.equal(tokens[:, :topk], want[0][:, :topk]), where
    assert torch.allclose(scores[:, :topk], want[1][:, :topk], atol=1e-4), where
    for row in range(tokens.shape[0]):
        diff = (tokens[row] != want[0][row]).nonzero()
        upto = int(diff[0]) if len(diff) else tokens.shape[1]
        assert torch.equal(parents[row, :upto], want[2][row, :upto]), where
    mismatched = (tokens != want[0]).any(1).float().mean().item()
    assert mismatched <= 0.5, (where, mismatched)


@pytest.mark.parametrize("algorithm,hc_mult,topk,n", CASES)
def test_graph_replay_equals_eager_per_call(algorithm, hc_mult, topk, n, backend):
    """Every bucket, at full size and one row short (padding): verify, draft extend and draft
    multi-step graphed one by one (plain decode has its own test)."""
    target, draft, graphed, eager_calls = graphed_and_eager(algorithm, hc_mult, topk, n, fused=False)
    g = torch.Generator(device=DEV).manual_seed(1)
    steps, hc = 3, draft.carried_size
    for bs in BUCKETS:
        for b in sorted({bs, max(bs - 1, 1)}):
            lens = torch.randint(1, 60, (b,), device=DEV, generator=g)
            prefix = torch.randint(1, 3000, (b, int(lens.max())), device=DEV, generator=g)
            fresh = lambda w: torch.arange(3000, 3000 + b * w, device=DEV).view(b, w)  # noqa: E731
            ids = torch.randint(0, 64, (b, n), device=DEV, generator=g)
            mask = torch.ones(b, n, n, dtype=torch.bool, device=DEV).tril()
            pos = lens[:, None] + torch.arange(n, device=DEV)
            for calls in (graphed.calls, eager_calls):  # the second call rewrites identical K/V
                out = calls.target_verify(ids, pos, fresh(n), prefix, lens, mask)
                if calls is graphed.calls:
                    got = [t.clone() for t in out]
            assert all(torch.allclose(x, y, atol=1e-4, rtol=1e-4) for x, y in zip(got, out)), (bs, b)

            hidden = torch.randn(b, steps + 1, target.feature_size, device=DEV, generator=g)
            valid = torch.randint(1, steps + 2, (b,), device=DEV, generator=g)
            ext = [c.draft_extend(ids[:, :steps + 1] if n >= steps + 1 else ids, hidden,
                                  lens[:, None] + torch.arange(steps + 1, device=DEV), fresh(steps + 1),
                                  prefix, lens, valid).clone() for c in (graphed.calls, eager_calls)]
            assert torch.allclose(ext[0], ext[1], atol=1e-4, rtol=1e-4), (bs, b)

            root = torch.randn(b, hc, device=DEV, generator=g)[:, None].expand(-1, topk, -1).reshape(b * topk, hc)
            params = (torch.zeros(b, device=DEV), torch.zeros(b, dtype=torch.int64, device=DEV),
                      torch.ones(b, device=DEV))
            uni = torch.rand(b, steps, device=DEV, generator=g)
            ms = [c.draft_multi_step(root, prefix, lens, fresh((steps - 1) * topk), *params, uni, False)
                  for c in (graphed.calls, eager_calls)]
            _same_drafts(ms[0], ms[1], topk, (bs, b))


@pytest.mark.parametrize("algorithm,hc_mult,topk,n", CASES)
def test_fused_step_graph_equals_eager_per_bucket(algorithm, hc_mult, topk, n, backend):
    """The whole speculative iteration as one graph, greedy and sampling, every bucket at full
    size and one row short: the same accepted tokens, slots and draft state as eager."""
    _, draft, graphed, eager_calls = graphed_and_eager(algorithm, hc_mult, topk, n, fused=True)
    assert graphed.calls.fused and set(graphed.calls.spec_step_graphs[False].graphs) == set(BUCKETS)
    g = torch.Generator(device=DEV).manual_seed(4)
    steps, hc = 3, draft.carried_size
    for bs in BUCKETS:
        for b in sorted({bs, max(bs - 1, 1)}):
            for sampling in (False, True):
                lens = torch.randint(1, 60, (b,), device=DEV, generator=g)
                prefix = torch.randint(1, 3000, (b, int(lens.max())), device=DEV, generator=g)
                roots = torch.randint(0, 64, (b,), device=DEV, generator=g)
                hidden = torch.randn(b, hc, device=DEV, generator=g)[:, None].expand(-1, topk, -1)
                scratch = torch.arange(3000, 3000 + b * (steps - 1) * topk, device=DEV).view(b, -1)
                tree = torch.arange(3500, 3500 + b * n, device=DEV).view(b, n)
                temp = torch.full((b,), 0.8 if sampling else 0.0, device=DEV)
                params = (temp, torch.zeros(b, dtype=torch.int64, device=DEV), torch.ones(b, device=DEV))
                uni = torch.rand(b, n + 1 + steps, device=DEV, generator=g)
                outs = [[t.clone() for t in c.spec_step(roots, lens, prefix, hidden.reshape(b * topk, hc),
                                                        scratch, tree, *params, uni, sampling)]
                        for c in (graphed.calls, eager_calls)]
                # Rows whose draft flipped between two near-equal logits (rounding: see
                # _same_drafts) may accept differently; the others agree exactly.
                same = torch.ones(b, dtype=torch.bool, device=DEV)
                for x, y in zip(*outs):
                    if not x.is_floating_point():
                        same &= (x == y).view(b, -1).all(1)
                assert same.float().mean().item() >= 0.5, (bs, b, sampling)
                for i, (x, y) in enumerate(zip(*outs)):
                    if x.is_floating_point():
                        assert torch.allclose(x[same], y[same], atol=1e-4, rtol=1e-4), (bs, b, sampling, i)


@pytest.mark.parametrize("hc_mult", [1, 4])
def test_decode_graph_equals_eager_per_bucket(hc_mult, backend):
    target, _ = predictable_target(gpu_config(hc_mult), seed=0, layer_scale=0.25, device=DEV)
    graphed = _graphed(Runner(target, max_total_tokens=4000, max_running_requests=8, context_length=256,
                              device=DEV, graph_mode="off"))
    eager_calls = Runner(target, max_total_tokens=4000, max_running_requests=8, context_length=256,
                         device=DEV, graph_mode="off").calls
    eager_calls.target_kv = graphed.target_kv
    g = torch.Generator(device=DEV).manual_seed(2)
    for bs in BUCKETS:
        for b in sorted({bs, max(bs - 1, 1)}):
            lens = torch.randint(1, 60, (b,), device=DEV, generator=g)
            prefix = torch.randint(1, 3000, (b, int(lens.max())), device=DEV, generator=g)
            ids = torch.randint(0, 64, (b, 1), device=DEV, generator=g)
            slots = torch.arange(3000, 3000 + b, device=DEV)[:, None]
            dec = [c.target_decode(ids, lens[:, None], slots, prefix, lens).clone()
                   for c in (graphed.calls, eager_calls)]
            assert torch.allclose(dec[0], dec[1], atol=1e-4, rtol=1e-4), (bs, b)


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("algorithm,hc_mult,topk,n", CASES)
def test_graphed_speculative_decoding_is_lossless(algorithm, hc_mult, topk, n, backend, fused):
    target, perm = predictable_target(gpu_config(hc_mult), seed=0, layer_scale=0.25, device=DEV)
    draft = copy_draft(algorithm, target, perm)
    reqs = lambda: random_requests((5, 30, 2, 17, 9), 24, 64)  # noqa: E731
    plain = Runner(target, max_total_tokens=4000, max_running_requests=8, context_length=256,
                   device=DEV, cuda_graph_batch_sizes=BUCKETS)
    spec = Runner(target, draft, SpecSettings(algorithm, 3, topk, n), max_total_tokens=4000,
                  max_running_requests=8, context_length=256, device=DEV, cuda_graph_batch_sizes=BUCKETS,
                  fused_spec_step=fused)
    free = spec.num_free_slots
    assert run_to_completion(spec, reqs()) == run_to_completion(plain, reqs())
    assert spec.num_free_slots == free
    rate = spec.num_draft_tokens_accepted / spec.num_draft_tokens_proposed
    assert 0.1 < rate < 0.95, rate  # both accepted and rejected drafts were exercised


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("algorithm,hc_mult,topk,n", CASES)
def test_adaptive_shapes_under_graphs_are_lossless(algorithm, hc_mult, topk, n, fused):
    """Every shape's graphs captured into one pool (NONE's decode-with-feature graph too), the
    shape switched every step in a fixed random order, then the real policy with costs measured
    from the graphs: both equal target-only output."""
    import random

    from specdeploy.engine.speculative.adaptive import NONE

    target, perm = predictable_target(gpu_config(hc_mult), seed=0, layer_scale=0.25, device=DEV)
    draft = copy_draft(algorithm, target, perm)
    reqs = lambda: random_requests((5, 30, 2, 17, 9), 24, 64)  # noqa: E731
    plain = run_to_completion(Runner(target, max_total_tokens=4000, max_running_requests=8,
                                     context_length=256, device=DEV, cuda_graph_batch_sizes=BUCKETS), reqs())
    runner = Runner(target, draft, SpecSettings(algorithm, 3, topk, n), max_total_tokens=4000,
                    max_running_requests=8, context_length=256, device=DEV, cuda_graph_batch_sizes=BUCKETS,
                    fused_spec_step=fused, adaptive=True, catch_up_tokens=3)
    assert set(runner.policy.base_costs_s) == {(s, b) for s in runner.shapes for b in BUCKETS}
    rng = random.Random(0)
    chosen = []
    real_choose = runner.policy.choose

    def every_shape_in_random_order(batch_size):
        # each run of len(shapes) steps takes every shape once, in a fresh random order, so a run
        # that ends early (hc_mult 4 accepts more, so it has fewer steps) still meets all of them
        if len(chosen) % len(runner.shapes) == 0:
            every_shape_in_random_order.order = rng.sample(runner.shapes, len(runner.shapes))
        chosen.append(every_shape_in_random_order.order[len(chosen) % len(runner.shapes)])
        return chosen[-1]

    runner.policy.choose = every_shape_in_random_order
    free = runner.num_free_slots
    assert run_to_completion(runner, reqs()) == plain
    assert NONE in chosen and len(set(chosen)) == len(runner.shapes)
    runner.policy.choose = real_choose
    assert run_to_completion(runner, reqs()) == plain
    assert runner.num_free_slots == free


@pytest.mark.parametrize("shape", [(1, 128256), (4, 128256), (64, 8, 128256), (3, 64), (2, 32000)])
def test_argmax_kernel_matches_torch(shape):
    from specdeploy.engine.kernels import elementwise as elementwise_triton
    g = torch.Generator(device=DEV).manual_seed(6)
    x = torch.randn(shape, device=DEV, generator=g)
    assert torch.equal(elementwise_triton.argmax(x), x.argmax(-1))
    x[..., 7] = x.max() + 1
    x[..., -1] = x.max()  # a tie: the first wins
    assert (elementwise_triton.argmax(x) == 7).all()
    assert torch.equal(elementwise_triton.argmax(x.bfloat16()), x.bfloat16().argmax(-1))



@pytest.mark.parametrize("algorithm,hc_mult,topk,n", [("EAGLE", 1, 2, 5), ("MTP", 4, 3, 6)])
def test_graphs_with_programmatic_dependent_launch_are_lossless(algorithm, hc_mult, topk, n, monkeypatch):
    """Every Triton kernel of the step launched with PDL (engine/kernels/launch.py), eager and
    inside captured graphs: target-only and speculative output equal eager target-only decoding
    without PDL, token for token."""
    from specdeploy.engine.kernels import launch
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("programmatic dependent launch needs compute capability 9.0")
    attention.set_backend("fast")
    target, perm = predictable_target(gpu_config(hc_mult), seed=0, layer_scale=0.25, device=DEV)
    reqs = lambda: random_requests((5, 30, 2, 17, 9), 24, 64)  # noqa: E731

    def plain(**kw):
        return run_to_completion(Runner(target, max_total_tokens=4000, max_running_requests=8, context_length=256,
                                        device=DEV, **kw), reqs())

    monkeypatch.setenv(launch.PDL_ENV, "0")
    launch.reset()
    assert not launch.pdl_args(target.embed_tokens.weight)["USE_GDC"]
    want = plain(graph_mode="off")
    monkeypatch.setenv(launch.PDL_ENV, "1")
    launch.reset()
    try:
        assert launch.pdl_args(target.embed_tokens.weight)["USE_GDC"]
        assert plain(graph_mode="off") == want
        assert plain(cuda_graph_batch_sizes=BUCKETS) == want
        spec = Runner(target, copy_draft(algorithm, target, perm), SpecSettings(algorithm, 3, topk, n),
                      max_total_tokens=4000, max_running_requests=8, context_length=256, device=DEV,
                      cuda_graph_batch_sizes=BUCKETS)
        assert run_to_completion(spec, reqs()) == want
        assert spec.num_draft_tokens_accepted > 0
    finally:
        monkeypatch.delenv(launch.PDL_ENV)
        launch.reset()


def test_no_pdl_right_after_a_library_gemm(monkeypatch):
    """engine/kernels/launch.py: the launch right after after_library_gemm is a plain one, the one
    after it PDL again; SPECDEPLOY_PDL=all keeps PDL there too; off CUDA nothing is flagged."""
    from specdeploy.engine.kernels import launch
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("programmatic dependent launch needs compute capability 9.0")
    t = torch.zeros(4, device=DEV)
    monkeypatch.setenv(launch.PDL_ENV, "1")
    launch.reset()
    try:
        launch.after_library_gemm(t)
        assert launch.pdl_args(t) == {"USE_GDC": False}
        assert launch.pdl_args(t) == {"USE_GDC": True, "launch_pdl": True}
        monkeypatch.setenv(launch.PDL_ENV, "all")
        launch.reset()
        launch.after_library_gemm(t)
        assert launch.pdl_args(t) == {"USE_GDC": True, "launch_pdl": True}
        launch.after_library_gemm(torch.zeros(4))
        assert launch._AFTER_LIBRARY == set()
    finally:
        monkeypatch.delenv(launch.PDL_ENV)
        launch.reset()
