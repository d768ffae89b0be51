"""GPU checks of the linears' prologues (engine.kernels.Prologue): at one row, the residual add +
RMSNorm before the q/k/v and gate/up projections and the SwiGLU before the down projection are
computed by the small-M linear itself (the CUDA mma kernel for FP8 block codes; the Triton fma
loop too, which the engine does not use for them), not by kernels of their own.

- At the Llama-3.1-8B shapes, with the launch the engine's table gives each: the launch takes
  the prologue; the residual sum it writes equals the add's, bit for bit; the output is within
  the bf16 output rounding (2^-8 of the value, 2^-10 of the row's largest) of a float32 product
  over the exactly normed (or SwiGLU'd) input, as the separate kernels' result is.
- CUDA-graph replays of fused launches equal eager calls.
- An FP8 model's decode call at one row takes every prologue and gives the logits and K/V of the
  separate kernels (SPECDEPLOY_PROLOGUE=0) within the rounding the fused path skips.
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


def _norm_inputs(k, seed):
    g = torch.Generator(device=DEV).manual_seed(seed)
    residual = (torch.randn(1, k, device=DEV, generator=g) * 4).to(torch.bfloat16)
    delta = torch.randn(1, k, device=DEV, generator=g).to(torch.bfloat16)
    norm_w = (1 + 0.1 * torch.randn(k, device=DEV, generator=g)).to(torch.bfloat16)
    return residual, delta, norm_w


@pytest.mark.parametrize("kind", ["bf16", "fp8"])
@pytest.mark.parametrize("n,k,pro", LAYERS)
def test_the_launch_computes_the_prologue(kind, n, k, pro):
    """FP8: the engine's launch (the mma kernel). bf16: the table's fma launch, given explicitly:
    the engine does not hand prologues to the Triton loops (gemv.engine_prologue)."""
    w, scale, wd = _weights(kind, n, k)
    launch = gemv.config_for("plain" if scale is None else "fp8", n, k, 1, torch.device(DEV))
    assert launch[0] == ("fma" if kind == "bf16" else "mma"), launch
    config = launch if kind == "bf16" else None
    if kind == "bf16":
        assert gemv.fused_linear(torch.zeros(1, k, device=DEV, dtype=torch.bfloat16), w, None, 128, None,
                                 Prologue("rms_norm", None, torch.ones(k, device=DEV, dtype=torch.bfloat16), EPS)) is None
    if pro == "silu_mul":
        gate_up = (torch.randn(1, 2 * k, device=DEV) * 2).to(torch.bfloat16)
        got = gemv.fused_linear(gate_up, w, scale, 128, None, Prologue("silu_mul"), config=config)
        assert got is not None
        h = elementwise.silu_mul(gate_up[:, :k], gate_up[:, k:])
        _within(got, F.linear(h.float(), wd))
        return
    residual, delta, norm_w = _norm_inputs(k, seed=n)
    for d in (delta, None):
        out = torch.full_like(residual, float("nan"))
        got = gemv.fused_linear(residual, w, scale, 128, None, Prologue("rms_norm", d, norm_w, EPS, out), config=config)
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
        # the separate kernels' result rounds the normed input to bf16 first: within that
        sep = F.linear(h.float(), wd)
        assert ((got.float() - sep).abs() <= 2**-6 * sep.abs().amax()).all()


def test_graph_replays_equal_eager():
    """A norm prologue (bf16 fma) and a SwiGLU prologue (FP8 mma) captured in one graph: three
    replays over new inputs, each equal to eager calls on them."""
    wq, _, _ = _weights("bf16", 6144, 4096, seed=1)
    wd, sd, _ = _weights("fp8", 4096, 14336, seed=2)
    residual, delta, norm_w = _norm_inputs(4096, seed=3)
    gate_up = torch.randn(1, 2 * 14336, device=DEV).to(torch.bfloat16)

    def step():
        out = torch.empty_like(residual)
        qkv = gemv.fused_linear(residual, wq, None, 128, None, Prologue("rms_norm", delta, norm_w, EPS, out),
                                config=("fma", 8, 512, 1, 2, 3))
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
    def set_to(value: str):
        monkeypatch.setenv(kernels.PROLOGUE_ENV, value)
        kernels.reset_prologues()
    yield set_to
    monkeypatch.delenv(kernels.PROLOGUE_ENV, raising=False)
    kernels.reset_prologues()


def test_a_decode_step_with_the_prologues_fused(prologue_switch, monkeypatch):
    """An FP8 model's decode call at one row: every q/k/v, gate/up and down launch took its
    prologue, the K/V written and the logits equal those with the norms and SwiGLU as kernels of
    their own, within the bf16 rounding of the normed input that the fused path skips."""
    from specdeploy.engine.demo.toy import predictable_target, tiny_config
    from specdeploy.engine.runtime.runner import Runner

    cfg = tiny_config(hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=2, head_dim=64,
                      vocab_size=64, num_layers=4)
    target, _ = predictable_target(cfg, seed=0, layer_scale=0.25, dtype=torch.bfloat16, device=DEV)
    fp8.quantize_model_linears(target, fp8.DRAFT_FP8_FORMAT)  # block 128 x 128
    fused = []
    real = gemv.fused_linear

    def counted(x, *args, **kw):
        y = real(x, *args, **kw)
        fused.append(y is not None)
        return y

    monkeypatch.setattr(gemv, "fused_linear", counted)
    calls = Runner(target, max_total_tokens=2000, max_running_requests=4, context_length=256, device=DEV,
                   graph_mode="off").calls
    g = torch.Generator(device=DEV).manual_seed(1)
    for k in calls.target_kv.k:
        k.copy_(torch.randn(k.shape, device=DEV, generator=g).to(k.dtype))
    for v in calls.target_kv.v:
        v.copy_(torch.randn(v.shape, device=DEV, generator=g).to(v.dtype))
    lens = torch.tensor([37], device=DEV)
    prefix = torch.randint(1, 1500, (1, 37), device=DEV, generator=g)
    ids = torch.tensor([[5]], device=DEV)
    slot = torch.tensor([[1600]], device=DEV)
    out = {}
    for value in ("1", "0"):
        prologue_switch(value)
        fused.clear()
        logits = calls.target_decode(ids, lens[:, None], slot, prefix, lens).float()
        out[value] = logits, [t[1600].clone() for t in (*calls.target_kv.k, *calls.target_kv.v)]
        assert fused == [value == "1"] * (3 * cfg.num_layers), fused
    (a, kv_a), (b, kv_b) = out["1"], out["0"]
    assert ((a - b).abs() <= 0.02 * b.abs().amax()).all(), (a - b).abs().max().item()
    assert (a.argmax(-1) == b.argmax(-1)).all()
    for x, y in zip(kv_a, kv_b):
        assert ((x.float() - y.float()).abs() <= 0.02 * y.float().abs().amax() + 1e-3).all()
