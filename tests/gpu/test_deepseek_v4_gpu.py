"""DeepSeek-V4 on the GPU (run on the device): logits equal transformers' in float32 (TF32 off);
greedy MTP speculation with captured CUDA graphs (chain and tree, every bucket, padded batches)
emits the target-only tokens and gives every slot and pool row back; bf16 runs under graphs."""

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
pytest.importorskip("transformers.models.deepseek_v4")

from v4_tiny import TINY, engine_model, hf_model, random_mtp, stable_indexer_ties  # noqa: E402

from specdeploy.engine.models.attention import causal_batch  # noqa: E402
from specdeploy.engine.memory.kv import SlotTable  # noqa: E402
from specdeploy.engine.runtime.runner import Request, Runner  # noqa: E402
from specdeploy.engine.planner.plan import SpecSettings  # noqa: E402

DEV = "cuda"
BUCKETS = (1, 2, 4)
CONFIG = {**TINY, "vocab_size": 12, "moe_intermediate_size": 32}


@pytest.fixture(autouse=True)
def _exact_float32():
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


@pytest.fixture(scope="module")
def models():
    hf = hf_model(CONFIG)
    target = engine_model(CONFIG, hf).to(DEV)
    return hf, target, random_mtp(target).to(DEV)


def test_logits_match_transformers_on_cuda(models):
    hf, target, _ = models
    n = 40
    ids = torch.randint(0, CONFIG["vocab_size"], (1, n), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), stable_indexer_ties():
        want = hf(ids, use_cache=False).logits[0]
    table = SlotTable(n + 8, 1, n + 8, DEV)
    kv = target.make_kv(n + 8, n + 7, 1, n + 8, torch.float32, DEV)
    table.listeners.append(kv)
    row, length, got = table.alloc_row(), 0, []
    with torch.no_grad():
        for take in [13] + [1] * (n - 13):
            slots = table.alloc(take)[None]
            table.req_to_slot[row, length:length + take] = slots[0]
            batch = causal_batch(slots, torch.tensor([take], device=DEV), table.req_to_slot[[row], :length],
                                 torch.tensor([length], device=DEV))
            out = target(ids[:, length:length + take].to(DEV), (length + torch.arange(take, device=DEV))[None], batch, kv)
            got.append(target.logits(out.hidden)[0].cpu())
            table.commit(row, length, length + take)
            length += take
    torch.testing.assert_close(torch.cat(got), want, atol=1e-3, rtol=0)


def serve(target, draft, spec, graph_mode):
    runner = Runner(target, draft, spec, max_total_tokens=400, max_running_requests=4, context_length=96,
                    device=DEV, cuda_graph_batch_sizes=BUCKETS, graph_mode=graph_mode)
    pools = [kv for kv in (runner.target_kv, runner.draft_kv) if kv is not None]
    baseline = runner.num_free_slots, [{n: kv.free_rows(n) for n in kv.pools} for kv in pools]
    g = torch.Generator().manual_seed(5)
    # 3 requests: batch 3 replays the bucket of 4 with a padded row
    for i, n in enumerate((9, 17, 3)):
        runner.add(Request(str(i), torch.randint(0, CONFIG["vocab_size"], (n,), generator=g).tolist(), max_tokens=20))
    out = {str(i): [] for i in range(3)}
    while runner.num_running:
        for o in runner.step():
            out[o.req_id] += o.token_ids
    assert (runner.num_free_slots, [{n: kv.free_rows(n) for n in kv.pools} for kv in pools]) == baseline
    return out, runner


@pytest.mark.parametrize("spec", [SpecSettings("MTP", 3, 1, 4), SpecSettings("MTP", 2, 2, 4), SpecSettings("MTP", 2, 3, 7)],
                         ids=["chain3", "tree2x2", "tree2x3"])
def test_graphed_mtp_speculation_is_lossless(models, spec):
    _, target, mtp = models
    reference, _ = serve(target, None, SpecSettings("NONE"), "off")
    graphed_plain, _ = serve(target, None, SpecSettings("NONE"), "capture")
    out, runner = serve(target, mtp, spec, "capture")
    assert graphed_plain == reference
    assert out == reference
    assert runner.num_draft_tokens_accepted > 0


def test_bf16_runs_under_graphs(models):
    _, target, _ = models
    hf = hf_model(CONFIG)
    bf16 = engine_model(CONFIG, hf, dtype=torch.bfloat16).to(DEV)
    mtp = random_mtp(bf16).to(DEV, torch.bfloat16)
    assert bf16.layers[0].self_attn.sinks.dtype == torch.float32  # kept float32 like the checkpoint
    out, runner = serve(bf16, mtp, SpecSettings("MTP", 2, 1, 3), "capture")
    assert all(len(tokens) == 20 for tokens in out.values())


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_two_gpus_expert_parallel_with_graphs_equal_one_gpu(tmp_path):
    """TP 2 over NCCL, each rank capturing its graphs with the MoE all-reduces inside: the same
    greedy tokens as one GPU (float32), each rank holding half the routed experts."""
    from tp_ranks import held_bytes, rank_spec, run_one, run_tp
    from v4_tiny import save_published

    from specdeploy.engine.runtime import distributed

    config = {**TINY, "vocab_size": 64, "n_routed_experts": 4}
    hf = hf_model(config)
    root = tmp_path / "target"
    save_published(root, config, hf, random_mtp(engine_model(config, hf)))
    cases = [("NONE", 0, 0), ("MTP", 1, 4), ("MTP", 2, 5)]
    reference = []
    for a, k, n in cases:
        tokens, runner = run_one(rank_spec(root, root if a != "NONE" else None, a, k, n, 1, device="cuda"))
        reference.append((tokens, held_bytes(runner)["weights"]))
        del runner
        torch.cuda.empty_cache()
    init_method = distributed.free_init_method()
    specs = [rank_spec(root, root if a != "NONE" else None, a, k, n, 2, init_method, device="cuda") for a, k, n in cases]
    for (algorithm, *_), (want, weights_tp1), (tokens, held) in zip(cases, reference, run_tp(specs)):
        assert tokens == want, f"{algorithm}: TP 2 differs from one GPU"
        for rank, h in held.items():
            assert h["captured_graphs"] > 0, f"rank {rank} captured no CUDA graph"
            assert h["weights"] < weights_tp1


def _fp4_experts(model, seed: int):
    """`model`'s routed experts as FP4 codes (the published layout), random: e2m1 pairs and E8M0
    scale bits around 2^-3, dequantized inside the expert computation."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    for m in model.modules():
        if type(m).__name__ == "_Experts":
            m.quantize("fp4")
            for name in ("gate_up_proj", "down_proj"):
                codes, bits = getattr(m, name), getattr(m, name + "_scale")
                codes.copy_(torch.randint(-128, 128, codes.shape, device=DEV, generator=g, dtype=torch.int8))
                bits.copy_(torch.randint(122, 126, bits.shape, device=DEV, generator=g, dtype=torch.uint8))
    return model


@pytest.mark.parametrize("spec", [SpecSettings("MTP", 3, 1, 4), SpecSettings("MTP", 2, 2, 4)], ids=["chain3", "tree2x2"])
def test_graphed_mtp_over_fp4_experts_is_lossless(spec):
    """FP4 routed experts (dequantized per step inside the captured graphs: the rows' experts
    when a step has fewer rows than experts, every expert a chunk at a time otherwise) in float32:
    graphed speculation emits the eager target-only tokens."""
    hf = hf_model(CONFIG)
    target = _fp4_experts(engine_model(CONFIG, hf).to(DEV), seed=7)
    mtp = _fp4_experts(random_mtp(target).to(DEV), seed=8)
    reference, _ = serve(target, None, SpecSettings("NONE"), "off")
    out, runner = serve(target, mtp, spec, "capture")
    assert out == reference
    assert runner.num_draft_tokens_accepted > 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fp4_dequant_kernel_is_the_torch_code(dtype):
    """engine/kernels/fp4.py at an expert chunk of Flash's gate/up shape (16 experts x 4096 rows of
    4096 inputs), every code byte: bit for bit the torch code's dequantization."""
    from specdeploy.engine.kernels import fp4
    from specdeploy.engine.models.deepseek_v4 import V4ModelConfig, _Experts

    experts = _Experts(V4ModelConfig.from_hf(CONFIG)).to(DEV)
    experts.quantize("fp4")
    g = torch.Generator(device=DEV).manual_seed(3)
    codes = torch.randint(-128, 128, (16 * 4096, 2048), device=DEV, generator=g, dtype=torch.int8)
    bits = torch.randint(100, 150, (16 * 4096, 4096 // 32), device=DEV, generator=g, dtype=torch.uint8)
    got = fp4.dequant_fp4(codes, bits, dtype)
    want = experts._fp4(codes, bits, dtype, kernel=False)
    assert torch.equal(got, want)
    assert torch.equal(experts._fp4(codes, bits, dtype), got)  # what the experts use on CUDA
