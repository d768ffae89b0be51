"""GPU checks of the small-M linear kernel (engine/kernels/gemv.py) at the Llama-3.1-8B layer
shapes (fused qkv, o, fused gate/up, down; lm_head with bf16 weights) for M = 1 / 4 / 16:

- FP8 block weights (through kernels.fp8.fp8_linear, the engine's entry: table or heuristic
  launch) and bf16 weights (the kernel forced on, whatever the table says for cuBLAS), each
  against a float32 matmul of the dequantized weights, element-wise within the bf16 output
  rounding (2^-8 of the value) plus float32 accumulation-order error (2^-10 of the row's
  largest magnitude);
- both inner loops and split-K 1 / 2 / 4 / 8 on the widest-K shape; the e4m3 tensor-core
  launches (dot8, wg8: activations quantized per token group in the kernel) against the product
  over DeepSeek-quantized activations; dot16 / wg16 (f16 tensor cores, activations unquantized)
  against the weight-only bound;
- CUDA-graph capture of split-K launches, three replays each equal to the eager result (the
  in-kernel counters reset themselves; nothing is allocated in the capture).
"""

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
if torch.cuda.get_device_capability() < (8, 9):
    pytest.skip("the e4m3 kernels need compute capability 8.9 or later", allow_module_level=True)

import torch.nn.functional as F  # noqa: E402

from specdeploy.engine.kernels import fp8 as fp8_kernels  # noqa: E402
from specdeploy.engine.kernels import gemv  # noqa: E402
from specdeploy.engine.models import fp8  # noqa: E402

DEV = "cuda"
# (N, K) of Llama-3.1-8B's fused qkv, o, fused gate/up and down projections
LLAMA_8B = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]
LM_HEAD = (128256, 4096)


def _fp8_weights(n, k, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    w = torch.randn(n, k, device=DEV, generator=g) * 0.02
    codes, scale = fp8.quantize_fp8_block(w, (128, 128))
    return codes, scale, fp8.dequantize_fp8(codes, scale, (128, 128), torch.float32)


def _bf16_weights(n, k, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    return (torch.randn(n, k, device=DEV, generator=g) * 0.02).to(torch.bfloat16)


def _within(got, want):
    err = (got.float() - want).abs()
    bound = want.abs() * 2**-8 + want.abs().amax(-1, keepdim=True) * 2**-10
    assert (err <= bound).all(), (err - bound).max().item()


def _forced(kind, n, k, m):
    """The kernel's launch for this shape even where the table (or the plain-weight default)
    says cuBLAS: the fp8 heuristic's tiles with a loop plain weights take (fma up to 4 rows,
    else dot: the f16 and e4m3 loops are for e4m3 codes only)."""
    cfg = gemv.config_for(kind, n, k, m, torch.device(DEV))
    if cfg[0] != "cublas":
        return cfg
    _, block_n, block_k, split, warps, stages = gemv.heuristic_config("fp8", n, k, m, gemv._sms(torch.device(DEV)))
    return ("fma", 16, 256, split, 4, 3) if m <= 4 else ("dot", max(block_n, 16), block_k, split, warps, stages)


def _quantized_x(x):
    """x as the dot8 / wg8 / sw8 launches see it: DeepSeek's per-token-group e4m3 activations."""
    xq, xs = fp8.act_quant_reference(x.float())
    return xq.float() * xs.repeat_interleave(128, 1)[:, :x.shape[1]]


def _within_quantized(got, x, wd, bias=None):
    """A launch that quantizes x: within bf16 rounding of the product over the quantized x, plus
    a fraction of the row's largest for a code the GPU's fast division rounds the other way on a
    boundary; and within 4% of the unquantized product (e4m3 carries 3 mantissa bits)."""
    want = F.linear(_quantized_x(x), wd, bias)
    err = (got.float() - want).abs()
    assert (err <= want.abs() * 2**-8 + want.abs().amax(-1, keepdim=True) * 2**-9).all(), err.max().item()
    exact = F.linear(x.float(), wd, bias)
    assert ((got.float() - exact).norm() / exact.norm()).item() < 0.04


@pytest.mark.parametrize("n,k", LLAMA_8B)
@pytest.mark.parametrize("m", [1, 4, 16])
def test_fp8_block_weights(n, k, m):
    """The small-M kernel with its launch table's config (the block route up to 4 rows, and to
    16 rows where DeepGEMM is not installed), then the engine's route at the same M."""
    codes, scale, wd = _fp8_weights(n, k)
    x = torch.randn(m, k, device=DEV).to(torch.bfloat16)
    bias = torch.randn(n, device=DEV).to(torch.bfloat16) if m == 4 else None
    b = bias.float() if bias is not None else None
    got = gemv.fp8_linear(x, codes, scale, 128, bias)
    if gemv.config_for("fp8", n, k, m, torch.device(DEV))[0] in gemv.QUANTIZING_VARIANTS:
        _within_quantized(got, x, wd, b)
    else:
        _within(got, F.linear(x.float(), wd, b))
    routed = fp8_kernels.fp8_linear(x, codes, scale, 128, bias)
    if fp8_kernels.block_route(m, lambda o: fp8_kernels.library_available(o, torch.device(DEV), x.dtype)) == "gemv":
        assert torch.equal(routed, got)
    else:  # a library's W8A8 GEMM (DeepGEMM)
        _within_quantized(routed, x, wd, b)


@pytest.mark.parametrize("n,k", LLAMA_8B)
@pytest.mark.parametrize("variant,block_n,block_k,m", [("dot8", 32, 256, 1), ("dot8", 64, 256, 16),
                                                       ("wg8", 64, 128, 1), ("wg8", 64, 128, 16),
                                                       ("sw8", 64, 256, 1), ("sw8", 128, 256, 4),
                                                       ("sw8", 64, 128, 16)])
def test_fp8_tensor_core_variants(n, k, variant, block_n, block_k, m):
    codes, scale, wd = _fp8_weights(n, k)
    x = torch.randn(m, k, device=DEV).to(torch.bfloat16)
    got = gemv.fp8_linear(x, codes, scale, 128, config=(variant, block_n, block_k, 2, 4, 3))
    _within_quantized(got, x, wd)


@pytest.mark.parametrize("n,k", LLAMA_8B)
@pytest.mark.parametrize("variant,block_n,block_k,m", [("dot16", 32, 256, 1), ("dot16", 64, 256, 16),
                                                       ("wg16", 64, 128, 1), ("wg16", 64, 128, 16)])
def test_fp8_f16_tensor_core_variants(n, k, variant, block_n, block_k, m):
    """dot16 / wg16 keep activations unquantized: held to the weight-only bound."""
    codes, scale, wd = _fp8_weights(n, k)
    x = torch.randn(m, k, device=DEV).to(torch.bfloat16)
    got = gemv.fp8_linear(x, codes, scale, 128, config=(variant, block_n, block_k, 2, 4, 3))
    _within(got, F.linear(x.float(), wd))


@pytest.mark.parametrize("n,k", LLAMA_8B + [LM_HEAD])
@pytest.mark.parametrize("m", [1, 4, 16])
def test_bf16_weights(n, k, m):
    w = _bf16_weights(n, k)
    x = torch.randn(m, k, device=DEV).to(torch.bfloat16)
    got = gemv.plain_linear(x, w, None, config=_forced("plain", n, k, m))
    _within(got, F.linear(x.float(), w.float()))


@pytest.mark.parametrize("variant,block_n,m", [("fma", 4, 1), ("fma", 8, 1), ("fma", 16, 4), ("dot", 16, 16),
                                               ("dot", 32, 8)])
@pytest.mark.parametrize("split_k", [1, 2, 4, 8])
def test_variants_and_splits(variant, block_n, m, split_k):
    n, k = 4096, 14336
    codes, scale, wd = _fp8_weights(n, k, seed=1)
    x = torch.randn(m, k, device=DEV).to(torch.bfloat16)
    got = gemv.fp8_linear(x, codes, scale, 128, config=(variant, block_n, 512, split_k, 4, 3))
    _within(got, F.linear(x.float(), wd))
    assert all(int(c.abs().sum()) == 0 for _, c in gemv._WORKSPACES.values())


def test_graph_replays_equal_eager():
    """Split-K launches of both weight kinds captured in one graph; each of three replays (new
    inputs copied in) equals an eager call on the same inputs."""
    n, k = 4096, 14336
    codes, scale, _ = _fp8_weights(n, k, seed=2)
    w = _bf16_weights(n, k, seed=3)
    fp8_cfg = ("fma", 8, 512, 4, 4, 3)
    plain_cfg = ("dot", 16, 256, 4, 4, 3)
    x = torch.randn(4, k, device=DEV).to(torch.bfloat16)

    def step():
        return (gemv.fp8_linear(x[:1], codes, scale, 128, config=fp8_cfg),
                gemv.plain_linear(x, w, None, config=plain_cfg))

    step()  # eager warm-up: compiles and makes the workspaces
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    for i in range(3):
        x.copy_(torch.randn(4, k, device=DEV).to(torch.bfloat16))
        graph.replay()
        torch.cuda.synchronize()
        want = step()
        for got, ref in zip(outs, want):
            assert torch.equal(got, ref), i
