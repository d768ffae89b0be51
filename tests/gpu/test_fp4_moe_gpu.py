"""The fused FP4 MoE GEMM (engine/kernels/fp4_moe.py) on the GPU at DeepSeek-V4-Flash's routed
expert shapes (256 experts, gate/up [4096, 4096], down [4096, 2048], 6 per token, swiglu_limit
10): batches 1 .. 64 through _Experts.forward (its tile map by fp4_moe.gathered_map) against a
float32 reference on the dequantized weights, every config of the sweep, and inside a CUDA graph.

Tolerance (as tests/engine/kernels/test_fp4_moe_interpreted.py): exact bf16 products summed in
float32, the activation and each weighted row rounded once to bf16, so
|got - want| <= 2^-6 (|want| + sum over the rows of |a| @ |W_down|^T)."""

import json
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
pytest.importorskip("triton")

import specdeploy.engine.models.deepseek_v4 as v4mod  # noqa: E402
from specdeploy.engine.kernels import fp4_moe  # noqa: E402
from specdeploy.engine.models.deepseek_v4 import V4ModelConfig, _Experts  # noqa: E402
from specdeploy.engine.models.fp8 import E2M1_VALUES, dequantize_fp4  # noqa: E402

DEV = "cuda"
FLASH = Path(__file__).resolve().parents[2] / "manifests" / "models" / "deepseek-v4-flash" / "config.json"


@pytest.fixture(scope="module")
def flash_experts():
    c = json.loads(FLASH.read_text())
    c.pop("quantization_config", None)
    cfg = V4ModelConfig.from_hf(c)
    with torch.device("meta"):
        m = _Experts(cfg).to(torch.bfloat16)
        m.quantize("fp4")
    m = m.to_empty(device=DEV)
    m.e2m1_pairs.copy_(torch.tensor([(E2M1_VALUES[b & 0xF], E2M1_VALUES[b >> 4]) for b in range(256)]))
    gen = torch.Generator(device=DEV).manual_seed(0)
    for name in ("gate_up_proj", "down_proj"):
        getattr(m, name).random_(-128, 128, generator=gen)
        getattr(m, name + "_scale").random_(118, 124, generator=gen)
    return cfg, m


def routing(cfg, batch: int, seed: int):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    x = (torch.randn(batch, cfg.hidden_size, device=DEV, generator=gen) * 2).to(torch.bfloat16)
    idx = torch.rand(batch, cfg.num_experts, device=DEV, generator=gen).topk(cfg.num_experts_per_tok, -1).indices
    w = torch.rand(batch, cfg.num_experts_per_tok, device=DEV, generator=gen).to(torch.bfloat16)
    return x, idx, w


def reference(m: _Experts, x, idx, w):
    """(want, bound) [T, H] in float32, one expert's dequantized weights at a time."""
    t, k = idx.shape
    flat = idx.reshape(-1)
    xr = x.float()[torch.arange(t * k, device=DEV) // k]
    want = torch.zeros(t * k, x.shape[1], device=DEV)
    bound = torch.zeros_like(want)
    for e in flat.unique().tolist():
        rows = (flat == e).nonzero()[:, 0]
        up = dequantize_fp4(m.gate_up_proj[e], m.gate_up_proj_scale[e], dtype=torch.float32)
        down = dequantize_fp4(m.down_proj[e], m.down_proj_scale[e], dtype=torch.float32)
        gate, upv = (xr[rows] @ up.T).chunk(2, dim=-1)
        a = (torch.nn.functional.silu(gate.clamp(max=m.limit)) * upv.clamp(-m.limit, m.limit)).bfloat16().float()
        rw = w.reshape(-1)[rows].float()[:, None]
        want[rows] = (a @ down.T) * rw
        bound[rows] = (a.abs() @ down.abs().T) * rw
    return want.view(t, k, -1).sum(1), bound.view(t, k, -1).sum(1)


def assert_close(got, want, bound):
    err = (got.float() - want).abs()
    tol = 2**-6 * (want.abs() + bound)
    assert bool((err <= tol).all()), float((err / tol).max())


@pytest.mark.parametrize("batch", [1, 2, 4, 8, 13, 16, 32, 43, 64])
def test_fp4_experts_match_the_dequantized_reference(flash_experts, batch):
    cfg, m = flash_experts
    x, idx, w = routing(cfg, batch, seed=batch)
    want, bound = reference(m, x, idx, w)
    with torch.no_grad():
        assert m._fused_fp4(x) is not None
        assert_close(m(x, idx, w), want, bound)
        for gathered in (True, False):  # both tile maps at every batch
            got = fp4_moe.fp4_moe(x, idx, w, (m.gate_up_proj, m.gate_up_proj_scale),
                                  (m.down_proj, m.down_proj_scale), limit=m.limit, gathered=gathered)
            assert_close(got, want, bound)


@pytest.mark.parametrize("config", sorted(fp4_moe.CONFIGS))
def test_every_config_matches_the_reference(flash_experts, config):
    cfg, m = flash_experts
    x, idx, w = routing(cfg, 11, seed=99)
    want, bound = reference(m, x, idx, w)
    for gathered in (True, False):
        got = fp4_moe.fp4_moe(x, idx, w, (m.gate_up_proj, m.gate_up_proj_scale), (m.down_proj, m.down_proj_scale),
                              limit=m.limit, gathered=gathered, configs=(config, config))
        assert_close(got, want, bound)


@pytest.mark.parametrize("batch", [1, 16, 64])
def test_fp4_experts_in_a_cuda_graph(flash_experts, batch):
    """Captured (no host sync: a sync would fail the capture) and replayed on new inputs."""
    cfg, m = flash_experts
    x, idx, w = routing(cfg, batch, seed=7)
    with torch.no_grad():
        m(x, idx, w)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = m(x, idx, w)
        for seed in (8, 9):
            x2, idx2, w2 = routing(cfg, batch, seed=seed)
            x.copy_(x2), idx.copy_(idx2), w.copy_(w2)
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, m(x2, idx2, w2))  # the eager call, same kernels (the combine is deterministic)
            assert_close(out, *reference(m, x2, idx2, w2))


def test_fp4_experts_off_the_kernel_agree(flash_experts):
    """The dequantizing path (FP4_FUSED_MOE off) and the fused kernel: the same sums."""
    cfg, m = flash_experts
    x, idx, w = routing(cfg, 4, seed=5)
    want, bound = reference(m, x, idx, w)
    saved = v4mod.FP4_FUSED_MOE
    v4mod.FP4_FUSED_MOE = False
    try:
        with torch.no_grad():
            old = m(x, idx, w)
    finally:
        v4mod.FP4_FUSED_MOE = saved
    assert_close(old, want, 4 * bound)  # the old path rounds gate/up and the product in bf16 too
