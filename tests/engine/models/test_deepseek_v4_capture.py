"""DeepSeek-V4's captured calls can be captured: no host sync, no CPU tensor, fixed shapes.

A CUDA graph capture fails on a device-to-host read (`.item()`, `.tolist()`, `nonzero`, a boolean
mask index, torch's grouped_mm off its bf16 fast path copying its offsets to the host) and on a
tensor made on the host and copied in. These tests run every call the graphs capture (target
decode, with and without the feature; the whole speculative step, greedy and sampling, chain and
tree: draft multi-step, verify, draft extend) on the "meta" device, where no tensor has data, so
anything that needs a value on the host fails, under a dispatch mode that also refuses CPU
tensors and the ops that sync on CUDA. Both expert paths a capture takes run (bf16 grouped GEMM
with the H200's fast-path answer, gathered for float32), for bf16 / FP4 / FP8 experts, at small
batches and at a batch whose shapes take the long-chunk branches outside a capture. What this
cannot see: the Triton kernels (meta is not CUDA; they are launched, never read back).

On CPU with numbers, every expert path equals a per-token reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from host_sync import HostSync, NoHostSync
from v4_tiny import TINY

import specdeploy.engine.models.deepseek_v4 as v4mod
from specdeploy.engine.models.deepseek_v4 import V4ModelConfig, build_mtp, build_target, expert_path
from specdeploy.engine.runtime.calls import ModelCalls

# one layer of each attention kind (hash-routed first), few Sinkhorn steps: the meta device
# dispatches in Python, so every op counts
CONFIG = {**TINY, "vocab_size": 12, "moe_intermediate_size": 32, "num_hidden_layers": 3, "hc_sinkhorn_iters": 2,
          "layer_types": TINY["layer_types"][:3], "mlp_layer_types": TINY["mlp_layer_types"][:3]}


def _h200_fast_path(device, dtype):
    return dtype == torch.bfloat16  # what grouped_mm_without_sync answers on an H200


@pytest.fixture
def as_on_h200(monkeypatch):
    monkeypatch.setattr(v4mod, "grouped_mm_without_sync", _h200_fast_path)


def quantize_experts(model, kind: str, block=(128, 128)) -> None:
    for m in model.modules():
        if isinstance(m, v4mod._Experts):
            m.quantize(kind, block)


def meta_calls(dtype, quant, steps, topk, n):
    cfg = V4ModelConfig.from_hf(CONFIG)
    target = build_target(cfg, dtype, "meta", "mtp")
    draft = build_mtp(target, dtype, "meta")
    if quant:
        quantize_experts(target, quant)
        quantize_experts(draft, quant)
    slots = 1024
    tkv = target.make_kv(slots, slots - 8, 64, slots, dtype, "meta")
    dkv = draft.make_kv(slots, slots - 8, 64, slots, dtype, "meta")
    return cfg, ModelCalls(target, draft, tkv, dkv, steps, topk, n)


def run_captured_calls(cfg, calls, b: int, ctx: int = 40):
    """Every call the graphs capture, at batch b, under NoHostSync."""
    steps, k, n = calls.num_steps, calls.topk, calls.num_draft_tokens
    dtype = calls.target.embed_tokens.weight.dtype
    i64, f32 = dict(dtype=torch.int64, device="meta"), dict(dtype=torch.float32, device="meta")

    def z(*shape):
        return torch.zeros(*shape, **i64)

    hidden = torch.zeros(b * k, cfg.spec_hidden_size, dtype=dtype, device="meta")
    sampling = (torch.ones(b, **f32), z(b), torch.ones(b, **f32), torch.full((b, n + 1 + steps), 0.5, **f32))
    with torch.no_grad(), NoHostSync():
        logits = calls.target_decode(z(b, 1), z(b, 1), z(b, 1), z(b, ctx), z(b))
        _, feature = calls.target_decode_feature(z(b, 1), z(b, 1), z(b, 1), z(b, ctx), z(b))
        outs = [calls.spec_step(z(b), z(b), z(b, ctx), hidden, z(b, (steps - 1) * k), z(b, n), *sampling,
                                sampling=s) for s in (False, True)]
    assert logits.shape == (b, cfg.vocab_size) and feature.shape == (b, cfg.spec_hidden_size)
    for num_acc, bonus, path_tokens, path_slots, positions, to_free, draft_hidden in outs:
        assert num_acc.shape == bonus.shape == (b,) and to_free.shape == (b, n)
        assert path_tokens.shape == path_slots.shape == positions.shape == (b, steps + 1)
        assert draft_hidden.shape == (b, cfg.spec_hidden_size)


@pytest.mark.parametrize("dtype,quant,steps,topk,n", [
    (torch.bfloat16, None, 2, 3, 7), (torch.bfloat16, "fp4", 2, 3, 7), (torch.bfloat16, "fp8", 2, 3, 7),
    (torch.float32, None, 2, 3, 7), (torch.float32, "fp4", 2, 3, 7),
    (torch.bfloat16, None, 3, 1, 4), (torch.float32, None, 3, 1, 4)],
    ids=["bf16-tree2x3", "bf16-fp4-tree2x3", "bf16-fp8-tree2x3", "fp32-tree2x3", "fp32-fp4-tree2x3",
         "bf16-chain3", "fp32-chain3"])
def test_captured_calls_need_no_host(as_on_h200, monkeypatch, dtype, quant, steps, topk, n):
    """Batch 2: decode rows (2 x 2) below the 5 experts, verify rows (2 x 7 x 2) above them, so
    quantized experts take both of their capture paths (gathered, grouped in chunks)."""
    monkeypatch.setattr(v4mod, "capturing", lambda t: True)  # the choices a capture makes
    monkeypatch.setattr(v4mod, "EXPERT_DEQUANT_CHUNK", 2)
    cfg, calls = meta_calls(dtype, quant, steps, topk, n)
    run_captured_calls(cfg, calls, b=2)


def test_the_check_sees_a_host_sync(monkeypatch):
    """The check is not vacuous: the eager paths' host syncs (the expert bounds read back, the
    compressor's nonzero over closing queries) fail it."""
    cfg, calls = meta_calls(torch.float32, None, 3, 1, 4)
    monkeypatch.setattr(v4mod, "EXPERT_PATH", "chunked")
    with pytest.raises(HostSync, match="to the host"):
        run_captured_calls(cfg, calls, b=2)
    monkeypatch.setattr(v4mod, "EXPERT_PATH", "gathered")
    with pytest.raises(HostSync, match="nonzero|boolean"):
        run_captured_calls(cfg, calls, b=40)  # 40 x 4 verify queries > 64, outside a capture
    monkeypatch.setattr(v4mod, "EXPERT_PATH", "grouped")  # float32 grouped_mm: the failure on the H200
    with pytest.raises(HostSync, match="grouped_mm"):
        run_captured_calls(cfg, calls, b=2)


def test_expert_path_choice():
    e = 256
    # bf16 on the fast path: one grouped GEMM over the layer's experts, whatever the rows
    assert {expert_path(r, e, False, True, c) for r in (1, 6000) for c in (False, True)} == {"grouped"}
    # quantized, fewer rows than experts (decode): dequantize the rows' experts only
    assert expert_path(96, e, True, True, True) == expert_path(96, e, True, False, False) == "gathered"
    # quantized, more rows: grouped in expert chunks when captured, chunked eagerly (prefill)
    assert expert_path(384, e, True, True, True) == "grouped"
    assert expert_path(49152, e, True, True, False) == "chunked"
    # off the fast path (float32, other GPUs, CPU): never grouped_mm inside a capture
    assert expert_path(384, e, False, False, True) == "gathered"
    assert expert_path(v4mod.GATHERED_MAX_ROWS, e, False, False, False) == "gathered"
    assert expert_path(v4mod.GATHERED_MAX_ROWS + 1, e, False, False, False) == "chunked"
    assert not v4mod.grouped_mm_without_sync(torch.device("cpu"), torch.bfloat16)


# ---------------------------------------------------------------------------------------------
# the paths compute the same sums (CPU, float32)


def _random_codes(experts, kind: str, g) -> None:
    with torch.no_grad():
        for name in ("gate_up_proj", "down_proj"):
            codes, scale = getattr(experts, name), getattr(experts, name + "_scale")
            if kind == "fp4":
                codes.copy_(torch.randint(-128, 128, codes.shape, generator=g, dtype=torch.int8))
                scale.copy_(torch.randint(122, 129, scale.shape, generator=g, dtype=torch.uint8))
            else:
                codes.copy_((torch.randn(codes.shape, generator=g) * 40).clamp(-448, 448).to(codes.dtype))
                scale.copy_(0.01 * torch.rand(scale.shape, generator=g) + 1e-3)


def _reference(experts, x, idx, w):
    """Token by token, expert by expert (the checkpoint's per-expert weights)."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(idx.shape[1]):
            e = int(idx[t, j])
            h = experts._act(F.linear(x[t], experts.weight("gate_up_proj", e, x.dtype)))
            out[t] += w[t, j] * F.linear(h, experts.weight("down_proj", e, x.dtype))
    return out


@pytest.mark.parametrize("quant,block", [(None, None), ("fp4", None), ("fp8", (16, 16)), ("fp8", (128, 128))],
                         ids=["bf16-layout", "fp4", "fp8-16", "fp8-128"])
@pytest.mark.parametrize("tokens", [2, 13])  # rows below and above the 5 experts
def test_every_expert_path_computes_the_same(monkeypatch, quant, block, tokens):
    cfg = V4ModelConfig.from_hf(CONFIG)
    g = torch.Generator().manual_seed(7)
    experts = v4mod._Experts(cfg).float()
    with torch.no_grad():
        for p in (experts.gate_up_proj, experts.down_proj):
            p.copy_(0.3 * torch.randn(p.shape, generator=g))
    if quant:
        experts.quantize(quant, block)
        _random_codes(experts, quant, g)
    x = torch.randn(tokens, cfg.hidden_size, generator=g)
    idx = torch.stack([torch.randperm(cfg.num_experts, generator=g)[:cfg.num_experts_per_tok] for _ in range(tokens)])
    w = torch.rand(tokens, cfg.num_experts_per_tok, generator=g)
    want = _reference(experts, x, idx, w)
    monkeypatch.setattr(v4mod, "EXPERT_DEQUANT_CHUNK", 2)  # chunks of 2, 2, 1 experts; rows likewise
    for fast in (False, True):  # grouped_mm inside the chunked path, or a matmul per expert
        monkeypatch.setattr(v4mod, "grouped_mm_without_sync", lambda d, t, fast=fast: fast)
        for path in ("gathered", "grouped", "chunked"):
            monkeypatch.setattr(v4mod, "EXPERT_PATH", path)
            with torch.no_grad():
                got = experts(x, idx, w)
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=lambda m: f"{path} fast={fast}: {m}")
