"""FP8 checkpoints on CPU: formats from quantization_config, (de)quantization, the FP8 parallel
linears against F.linear over the dequantized weights, whole Llama-family targets loaded from
FP8 block / per-channel / per-tensor checkpoints logit for logit against their dequantized
twins, and speculative decoding on an FP8 target lossless against target-only decoding."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from specdeploy.engine.demo.toy import (
    copy_draft,
    predictable_target,
    random_requests,
    run_to_completion,
    tiny_config,
)
from specdeploy.engine.models import fp8
from specdeploy.engine.models.attention import causal_batch
from specdeploy.engine.models.llama import load_target
from specdeploy.engine.memory.kv import KVPool
from specdeploy.engine.runtime.runner import Runner
from specdeploy.engine.planner.plan import SpecSettings

BLOCK = fp8.FP8Format("block", "weight_scale_inv", (128, 128))
SMALL_BLOCK = fp8.FP8Format("block", "weight_scale_inv", (16, 16))
UE8M0 = fp8.FP8Format("block", "weight_scale_inv", (16, 16), round_scale=True)
CHANNEL = fp8.FP8Format("channel", "weight_scale", ignored_suffixes=(".input_scale",))
TENSOR = fp8.FP8Format("tensor", "weight_scale", ignored_suffixes=(".input_scale",))


def test_formats_from_quantization_config():
    v4 = json.loads((Path(__file__).resolve().parents[2] / "configs/deepseek-v4-flash.json").read_text())
    assert fp8.fp8_format(v4) == fp8.FP8Format("block", "weight_scale_inv", (128, 128), round_scale=True)
    for fmt in (BLOCK, SMALL_BLOCK, CHANNEL, TENSOR):
        assert fp8.fp8_format({"quantization_config": fp8.quantization_config(fmt)}) == fmt
    assert fp8.fp8_format({"torch_dtype": "bfloat16"}) is None
    with pytest.raises(ValueError, match="'awq' is not supported"):
        fp8.fp8_format({"quantization_config": {"quant_method": "awq"}})
    with pytest.raises(ValueError, match="e5m2"):
        fp8.fp8_format({"quantization_config": {"quant_method": "fp8", "fmt": "e5m2"}})


def test_block_quantization_round_trip():
    w = torch.randn(200, 300)
    codes, scale = fp8.quantize_fp8_block(w, (128, 128))
    assert codes.dtype == torch.float8_e4m3fn and scale.shape == (2, 3)
    back = fp8.dequantize_fp8(codes, scale, (128, 128), torch.float32)
    # e4m3 keeps 3 mantissa bits: half a step is 2^-4 of the value, below the subnormals
    assert ((back - w).abs() <= w.abs() * 2**-4 + scale.max() * 2**-9).all()
    # the same through E8M0 scales (float8_e8m0fnu and their raw bits)
    e8m0 = torch.exp2(torch.ceil(torch.log2(scale)))
    assert torch.equal(fp8.dequantize_fp8(codes, e8m0.to(torch.float8_e8m0fnu), (128, 128), torch.float32),
                       fp8.dequantize_fp8(codes, e8m0.to(torch.float8_e8m0fnu).view(torch.uint8), (128, 128),
                                          torch.float32))


def test_fp4_experts_dequantize_every_code():
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.int8).reshape(4, 64)  # every byte
    scale = torch.tensor([[127, 128, 126, 130]] * 4, dtype=torch.uint8)  # 1, 2, 0.5, 8 per 32 inputs
    w = fp8.dequantize_fp4(codes, scale, dtype=torch.float32)
    assert w.shape == (4, 128)
    table = torch.tensor(fp8.E2M1_VALUES)
    b = codes.view(torch.uint8).long()
    want = torch.stack((table[b & 15], table[b >> 4]), -1).reshape(4, 128)
    want = want * torch.tensor([1.0, 2.0, 0.5, 8.0]).repeat_interleave(32)
    assert torch.equal(w, want)
    assert w[0, 2] == 0.5 and w[0, 3] == 0.0  # byte 1: low nibble code 1 (0.5), high nibble 0


def test_act_quant_reference_as_deepseek_defines_it():
    x = torch.randn(3, 300, generator=torch.Generator().manual_seed(0))
    x[1, :128] = 0.0  # an all-zero group takes the floor scale
    y, s = fp8.act_quant_reference(x)
    assert s.shape == (3, 3) and s[1, 0] == pytest.approx(1e-4 / 448)
    assert torch.allclose(s[0, 0], x[0, :128].abs().max() / 448)
    scales = s.repeat_interleave(128, 1)[:, :300]
    back = y.float() * scales
    # e4m3 keeps 3 mantissa bits (half an ulp: 2^-4 of the value), down to its subnormals,
    # spaced 2^-9 of the scale (half of it the largest rounding there)
    assert ((back - x).abs() <= x.abs() * 2**-4 + scales * 2**-10 + 1e-9).all()
    _, s2 = fp8.act_quant_reference(x, round_scale=True)
    assert torch.equal(torch.exp2(torch.log2(s2).round()), s2) and (s2 >= s).all()


def test_fp8_linear_is_f_linear_over_dequantized_weights():
    w, x, b = torch.randn(96, 160), torch.randn(2, 5, 160), torch.randn(96)
    codes, scale = fp8.quantize_fp8_block(w, (32, 64))
    layer = fp8.FP8Linear(codes, scale, (32, 64), bias=b)
    want = torch.nn.functional.linear(x, fp8.dequantize_fp8(codes, scale, (32, 64), torch.float32), b)
    assert torch.equal(layer(x), want)
    codes, scale = fp8.quantize_fp8_channel(w)
    layer = fp8.FP8Linear(codes, scale)
    assert torch.equal(layer(x), torch.nn.functional.linear(x, fp8.dequantize_fp8(codes, scale, dtype=torch.float32)))


# --------------------------------------------------------------------------------------------
# whole targets from FP8 checkpoints


def _config_json(cfg, fmt):
    return dict(model_type="llama", hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
                num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, vocab_size=cfg.vocab_size,
                rms_norm_eps=cfg.rms_norm_eps, rope_theta=cfg.rope_theta, torch_dtype="float32",
                max_position_embeddings=cfg.max_position_embeddings,
                **({"quantization_config": fp8.quantization_config(fmt)} if fmt else {}))


def write_checkpoints(tmp_path, fmt, cfg=None, seed=0):
    """(FP8 checkpoint dir, its dequantized float32 twin dir, perm) of one tiny target."""
    cfg = cfg or tiny_config(intermediate_size=96)
    model, perm = predictable_target(cfg, seed=seed, layer_scale=0.5)
    state = {("model." + k if not k.startswith("lm_head") else k): v for k, v in model.state_dict().items()}
    quantized = fp8.quantize_state_dict(state, fmt)
    twin = {}
    for name, t in quantized.items():
        if name.endswith("." + fmt.scale_name):
            continue
        if t.dtype == torch.float8_e4m3fn:
            scale = quantized[name.removesuffix("weight") + fmt.scale_name]
            t = fp8.dequantize_fp8(t, scale, fmt.block, torch.float32)
        twin[name] = t
    if fmt.scale_name == "weight_scale":  # static schemes ship activation scales the engine ignores
        quantized.update({n.removesuffix("weight_scale") + "input_scale": torch.tensor(1.0)
                          for n in list(quantized) if n.endswith(".weight_scale")})
    q_dir, t_dir = tmp_path / "fp8", tmp_path / "twin"
    for d, tensors, f in ((q_dir, quantized, fmt), (t_dir, twin, None)):
        d.mkdir()
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(d / "model.safetensors"))
        (d / "config.json").write_text(json.dumps(_config_json(cfg, f)))
    return q_dir, t_dir, perm


def logits(model, ids):
    cfg = model.cfg
    kv = KVPool(cfg.num_layers, 64, cfg.num_kv_heads, cfg.head_dim, torch.float32, "cpu")
    q = ids.shape[1]
    batch = causal_batch(torch.arange(1, q + 1)[None], torch.tensor([q]),
                         torch.zeros(1, 0, dtype=torch.int64), torch.tensor([0]))
    with torch.no_grad():
        return model.logits(model(ids, torch.arange(q)[None], batch, kv).hidden)


@pytest.mark.parametrize("fmt", [BLOCK, SMALL_BLOCK, UE8M0, CHANNEL, TENSOR], ids=["block128", "block16", "ue8m0",
                                                                                  "channel", "tensor"])
def test_fp8_target_equals_its_dequantized_twin(tmp_path, fmt):
    q_dir, t_dir, _ = write_checkpoints(tmp_path, fmt)
    quantized = load_target(str(q_dir), dtype=torch.float32)
    twin = load_target(str(t_dir), dtype=torch.float32)
    attn, mlp = quantized.layers[0].self_attn, quantized.layers[0].mlp
    for layer in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
        assert isinstance(layer, fp8._FP8Parallel) and layer.weight.dtype == torch.float8_e4m3fn
    # fused q/k/v (32, 16, 16 rows): 128-row blocks cut across parts, so one scale row per row
    assert attn.qkv_proj.scale_n == (16 if fmt.block == (16, 16) and fmt.scheme == "block" else 1)
    assert quantized.lm_head.weight.dtype == quantized.embed_tokens.weight.dtype == torch.float32
    ids = torch.randint(0, 64, (1, 11), generator=torch.Generator().manual_seed(1))
    assert torch.equal(logits(quantized, ids), logits(twin, ids))


def test_a_partly_quantized_fused_layer_is_refused(tmp_path):
    q_dir, _, _ = write_checkpoints(tmp_path, SMALL_BLOCK)
    from safetensors.torch import load_file
    tensors = load_file(str(q_dir / "model.safetensors"))
    name = "model.layers.0.self_attn.k_proj"
    tensors[f"{name}.weight"] = fp8.dequantize_fp8(tensors[f"{name}.weight"], tensors.pop(f"{name}.weight_scale_inv"),
                                                   (16, 16), torch.float32)
    save_file(tensors, str(q_dir / "model.safetensors"))
    with pytest.raises(ValueError, match="only some are FP8"):
        load_target(str(q_dir), dtype=torch.float32)


@pytest.mark.parametrize("algorithm,topk,n", [("EAGLE", 1, 4), ("EAGLE", 2, 5), ("EAGLE3", 1, 4), ("MTP", 1, 4)])
def test_speculative_on_an_fp8_target_is_lossless(tmp_path, algorithm, topk, n):
    q_dir, _, perm = write_checkpoints(tmp_path, BLOCK, tiny_config())
    target = load_target(str(q_dir), dtype=torch.float32, feature_kind=algorithm.lower())

    def reqs():
        return random_requests((5, 12, 1, 9), 20, 64)

    plain = run_to_completion(Runner(target, max_total_tokens=400, max_running_requests=4), reqs())
    draft = copy_draft(algorithm, target, perm)
    runner = Runner(target, draft, SpecSettings(algorithm, 3, topk, n), max_total_tokens=400, max_running_requests=4)
    assert run_to_completion(runner, reqs()) == plain
    rate = runner.num_draft_tokens_accepted / runner.num_draft_tokens_proposed
    assert 0.1 < rate < 0.95, f"acceptance rate {rate:.2f}: the test would not see both outcomes"


# --------------------------------------------------------------------------------------------
# FP8 KV cache


def test_fp8_kv_rows_and_the_reference_read():
    from specdeploy.engine.models.attention import AttnBatch, reference, store_kv

    x = torch.tensor([[0.1, -3.0, 1000.0, 2.5]])
    codes = store_kv(x, torch.float8_e4m3fn, 0.5)
    assert codes.dtype == torch.float8_e4m3fn
    assert codes.float().tolist() == [[0.203125, -6.0, 448.0, 5.0]]  # x / 0.5, saturated at 448
    k = store_kv(torch.randn(20, 2, 8), torch.float8_e4m3fn, 0.25)
    v = store_kv(torch.randn(20, 2, 8), torch.float8_e4m3fn, 0.5)
    q = torch.randn(1, 3, 4, 8)
    batch = AttnBatch(torch.tensor([[5, 6, 7]]), torch.tensor([[1, 2, 3, 4]]), torch.tensor([4]),
                      torch.tensor([[5, 6, 7]]), torch.ones(1, 3, 3, dtype=torch.bool).tril())
    got = reference(q, k, v, batch, 0.3, (0.25, 0.5))
    assert torch.equal(got, reference(q, k.float() * 0.25, v.float() * 0.5, batch, 0.3))


def test_checkpoint_kv_scales_reach_the_attention(tmp_path):
    q_dir, _, _ = write_checkpoints(tmp_path, CHANNEL)
    from safetensors.torch import load_file
    tensors = load_file(str(q_dir / "model.safetensors"))
    tensors["model.layers.1.self_attn.k_scale"] = torch.tensor(0.5)
    tensors["model.layers.1.self_attn.v_scale"] = torch.tensor([0.25])
    save_file(tensors, str(q_dir / "model.safetensors"))
    model = load_target(str(q_dir), dtype=torch.float32)
    assert model.layers[1].self_attn.kv_scales == (0.5, 0.25)
    assert model.layers[0].self_attn.kv_scales == (1.0, 1.0)


@pytest.mark.parametrize("algorithm,topk,n", [("EAGLE", 1, 4), ("EAGLE", 2, 5)])
def test_speculative_over_an_fp8_kv_cache_is_lossless(tmp_path, algorithm, topk, n):
    """FP8 weights and an FP8 KV pool: speculative decoding equals target-only decoding over the
    same pool dtype, and the pool really is e4m3 (one byte per element)."""
    q_dir, _, perm = write_checkpoints(tmp_path, BLOCK, tiny_config())
    target = load_target(str(q_dir), dtype=torch.float32, feature_kind=algorithm.lower())

    def reqs():
        return random_requests((5, 12, 1, 9), 20, 64)

    fp8_kv = torch.float8_e4m3fn
    plain_runner = Runner(target, max_total_tokens=400, max_running_requests=4, kv_cache_dtype=fp8_kv)
    assert plain_runner.target_kv.k.dtype == fp8_kv and plain_runner.target_kv.k.element_size() == 1
    plain = run_to_completion(plain_runner, reqs())
    draft = copy_draft(algorithm, target, perm)
    runner = Runner(target, draft, SpecSettings(algorithm, 3, topk, n), max_total_tokens=400, max_running_requests=4,
                    kv_cache_dtype=fp8_kv)
    assert runner.draft_kv.k.dtype == fp8_kv
    assert run_to_completion(runner, reqs()) == plain
    rate = runner.num_draft_tokens_accepted / runner.num_draft_tokens_proposed
    assert 0.1 < rate < 0.95, f"acceptance rate {rate:.2f}"


@pytest.mark.parametrize("fmt", [BLOCK, SMALL_BLOCK, CHANNEL], ids=["block128", "block16", "channel"])
def test_quantizing_a_built_model_equals_loading_its_fp8_checkpoint(tmp_path, fmt):
    """quantize_model_linears (benchmarks: FP8 against bf16 on the same weights) builds the same
    layers as loading the FP8 checkpoint of those weights."""
    q_dir, _, _ = write_checkpoints(tmp_path, fmt)
    loaded = load_target(str(q_dir), dtype=torch.float32)
    model, _ = predictable_target(tiny_config(intermediate_size=96), seed=0, layer_scale=0.5)
    converted = fp8.quantize_model_linears(model, fmt)
    assert len(converted) == 4 * model.cfg.num_layers and "lm_head" not in converted
    ids = torch.randint(0, 64, (1, 7), generator=torch.Generator().manual_seed(2))
    assert torch.equal(logits(model, ids), logits(loaded, ids))


@pytest.mark.parametrize("fmt", [BLOCK, CHANNEL], ids=["block128", "channel"])
def test_block_scaled_linears_names_every_block_linear(tmp_path, fmt):
    """What the boot-time library GEMM warm-up compiles for: every FP8 linear with a block grid
    (the target's four a layer; none for per-channel scales), with its codes and grid."""
    q_dir, _, _ = write_checkpoints(tmp_path, fmt)
    loaded = load_target(str(q_dir), dtype=torch.float32)
    found = fp8.block_scaled_linears(loaded, None)
    if fmt.scheme != "block":
        assert found == []
        return
    assert len(found) == 4 * loaded.cfg.num_layers
    for weight, scale, scale_n, round_scale in found:
        # fused parts whose boundaries cut a 128-row block keep a scale per row (scale_n 1):
        # the warm-up's shape check leaves those to the project's kernels
        assert weight.dtype == torch.float8_e4m3fn and scale.dim() == 2 and scale_n in (1, fmt.block[0])
        assert round_scale is False
