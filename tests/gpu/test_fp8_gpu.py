"""GPU checks of the FP8 paths (run on the device; Hopper or Ada for the e4m3 kernels):

- the FP8 linear kernels at the Llama-3.1-8B layer shapes against float32 matmuls over the
  dequantized weights, at every row count bench/fp8_crossover.py times. Tolerances: weight-only
  (the small-M kernel up to 16 rows, `w8a16` for per-channel weights up to 64) rounds once to
  bf16, so every element is within 2^-7 of its magnitude plus 2^-10 of the row's largest; W8A8
  (block weights above four rows through DeepGEMM where installed, torch's block-scaled scaled_mm
  above 16 rows where it runs, the Triton kernel otherwise and for per-channel weights above 64) is within bf16 rounding (2^-8 of each
  element, plus 2^-9 of its row's largest for boundary codes) of the same product over
  DeepSeek-quantized activations, and within 4% of the unquantized product (e4m3 activations
  carry 3 mantissa bits);
- CUDA-graph replay of an FP8 target equals eager, and speculative decoding on an FP8 target
  with an FP8 KV pool is lossless against target-only decoding of it (greedy, float32 outputs
  from bf16 weights are not bit-stable across M, so this runs in float32);
- the attention kernel over an e4m3 pool equals the reference over the same codes.
"""

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
if torch.cuda.get_device_capability() < (8, 9):
    pytest.skip("the e4m3 kernels need compute capability 8.9 or later", allow_module_level=True)

import importlib.util  # noqa: E402
import logging  # noqa: E402

import torch.nn.functional as F  # noqa: E402

from specdeploy.engine.demo.toy import copy_draft, random_requests, run_to_completion  # noqa: E402
from specdeploy.engine.kernels import fp8 as fp8_kernels  # noqa: E402
from specdeploy.engine.kernels import gemv  # noqa: E402
from specdeploy.engine.models import fp8  # noqa: E402
from specdeploy.engine.runtime.runner import Runner  # noqa: E402
from specdeploy.engine.planner.plan import SpecSettings  # noqa: E402

DEV = "cuda"
# (N, K) of Llama-3.1-8B's fused qkv, o, fused gate/up and down projections
LLAMA_8B = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336),
            (32000, 4096)]  # the 8B EAGLE-3 head's own lm_head (--draft-quantization fp8)


def _weights(n, k, scheme, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    w = torch.randn(n, k, device=DEV, generator=g) * 0.02
    if scheme == "block":
        codes, scale = fp8.quantize_fp8_block(w, (128, 128))
        return codes, scale, 128
    codes, scale = fp8.quantize_fp8_channel(w)
    return codes, scale.reshape(-1).contiguous(), 1


# The row counts bench/fp8_crossover.py times (decode, verify and prefill chunks)
BENCH_ROWS = (1, 16, 32, 64, 65, 128, 256, 512, 2048, 8192)
SM90_TORCH = (torch.cuda.get_device_capability() == (9, 0) and hasattr(F, "scaled_mm")
              and hasattr(F, "ScalingType"))
DEEP_GEMM = torch.cuda.get_device_capability() == (9, 0) and importlib.util.find_spec("deep_gemm") is not None


def _assert_weight_only(got, x, codes, scale, scale_n):
    want = F.linear(x.float(), fp8.dequantize_fp8(codes, scale, (scale_n, 128), torch.float32))
    err = (got.float() - want).abs()
    assert (err <= want.abs() * 2**-7 + want.abs().amax(1, keepdim=True) * 2**-10).all(), err.max()


@pytest.mark.parametrize("n,k", LLAMA_8B)
@pytest.mark.parametrize("m,scheme", [(1, "block"), (7, "block"), (16, "block"),
                                      (1, "channel"), (7, "channel"), (16, "channel"), (64, "channel")])
def test_weight_only_decode_kernel(n, k, m, scheme):
    """The small-M kernel (block weights: the route to 4 rows, and up to 16 rows where DeepGEMM
    is not installed; per-channel weights: every M here), then the engine's route; held to the
    weight-only bound, or the W8A8 one where the table's launch quantizes x."""
    codes, scale, scale_n = _weights(n, k, scheme)
    x = torch.randn(m, k, device=DEV).to(torch.bfloat16)
    out = torch.empty(m, n, device=DEV, dtype=torch.bfloat16)
    quantizing = False
    if m <= gemv.GEMV_MAX_M:
        cfg = gemv.config_for("fp8", n, k, m, x.device)
        gemv.launch(x, codes, scale, scale_n, None, out, *cfg)
        quantizing = cfg[0] in gemv.QUANTIZING_VARIANTS  # x rounded to e4m3 in the kernel (dot8, sw8)
        (_assert_w8a8 if quantizing else _assert_weight_only)(out, x, codes, scale, scale_n)
    got = fp8_kernels.fp8_linear(x, codes, scale, scale_n)
    route = "gemv" if scheme == "channel" else fp8_kernels.block_route(
        m, lambda o: fp8_kernels.library_available(o, torch.device(DEV), torch.bfloat16))
    (_assert_weight_only if route == "gemv" and not quantizing else _assert_w8a8)(got, x, codes, scale, scale_n)


@pytest.mark.parametrize("n,k", LLAMA_8B)
@pytest.mark.parametrize("m", [32, 64])
def test_weight_only_kernel_for_block_weights(n, k, m):
    """`w8a16` is the block weights' fallback for 17-64 rows where torch's GEMM is not usable."""
    codes, scale, scale_n = _weights(n, k, "block")
    x = torch.randn(m, k, device=DEV).to(torch.bfloat16)
    out = torch.empty(m, n, device=DEV, dtype=torch.bfloat16)
    fp8_kernels.w8a16(x, codes, scale, scale_n, None, out, *fp8_kernels._decode_tiles(m, n))
    _assert_weight_only(out, x, codes, scale, scale_n)


def _assert_w8a8(got, x, codes, scale, scale_n):
    k = x.shape[1]
    got = got.float()
    wd = fp8.dequantize_fp8(codes, scale, (scale_n, 128), torch.float32)
    xq, xs = fp8.act_quant_reference(x.float())
    want = F.linear(xq.float() * xs.repeat_interleave(128, 1)[:, :k], wd)
    # bf16 output: rounding alone is up to 2^-8 of each value (measured 1.7e-3 relative Frobenius
    # on the H200, 2026-12-01); a code that act_quant rounds the other way on a boundary moves a
    # value by a fraction of its row's largest.
    err = (got - want).abs()
    assert (err <= want.abs() * 2**-8 + want.abs().amax(1, keepdim=True) * 2**-9).all(), err.max()
    exact = F.linear(x.float(), wd)
    assert ((got - exact).norm() / exact.norm()).item() < 0.04


@pytest.mark.parametrize("n,k", LLAMA_8B)
@pytest.mark.parametrize("m", [m for m in BENCH_ROWS if m > 16] + [17])
@pytest.mark.parametrize("scheme", ["block", "channel"])
def test_w8a8_prefill_kernel(n, k, m, scheme):
    """The engine's route above 16 rows, then the Triton W8A8 kernel itself for block weights
    (the fallback where torch's block-scaled GEMM is not usable)."""
    codes, scale, scale_n = _weights(n, k, scheme)
    x = torch.randn(m, k, device=DEV).to(torch.bfloat16)
    got = fp8_kernels.fp8_linear(x, codes, scale, scale_n)
    if scheme == "channel" and m <= fp8_kernels.DECODE_MAX_M:
        _assert_weight_only(got, x, codes, scale, scale_n)
    else:
        _assert_w8a8(got, x, codes, scale, scale_n)
    if scheme == "block":
        out = torch.empty(m, n, device=DEV, dtype=torch.bfloat16)
        _assert_w8a8(fp8_kernels._w8a8(x, codes, scale, scale_n, None, out, False), x, codes, scale, scale_n)


@pytest.mark.skipif(not SM90_TORCH, reason="torch's block-scaled scaled_mm (cuBLASLt) needs SM90 and torch >= 2.9")
@pytest.mark.parametrize("n,k", LLAMA_8B)
@pytest.mark.parametrize("m", [m for m in BENCH_ROWS if m > 16] + [17, 100])
def test_torch_block_scaled_mm_route(n, k, m):
    """On the H200 block weights above 16 rows take torch's block-scaled GEMM (the probe passes;
    rows not a multiple of 16 padded), agreeing with the dequantized reference as the Triton W8A8
    kernel does; a bias is one bf16 add after the GEMM's own rounding."""
    assert fp8_kernels.torch_block_mm_available(torch.device(DEV), torch.bfloat16)
    codes, scale, scale_n = _weights(n, k, "block")
    assert fp8_kernels.torch_block_shape_ok(codes, scale, scale_n)
    x = torch.randn(m, k, device=DEV).to(torch.bfloat16)
    got = fp8_kernels.torch_block_linear(x, codes, scale)
    assert got.shape == (m, n) and got.is_contiguous()
    _assert_w8a8(got, x, codes, scale, scale_n)
    bias = torch.randn(n, device=DEV).to(torch.bfloat16)
    assert torch.equal(fp8_kernels.torch_block_linear(x, codes, scale, bias), got + bias)


@pytest.mark.skipif(not (SM90_TORCH or DEEP_GEMM), reason="neither DeepGEMM nor torch's block-scaled scaled_mm is here")
def test_block_route_replays_in_a_graph():
    """The engine's route at 64 rows (DeepGEMM where installed, else torch's block GEMM)."""
    codes, scale, scale_n = _weights(4096, 4096, "block")
    x = torch.randn(64, 4096, device=DEV).to(torch.bfloat16)
    fp8_kernels.fp8_linear(x, codes, scale, scale_n)  # the probe and the compiles, outside capture
    route = fp8_kernels.block_route(64, lambda o: fp8_kernels.library_available(o, torch.device(DEV), x.dtype))
    assert route == ("deep_gemm" if DEEP_GEMM else "torch_block")
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fp8_kernels.fp8_linear(x, codes, scale, scale_n)
    for seed in (1, 2):
        x.copy_(torch.randn(64, 4096, device=DEV, generator=torch.Generator(device=DEV).manual_seed(seed)))
        graph.replay()
        assert torch.equal(out, fp8_kernels.fp8_linear(x, codes, scale, scale_n))


def test_library_fallback_logs_one_line_each(monkeypatch, caplog):
    """Where neither DeepGEMM nor torch's block-scaled GEMM runs, the Triton kernels serve, and one
    line per library says why and what serves instead."""
    def refuse(*args, **kwargs):
        raise RuntimeError("CUBLAS_STATUS_NOT_SUPPORTED")

    def missing():
        raise ModuleNotFoundError("No module named 'deep_gemm'")
    monkeypatch.setattr(fp8_kernels, "_torch_block_call", refuse)
    monkeypatch.setattr(fp8_kernels, "_deep_gemm", missing)
    monkeypatch.setattr(fp8_kernels, "_LIBRARY_OK", {})
    codes, scale, scale_n = _weights(4096, 4096, "block")
    x = torch.randn(64, 4096, device=DEV).to(torch.bfloat16)
    with caplog.at_level(logging.WARNING, logger="specdeploy.engine.kernels.fp8"):
        for _ in range(3):
            got = fp8_kernels.fp8_linear(x, codes, scale, scale_n)
    lines = [r.getMessage() for r in caplog.records if r.name == "specdeploy.engine.kernels.fp8"]
    assert len(lines) == 2, lines
    assert "DeepGEMM" in lines[0] and "No module named 'deep_gemm'" in lines[0] and "route without it serves" in lines[0]
    assert "CUBLAS_STATUS_NOT_SUPPORTED" in lines[1] and "Triton kernels serve" in lines[1]
    _assert_weight_only(got, x, codes, scale, scale_n)  # 64 rows: the weight-only fallback


@pytest.mark.skipif(not DEEP_GEMM, reason="DeepGEMM (deep_gemm) is not installed here")
@pytest.mark.parametrize("n,k", LLAMA_8B)
@pytest.mark.parametrize("m", [m for m in BENCH_ROWS if m > 4] + [5, 8, 17, 100])
def test_deep_gemm_route(n, k, m):
    """Where DeepGEMM is installed, block weights above four rows take it (the probe passes; rows
    not a multiple of 4 padded for its scale loads), agreeing with the dequantized reference as
    the Triton W8A8 kernel does; a bias is one bf16 add after the GEMM's own rounding."""
    assert fp8_kernels.library_available("deep_gemm", torch.device(DEV), torch.bfloat16)
    assert fp8_kernels.block_route(m, lambda o: True) == "deep_gemm"
    codes, scale, scale_n = _weights(n, k, "block")
    x = torch.randn(m, k, device=DEV).to(torch.bfloat16)
    got = fp8_kernels.fp8_linear(x, codes, scale, scale_n)
    assert got.shape == (m, n) and got.is_contiguous()
    _assert_w8a8(got, x, codes, scale, scale_n)
    assert torch.equal(got, fp8_kernels.block_library_linear("deep_gemm", x, codes, scale))
    bias = torch.randn(n, device=DEV).to(torch.bfloat16)
    assert torch.equal(fp8_kernels.block_library_linear("deep_gemm", x, codes, scale, bias), got + bias)


def test_library_gemm_warm_up_runs_every_library_size_once(caplog):
    """The boot-time pass (kernels.fp8.warm_library_gemms): each distinct block-scaled shape once
    at every M its route gives a library that compiles at first use (DeepGEMM), up to the chunk;
    the first call of a new DeepGEMM configuration is a compile, counted; a progress line at
    least at the end. Shapes the library cannot read in place, and duplicates, are skipped."""
    codes, scale, scale_n = _weights(4096, 4096, "block")
    other, other_scale, _ = _weights(640, 4096, "block")  # a second shape
    linears = [(codes, scale, scale_n, False), (codes.clone(), scale, scale_n, False), (other, other_scale, 128, False),
               (codes[:, :384], scale[:, :3], 128, False)]  # a duplicate, and a view the library cannot read
    library = [m for m in range(2, 97)
               if fp8_kernels.block_route(m, lambda o: fp8_kernels.library_available(o, torch.device(DEV),
                                                                                  torch.bfloat16))
               in fp8_kernels.JIT_LIBRARIES]
    with caplog.at_level(logging.INFO, logger="specdeploy.engine.kernels.fp8"):
        stats = fp8_kernels.warm_library_gemms(linears, 96)
    shapes = 2 if library else 0
    assert stats["shapes"] == shapes and stats["calls"] == shapes * len(library)
    if library:
        assert library[0] == 5 and library[-1] == 96  # the small-M kernel keeps 2-4 rows
        assert any("library GEMM warm-up done" in r.getMessage() for r in caplog.records)
    again = fp8_kernels.warm_library_gemms(linears[:1], 96)
    assert again["compiles"] == 0  # everything it needs compiled (or loaded) by the first pass


def test_act_quant_kernel_is_deepseeks():
    """The GPU divides (and takes log2) in fast float32, a few ulps from torch's IEEE results:
    scales within 1e-6 (relative), codes equal but where a value sits on a rounding boundary."""
    x = torch.randn(333, 7168, device=DEV).to(torch.bfloat16) * 5
    for round_scale in (False, True):
        y, s = fp8_kernels.act_quant(x, round_scale)
        want_y, want_s = fp8.act_quant_reference(x, 128, round_scale)
        assert ((s - want_s).abs() <= 1e-6 * want_s).float().mean() > 0.999
        assert (y.view(torch.uint8) != want_y.view(torch.uint8)).float().mean() < 1e-3


def test_attention_over_an_fp8_pool():
    from specdeploy.engine.kernels import attention as attention_triton
    from specdeploy.engine.models.attention import AttnBatch, reference, store_kv
    g = torch.Generator(device=DEV).manual_seed(0)
    slots, b, nq, hq, hkv, d = 4096, 8, 4, 32, 8, 128
    k = store_kv(torch.randn(slots, hkv, d, device=DEV, generator=g) * 4, torch.float8_e4m3fn, 0.05)
    v = store_kv(torch.randn(slots, hkv, d, device=DEV, generator=g), torch.float8_e4m3fn, 0.02)
    q = torch.randn(b, nq, hq, d, device=DEV, generator=g).to(torch.bfloat16)
    lens = torch.randint(0, 1500, (b,), device=DEV, generator=g)
    prefix = torch.randint(1, slots, (b, 1500), device=DEV, generator=g)
    new = torch.randint(1, slots, (b, nq), device=DEV, generator=g)
    mask = torch.ones(b, nq, nq, dtype=torch.bool, device=DEV).tril()
    batch = AttnBatch(new, prefix, lens, new, mask)
    want = reference(q.float(), k, v, batch, d ** -0.5, (0.05, 0.02))
    got = attention_triton.attend(q, k, v, batch, d ** -0.5, kv_scales=(0.05, 0.02)).float()
    assert (got - want).abs().max().item() < 2e-2 * want.abs().max().item()


def _fp8_target(tmp_path, dtype):
    """A small Llama-shaped FP8 block checkpoint (dims multiples of 128: the kernels' tiles)."""
    import json

    from safetensors.torch import save_file

    from specdeploy.engine.demo.toy import predictable_target, tiny_config
    from specdeploy.engine.models.llama import load_target
    cfg = tiny_config(hidden_size=256, num_heads=4, num_kv_heads=2, head_dim=64, vocab_size=64,
                      intermediate_size=512, num_layers=4)
    # layer scales chosen on CPU so that a copied draft is accepted about a third of the time
    # (at 0.5 this 256-wide target is not predictable: 1 of 177 drafts accepted)
    model, perm = predictable_target(cfg, seed=0, layer_scale=0.05)
    state = {("model." + k if not k.startswith("lm_head") else k): v for k, v in model.state_dict().items()}
    fmt = fp8.FP8Format("block", "weight_scale_inv", (128, 128))
    save_file({k: v.contiguous() for k, v in fp8.quantize_state_dict(state, fmt).items()},
              str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(dict(
        model_type="llama", hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, vocab_size=64, rms_norm_eps=cfg.rms_norm_eps,
        rope_theta=cfg.rope_theta, max_position_embeddings=512, torch_dtype="float32",
        quantization_config=fp8.quantization_config(fmt))))
    return load_target(str(tmp_path), dtype=dtype, device=DEV, feature_kind="eagle"), perm


def test_fp8_target_graphs_and_speculation_are_lossless(tmp_path):
    target, perm = _fp8_target(tmp_path, torch.float32)
    assert target.layers[0].mlp.down_proj.weight.dtype == torch.float8_e4m3fn

    def reqs():
        return random_requests((5, 12, 1, 9), 16, 64)

    fp8_kv = torch.float8_e4m3fn
    eager = run_to_completion(Runner(target, max_total_tokens=512, max_running_requests=4, device=DEV,
                                     graph_mode="off", kv_cache_dtype=fp8_kv), reqs())
    graphed = run_to_completion(Runner(target, max_total_tokens=512, max_running_requests=4, device=DEV,
                                       cuda_graph_batch_sizes=(1, 2, 4), kv_cache_dtype=fp8_kv), reqs())
    assert graphed == eager
    draft = copy_draft("EAGLE", target, perm, layer_scale=0.2)
    spec = Runner(target, draft, SpecSettings("EAGLE", 3, 1, 4), max_total_tokens=512, max_running_requests=4,
                  device=DEV, cuda_graph_batch_sizes=(1, 2, 4), kv_cache_dtype=fp8_kv)
    assert run_to_completion(spec, reqs()) == eager
    rate = spec.num_draft_tokens_accepted / spec.num_draft_tokens_proposed
    assert 0.1 < rate < 0.95, rate  # both accepted and rejected drafts were exercised


def test_a_draft_quantized_at_load_graphs_and_stays_lossless(tmp_path):
    """--draft-quantization fp8 on the device: the head's linears run the FP8 kernels inside the
    captured speculative step, and the output is still the target's own (float32, greedy)."""
    target, perm = _fp8_target(tmp_path, torch.float32)

    def reqs():
        return random_requests((5, 12, 1, 9), 16, 64)

    eager = run_to_completion(Runner(target, max_total_tokens=512, max_running_requests=4, device=DEV,
                                     graph_mode="off"), reqs())
    draft = copy_draft("EAGLE", target, perm, layer_scale=0.2)
    assert len(fp8.quantize_draft(draft, "fp8")) == 5
    assert draft.fc.weight.dtype == draft.layers[0].mlp.down_proj.weight.dtype == torch.float8_e4m3fn
    spec = Runner(target, draft, SpecSettings("EAGLE", 3, 1, 4), max_total_tokens=512, max_running_requests=4,
                  device=DEV, cuda_graph_batch_sizes=(1, 2, 4))
    assert run_to_completion(spec, reqs()) == eager
    rate = spec.num_draft_tokens_accepted / spec.num_draft_tokens_proposed
    assert 0.1 < rate < 0.95, rate


def test_boot_warms_the_library_gemms_of_an_fp8_runner(tmp_path, caplog):
    """The server's boot pass over a runner's FP8 block linears (boot._warm_library_gemms): at
    bf16, the tiny target's one library-readable shape at every library size up to the chunk,
    one line at the end; serving after it is what it was before."""
    from specdeploy.engine.serving import boot

    target, _ = _fp8_target(tmp_path, torch.bfloat16)
    runner = Runner(target, max_total_tokens=512, max_running_requests=4, device=DEV, graph_mode="off")
    runner.prefill_chunk_tokens = 64
    before = run_to_completion(runner, random_requests((5, 12), 16, 64))
    with caplog.at_level(logging.INFO, logger="specdeploy.engine.kernels.fp8"):
        boot._warm_library_gemms(runner)
    warmed = [r.getMessage() for r in caplog.records if "library GEMM warm-up" in r.getMessage()]
    library = any(fp8_kernels.library_available(o, torch.device(DEV), torch.bfloat16) for o in fp8_kernels.JIT_LIBRARIES)
    # the down projection (512 -> 256) is the one shape a library reads in place (K of the others is 256)
    readable = [n for w, s, n, _ in fp8.block_scaled_linears(target) if fp8_kernels.torch_block_shape_ok(w, s, n)]
    assert len(readable) == 4
    if library:
        assert warmed and "1 shapes" in warmed[-1] and "done" in warmed[-1], warmed
    assert run_to_completion(runner, random_requests((5, 12), 16, 64)) == before
