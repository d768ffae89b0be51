"""GPU checks of the linears' prologues (engine.kernels.Prologue): at one row, the residual add +
RMSNorm before the q/k/v and gate/up projections and the SwiGLU before the down projection are
computed by the small-M linear itself (the CUDA mma kernel for FP8 block codes, the Triton fma
loop for bf16 weights), not by kernels of their own.

- At the Llama-3.1-8B shapes, with the launch the engine's table gives each: the launch takes
  the prologue; the residual sum it writes equals the add's, bit for bit; the output is within
  the bf16 output rounding (2^-8 of the value, 2^-10 of the row's largest) of a float32 product
  over the exactly normed (or SwiGLU'd) input, as the separate kernels' result is.
- CUDA-graph replays of fused launches equal eager calls.
- A model's greedy decoding at one row is the same token for token with the prologues inside the
  linears and with them as kernels of their own (SPECDEPLOY_PROLOGUE=0), bf16 and FP8 targets,
  graphed; the fused launches are the ones that ran.
"""

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
if torch.cuda.get_device_capability() < (8, 9):
    pytest.skip("the e4m3 kernels need compute capability 8.9 or later", allow_module_level=True)

import torch.nn.functional as F  # noqa: E402

from specdeploy.engine import kernels  # noqa: E402
from specdeploy.engine.kernels import Prologue, elementwise, gemv  # noqa: E402
from specdeploy.engine.models import fp8  # noqa: E402

DEV = "cuda"
EPS = 1e-5
# (N, K, prologue) of Llama-3.1-8B's fused qkv and gate/up (after a norm) and down (after SwiGLU)
LAYERS = [(6144, 4096, "rms_norm"), (28672, 4096, "rms_norm"), (4096, 14336, "silu_mul")]


def _weights(kind, n, k, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    w = torch.randn(n, k, device=DEV, generator=g) * 0.02
    if kind == "bf16":
        w = w.to(torch.bfloat16)
        return w, None, w.float()
    codes, scale = fp8.quantize_fp8_block(w, (128, 128))
    return codes, scale, fp8.dequantize_fp8(codes, scale, (128, 128), torch.float32)


def _within(got, want):
    err = (got.float() - want).abs()
    bound = want.abs() * 2**-8 + want.abs().amax(-1, keepdim=True) * 2**-10
    assert (err <= bound).all(), (err - bound).max().item()


def _separate(x, w, scale, bias=None):
    return gemv.plain_linear(x, w, bias, config=gemv.config_for("plain", w.shape[0], w.shape[1], 1, x.device)) \
        if scale is None else gemv.fp8_linear(x, w, scale, 128, bias)


def _norm_inputs(k, seed):
    g = torch.Generator(device=DEV).manual_seed(seed)
    residual = (torch.randn(1, k, device=DEV, generator=g) * 4).to(torch.bfloat16)
    delta = torch.randn(1, k, device=DEV, generator=g).to(torch.bfloat16)
    norm_w = (1 + 0.1 * torch.randn(k, device=DEV, generator=g)).to(torch.bfloat16)
    return residual, delta, norm_w


@pytest.mark.parametrize("kind", ["bf16", "fp8"])
@pytest.mark.parametrize("n,k,pro", LAYERS)
def test_the_engine_launch_computes_the_prologue(kind, n, k, pro):
    w, scale, wd = _weights(kind, n, k)
    launch = gemv.config_for("plain" if scale is None else "fp8", n, k, 1, torch.device(DEV))
    assert launch[0] == ("fma" if kind == "bf16" else "mma"), launch
    if pro == "silu_mul":
        gate_up = (torch.randn(1, 2 * k, device=DEV) * 2).to(torch.bfloat16)
        got = gemv.fused_linear(gate_up, w, scale, 128, None, Prologue("silu_mul"))
        assert got is not None
        h = elementwise.silu_mul(gate_up[:, :k], gate_up[:, k:])
        _within(got, F.linear(h.float(), wd))
        _within(_separate(h, w, scale), F.linear(h.float(), wd))
        return
    residual, delta, norm_w = _norm_inputs(k, seed=n)
    for d in (delta, None):
        out = torch.full_like(residual, float("nan"))
        got = gemv.fused_linear(residual, w, scale, 128, None, Prologue("rms_norm", d, norm_w, EPS, out))
        assert got is not None
        if d is None:
            total, h = residual, elementwise.rms_norm(residual, norm_w, EPS)
            assert out.isnan().all()  # nothing written without an add
        else:
            total, h = elementwise.add_rms_norm(residual, delta, norm_w, EPS)
            assert torch.equal(out, total)
        t = total.float()
        exact = norm_w.float() * t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + EPS)
        _within(got, F.linear(exact, wd))
        _within(_separate(h, w, scale), F.linear(exact, wd))


def test_graph_replays_equal_eager():
    """A norm prologue (bf16 fma) and a SwiGLU prologue (FP8 mma) captured in one graph: three
    replays over new inputs, each equal to eager calls on them."""
    wq, _, _ = _weights("bf16", 6144, 4096, seed=1)
    wd, sd, _ = _weights("fp8", 4096, 14336, seed=2)
    residual, delta, norm_w = _norm_inputs(4096, seed=3)
    gate_up = torch.randn(1, 2 * 14336, device=DEV).to(torch.bfloat16)

    def step():
        out = torch.empty_like(residual)
        qkv = gemv.fused_linear(residual, wq, None, 128, None, Prologue("rms_norm", delta, norm_w, EPS, out))
        down = gemv.fused_linear(gate_up, wd, sd, 128, None, Prologue("silu_mul"))
        return out, qkv, down

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    for i in range(3):
        for t in (residual, delta, gate_up):
            t.copy_(torch.randn(t.shape, device=DEV).to(t.dtype))
        graph.replay()
        torch.cuda.synchronize()
        for got, want in zip(outs, step()):
            assert torch.equal(got, want), i


@pytest.fixture
def prologue_switch(monkeypatch):
    def set_to(on: bool):
        monkeypatch.setenv(kernels.PROLOGUE_ENV, "1" if on else "0")
        kernels.reset_prologues()
    yield set_to
    monkeypatch.delenv(kernels.PROLOGUE_ENV, raising=False)
    kernels.reset_prologues()


@pytest.mark.parametrize("kind", ["bf16", "fp8"])
def test_greedy_decoding_is_the_same_with_the_prologues_fused(kind, prologue_switch, monkeypatch):
    from specdeploy.engine.demo.toy import predictable_target, random_requests, run_to_completion, tiny_config
    from specdeploy.engine.runtime.runner import Runner

    cfg = tiny_config(hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=2, head_dim=64,
                      vocab_size=64, num_layers=4)
    target, _ = predictable_target(cfg, seed=0, layer_scale=0.25, dtype=torch.bfloat16, device=DEV)
    if kind == "fp8":
        fp8.quantize_model_linears(target, fp8.DRAFT_FP8_FORMAT)  # block 128 x 128
    else:  # the bf16 small-M kernel serves where the table says so (cuBLAS elsewhere): say so for these shapes
        monkeypatch.setattr(gemv, "GEMV_TABLE", dict(gemv.GEMV_TABLE))
        gemv.install_table({("plain", n, k, 1): ("fma", 8, 256, 1, 2, 3)
                            for n, k in [(512, 256), (256, 256), (1024, 256), (256, 512)]})
    fused_calls = []
    real = gemv.fused_linear

    def counted(x, *args, **kw):
        y = real(x, *args, **kw)
        if x.numel() // x.shape[-1] == 1:  # one row (decode); prefill and wider graphs take two kernels
            fused_calls.append(y is not None)
        return y

    monkeypatch.setattr(gemv, "fused_linear", counted)
    outputs = {}
    for on in (True, False):
        prologue_switch(on)
        fused_calls.clear()
        runner = Runner(target, max_total_tokens=2000, max_running_requests=4, context_length=256, device=DEV,
                        graph_mode="capture", cuda_graph_batch_sizes=(1, 2, 4))
        outputs[on] = [run_to_completion(runner, random_requests([n], 16, cfg.vocab_size)) for n in (5, 23, 60)]
        # with the switch on, every call at one row ran fused: 3 launches a layer (qkv, gate/up, down)
        assert (any(fused_calls) and all(fused_calls)) if on else not any(fused_calls), (on, fused_calls[:8])
        del runner
    assert outputs[True] == outputs[False]
