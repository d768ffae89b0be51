"""GPU checks of the FP8 small-M tensor-core kernel (engine/kernels/fp8_mma.py, CUDA C++ built by
NVRTC) at the Llama-3.1-8B layer shapes and the corners of its launch space:

- every row count 1-8 against a float32 matmul of the dequantized weights, element-wise within the
  bf16 output rounding (2^-8 of the value) plus accumulation-order error (2^-10 of the row's
  largest): the weight-only bound the Triton fma loop is held to; fresh random inputs, the
  output poisoned with NaN first, so an unwritten element fails;
- each launch family (16 / 32-row CTAs, 128-512 k steps, 4 / 8 warps, one or two weight buffers,
  split-K 1 / 2 / 4 meeting in gemv's workspace, whose counters must be back at zero), f16 and
  bf16 x, a bias, per-channel and per-tensor scales, a ragged N, x rows with a stride, groups of
  x a million times smaller and a thousand times larger than the rest;
- a chain of launches each reading the previous one's output, with programmatic dependent launch
  and the first weight loads before the wait, eager and as a CUDA graph replayed with new inputs;
- the engine's route (gemv.config_for) taking it where the table says "mma", and falling back to
  the Triton launch for float32 x and more than 8 rows.
"""

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
if torch.cuda.get_device_capability() < (8, 9):
    pytest.skip("the e4m3 conversion needs compute capability 8.9 or later", allow_module_level=True)

import torch.nn.functional as F  # noqa: E402

from specdeploy.engine.kernels import fp8_mma, gemv, launch  # noqa: E402
from specdeploy.engine.models import fp8  # noqa: E402

DEV = "cuda"
LLAMA_8B = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336),
            (32000, 4096)]  # the 8B EAGLE-3 head's own lm_head (--draft-quantization fp8)


def _weights(n, k, scheme="block", seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    w = torch.randn(n, k, device=DEV, generator=g) * 0.02
    if scheme == "block":
        codes, scale = fp8.quantize_fp8_block(w, (128, 128))
        return codes, scale, 128, fp8.dequantize_fp8(codes, scale, (128, 128), torch.float32)
    amax = w.abs().amax(1) if scheme == "channel" else w.abs().amax().reshape(1)
    scale = (amax / 448.0).float()
    codes = (w / (scale[:, None] if scheme == "channel" else scale)).to(torch.float8_e4m3fn)
    return codes, scale, 1, codes.float() * (scale[:, None] if scheme == "channel" else scale)


def _x(m, k, dtype=torch.bfloat16, seed=1):
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(m, k, device=DEV, generator=g) * 3
    x[0, 128:256] *= 1e-6
    x[-1, :128] *= 1e3
    return x.to(dtype)


def _within(got, want):
    assert not got.isnan().any()
    err = (got.float() - want).abs()
    bound = want.abs() * 2**-8 + want.abs().amax(-1, keepdim=True) * 2**-10
    assert (err <= bound).all(), (err - bound).max().item()


def _run(x, codes, scale, scale_n, cfg, bias=None):
    out = torch.full((x.shape[0], codes.shape[0]), float("nan"), device=DEV, dtype=x.dtype)
    gemv.launch(x, codes, scale, scale_n, bias, out, *cfg)
    return out


def _counters_zero():
    return all(int(c.abs().sum()) == 0 for _, c in gemv._WORKSPACES.values())


def test_the_kernel_is_available_here():
    assert fp8_mma.available(torch.device(DEV))


@pytest.mark.parametrize("n,k", LLAMA_8B)
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 8])
def test_every_row_count_at_the_llama_shapes(n, k, m):
    codes, scale, scale_n, wd = _weights(n, k)
    x = _x(m, k)
    cfg = gemv.heuristic_config("fp8", n, k, m, gemv._sms(torch.device(DEV)), mma=True)
    assert cfg[0] == "mma"
    _within(_run(x, codes, scale, scale_n, cfg), F.linear(x.float(), wd))
    assert _counters_zero()


@pytest.mark.parametrize("cfg", [("mma", 16, 256, 1, 8, 2), ("mma", 16, 256, 2, 4, 2), ("mma", 16, 128, 4, 8, 2),
                                 ("mma", 16, 512, 1, 8, 1), ("mma", 32, 256, 2, 8, 1), ("mma", 32, 256, 1, 4, 1),
                                 ("mma", 16, 512, 2, 4, 2), ("mma", 32, 128, 4, 2, 2), ("mma", 16, 256, 8, 1, 1)])
@pytest.mark.parametrize("m", [1, 4, 8])
def test_launch_families(cfg, m):
    n, k = 4096, 14336
    codes, scale, scale_n, wd = _weights(n, k, seed=2)
    x = _x(m, k, seed=3)
    _within(_run(x, codes, scale, scale_n, cfg), F.linear(x.float(), wd))
    assert _counters_zero()


@pytest.mark.parametrize("scheme", ["block", "channel", "tensor"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("split", [1, 2])
def test_scales_dtypes_bias(scheme, dtype, split):
    n, k = 6144, 4096
    codes, scale, scale_n, wd = _weights(n, k, scheme, seed=4)
    x = _x(3, k, dtype, seed=5) / (1 if dtype == torch.bfloat16 else 64)  # within f16's range after the product
    bias = torch.randn(n, device=DEV).to(dtype)
    got = _run(x, codes, scale, scale_n, ("mma", 16, 256, split, 8, 2), bias)
    _within(got, F.linear(x.float(), wd, bias.float()))
    assert _counters_zero()


def test_ragged_n_and_strided_x():
    n, k = 4104, 4096  # 256 full 16-row tiles and one of 8 rows
    codes, scale, scale_n, wd = _weights(n, k, seed=6)
    wide = _x(5, k + 512, seed=7)
    x = wide[:, 256:256 + k]  # rows 2 x (k + 512) bytes apart, 16-byte aligned
    assert fp8_mma.supports(x, codes, scale, scale_n, torch.empty(5, n, device=DEV, dtype=x.dtype))
    for cfg in [("mma", 16, 256, 1, 8, 2), ("mma", 32, 256, 2, 4, 1)]:
        _within(_run(x, codes, scale, scale_n, cfg), F.linear(x.float(), wd))
    assert _counters_zero()


def _chain(xs, layers, outs):
    h = xs
    for (codes, scale), out in zip(layers, outs):
        gemv.launch(h, codes, scale, 128, None, out, "mma", 16, 256, 2, 8, 2)
        h = out
    return h


@pytest.mark.parametrize("pdl", ["1", "0"])
def test_chained_launches_eager_and_graphed(monkeypatch, pdl):
    """Each launch reads the previous one's output: under PDL the weight loads may start before
    the wait, x must not. Eager, then a graph replayed three times with new inputs copied in."""
    monkeypatch.setenv("SPECDEPLOY_PDL", pdl)
    launch.reset()
    try:
        k = 4096
        layers, dense = [], []
        for i in range(6):
            codes, scale, _, wd = _weights(k, k, seed=10 + i)
            layers.append((codes, scale))
            dense.append(wd)
        xs = _x(4, k, seed=20)
        outs = [torch.empty(4, k, device=DEV, dtype=torch.bfloat16) for _ in layers]
        # eager: each output against the float32 product over the previous launch's bf16 output
        h = xs
        for (codes, scale), out, wd in zip(layers, outs, dense):
            gemv.launch(h, codes, scale, 128, None, out, "mma", 16, 256, 2, 8, 2)
            _within(out, F.linear(h.float(), wd))
            h = out
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            _chain(xs, layers, outs)
        for seed in (30, 31, 32):
            xs.copy_(_x(4, k, seed=seed))
            graph.replay()
            got = outs[-1].clone()
            eager = [torch.empty_like(o) for o in outs]
            _chain(xs, layers, eager)
            assert torch.equal(got, eager[-1])
        assert _counters_zero()
    finally:
        launch.reset()


def test_the_route_takes_it_and_falls_back():
    n, k = 4096, 4096
    codes, scale, scale_n, wd = _weights(n, k, seed=40)
    dev = torch.device(DEV)
    for m in (1, 4, 8):
        assert gemv.config_for("fp8", n, k, m, dev)[0] == "mma" or ("mma", n, k, gemv.m_bucket(m)) not in gemv.GEMV_TABLE
        x = _x(m, k, seed=41)
        got = gemv.fp8_linear(x, codes, scale, scale_n)
        _within(got, F.linear(x.float(), wd))
    assert gemv.config_for("fp8", n, k, 16, dev)[0] != "mma"
    # float32 x, 9+ rows, a float32 bias: not the kernel's calls; a forced "mma" launch runs the Triton one
    for x, bias in ((_x(2, k).float(), None), (_x(12, k), None), (_x(3, k), torch.randn(n, device=DEV))):
        got = gemv.fp8_linear(x, codes, scale, scale_n, bias, config=("mma", 16, 256, 1, 8, 2))
        triton_cfg = gemv.config_for("fp8", n, k, x.shape[0], dev, mma=False)
        assert triton_cfg[0] != "mma"
        assert torch.equal(got, gemv.fp8_linear(x, codes, scale, scale_n, bias, config=triton_cfg))


def test_the_switch_turns_it_off(monkeypatch):
    dev = torch.device(DEV)
    monkeypatch.setenv(fp8_mma.SWITCH_ENV, "0")
    fp8_mma.reset()
    try:
        assert not fp8_mma.available(dev)
        assert gemv.config_for("fp8", 4096, 4096, 1, dev)[0] != "mma"
    finally:
        monkeypatch.delenv(fp8_mma.SWITCH_ENV)
        fp8_mma.reset()
    assert fp8_mma.available(dev)
