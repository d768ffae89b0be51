"""The small-M linear kernel (engine/kernels/gemv.py, CUDA only in the engine) on CPU through
Triton's interpreter (tests/engine/conftest.py): both inner loops, split-K 1/2/4 finished
in-kernel, every scale layout (FP8 block / rows / channel / tensor) and plain bf16/fp32 weights,
against F.linear over the float32 (dequantized) weights; M 1..16, bias, N not a multiple of
BLOCK_N, K a multiple of 128 and not. The split-K counters are back at zero after each call, so
a second call (a graph replay) gives the same result."""

import pytest

pytest.importorskip("triton")

from fp8_interpreter import FP8_CAST  # noqa: E402  (tests/support)

SCRIPT = FP8_CAST + r"""
import torch.nn.functional as F

from specdeploy.engine.kernels import fp8 as fp8_kernels
from specdeploy.engine.kernels import gemv
from specdeploy.engine.models import fp8

torch.manual_seed(0)

def weights(kind, n, k):
    w = torch.randn(n, k) * 0.05
    if kind == "block":
        codes, grid = fp8.quantize_fp8_block(w, (128, 128))
        return codes, grid, 128
    if kind == "rows":   # fused parts whose blocks cut across rows: one scale row per output row
        codes, grid = fp8.quantize_fp8_block(w, (128, 128))
        return codes, grid.repeat_interleave(128, 0)[:n].contiguous(), 1
    if kind == "channel":
        codes, per_row = fp8.quantize_fp8_channel(w)
        return codes, per_row.reshape(-1).contiguous(), 1
    if kind == "tensor":
        single = (w.abs().max() / 448).reshape(1)
        return (w / single).to(torch.float8_e4m3fn), single, 1
    return w.to(kind), None, 1  # plain weights in a torch dtype

def reference(x, codes, scale, scale_n, bias):
    wd = codes.float() if scale is None else codes.float() * fp8.expand_scale(scale, tuple(codes.shape), scale_n, 128)
    return F.linear(x.float(), wd, bias)

def check(got, want, dtype, what):
    assert got.dtype == dtype and got.shape == want.shape, what
    if dtype == torch.float32:
        bound = 1e-5 * want.abs() + 1e-5 * want.abs().amax(-1, keepdim=True) + 1e-6
    else:  # one rounding of the float32 sum to bf16, plus summation order
        bound = 2 ** -8 * want.abs() + 2 ** -10 * want.abs().amax(-1, keepdim=True)
    err = (got.float() - want).abs()
    assert (err <= bound).all(), (what, err.max().item())

def counters_zero():
    return all(int(c.abs().sum()) == 0 for _, c in gemv._WORKSPACES.values())

# (weight kind, N, K, M, x dtype, launch): every scale layout on both loops, split-K 1/2/4,
# N = 40 and 72 (BLOCK_N 16 and 32 do not divide them), K = 512 (whole groups) and 320 (a partial group and tile).
cases = []
for kind in ("block", "rows", "channel", "tensor"):
    cases += [(kind, 40, 512, 1, torch.bfloat16, ("fma", 8, 256, 2, 4, 2)),
              (kind, 40, 512, 3, torch.float32, ("fma", 4, 128, 4, 4, 2)),
              (kind, 40, 512, 12, torch.bfloat16, ("dot", 16, 128, 4, 4, 2)),
              (kind, 40, 320, 2, torch.float32, ("fma", 16, 256, 2, 4, 2))]
cases += [("block", 72, 512, 16, torch.float32, ("dot", 32, 256, 1, 4, 2)),
          ("block", 200, 512, 4, torch.bfloat16, ("fma", 256, 128, 1, 4, 2)),   # wider than a scale block
          ("block", 72, 1024, 7, torch.bfloat16, ("fma", 4, 512, 2, 4, 2)),
          ("rows", 136, 384, 16, torch.bfloat16, ("dot", 64, 256, 2, 4, 2))]
cases += [(torch.bfloat16, 72, 512, m, torch.bfloat16, cfg)
          for m, cfg in [(1, ("fma", 8, 256, 4, 4, 2)), (4, ("fma", 16, 128, 2, 4, 2)),
                         (9, ("dot", 16, 256, 2, 4, 2)), (16, ("dot", 32, 128, 1, 4, 2))]]
cases += [(torch.float32, 72, 320, m, torch.float32, cfg)
          for m, cfg in [(1, ("fma", 32, 128, 2, 4, 2)), (5, ("fma", 8, 256, 1, 4, 2)),
                         (16, ("dot", 16, 128, 4, 4, 2))]]
for i, (kind, n, k, m, dtype, cfg) in enumerate(cases):
    codes, scale, scale_n = weights(kind, n, k)
    x = torch.randn(m, k).to(dtype)
    bias = torch.randn(n).to(dtype) if i % 2 else None
    want = reference(x, codes, scale, scale_n, bias.float() if bias is not None else None)
    if scale is None:
        got = gemv.plain_linear(x, codes, bias, config=cfg)
    else:
        got = gemv.fp8_linear(x, codes, scale, scale_n, bias, config=cfg)
    check(got, want, dtype, (kind, n, k, m, cfg))
    assert counters_zero(), (kind, cfg)
    again = gemv.fp8_linear(x, codes, scale, scale_n, bias, config=cfg) if scale is not None else \
        gemv.plain_linear(x, codes, bias, config=cfg)
    assert torch.equal(got, again), (kind, cfg)

# the workspaces are what the planner counts for their widths
from specdeploy.engine.planner.plan import gemv_width_bytes
assert gemv._WORKSPACES and all(p.numel() * 4 + c.numel() * 4 == gemv_width_bytes(n)
                                for (_, n), (p, c) in gemv._WORKSPACES.items())

# every M 1..16 through the engine's entry (kernels/fp8.fp8_linear: the table or heuristic
# launch), batched leading dims, on a 4096-wide-style shape scaled down
codes, scale, scale_n = weights("block", 40, 1024)
for m in range(1, 17):
    x = torch.randn(1, m, 1024).to(torch.bfloat16)
    cfg = gemv.config_for("fp8", 40, 1024, m, x.device)
    assert cfg[0] == "dot16" and cfg[3] >= 1, cfg
    got = fp8_kernels.fp8_linear(x, codes, scale, scale_n)
    assert got.shape == (1, m, 40)
    check(got.reshape(m, 40), reference(x.reshape(m, 1024), codes, scale, scale_n, None), torch.bfloat16, m)
assert counters_zero()

# the heuristic: >= 4 programs per SM where split-K can get there, >= 4 k blocks per split
for n, k, m in [(4096, 4096, 1), (4096, 14336, 1), (6144, 4096, 4), (28672, 4096, 16), (4096, 4096, 16)]:
    variant, bn, bk, split, warps, stages = gemv.heuristic_config("fp8", n, k, m, 132)
    tiles = -(-n // bn)
    assert split == 1 or -(-k // bk) // split >= gemv.MIN_K_BLOCKS_PER_SPLIT, (n, k, m, split)
    assert tiles * split >= 4 * 132 or split == min(-(-k // bk) // 4, gemv.GEMV_MAX_SPLIT_K), (n, k, m)
assert gemv.heuristic_config("plain", 4096, 4096, 1, 132)[0] == "cublas"
assert gemv.plain_linear(torch.randn(2, 128), torch.randn(8, 128)) is None     # not in the table

# a table installed in-process is what the launches use; a malformed entry is refused
gemv.install_table({("plain", 72, 512, 4): ("fma", 8, 128, 2, 4, 2)})
x = torch.randn(3, 512).to(torch.bfloat16)
w = (torch.randn(72, 512) * 0.05).to(torch.bfloat16)
check(gemv.plain_linear(x, w), reference(x, w, None, 1, None), torch.bfloat16, "table")
try:
    gemv.install_table({("plain", 72, 512, 3): ("fma", 8, 128, 2, 4, 2)})
    raise AssertionError("a bucket that does not exist was accepted")
except ValueError:
    pass
# dot8 / wg8 / sw8: x quantized per 128-wide group in the kernel, e4m3 x e4m3: equal to the product
# over DeepSeek-quantized activations (act_quant_reference), every scale layout, ue8m0 scales too
def quantized_reference(x, codes, scale, scale_n, bias, round_scale):
    xq, xs = fp8.act_quant_reference(x.float(), 128, round_scale)
    xd = xq.float() * xs.repeat_interleave(128, 1)[:, :x.shape[1]]
    return reference(xd, codes, scale, scale_n, bias)

for i, (kind, n, k, m, dtype, cfg, round_scale) in enumerate([
        ("block", 40, 512, 1, torch.bfloat16, ("dot8", 16, 256, 2, 4, 2), False),
        ("block", 72, 512, 16, torch.float32, ("wg8", 32, 128, 4, 4, 2), True),
        ("rows", 40, 512, 3, torch.bfloat16, ("wg8", 16, 256, 1, 4, 2), False),
        ("channel", 40, 320, 5, torch.float32, ("dot8", 32, 128, 2, 4, 2), False),
        ("tensor", 72, 512, 2, torch.bfloat16, ("dot8", 64, 256, 1, 4, 2), True),
        ("block", 72, 512, 4, torch.bfloat16, ("sw8", 64, 256, 2, 4, 2), False),     # the swapped product
        ("rows", 40, 512, 16, torch.float32, ("sw8", 64, 128, 1, 4, 2), True),
        ("channel", 40, 320, 1, torch.bfloat16, ("sw8", 64, 128, 2, 4, 2), False)]):
    codes, scale, scale_n = weights(kind, n, k)
    x = (torch.randn(m, k) * 3).to(dtype)
    bias = torch.randn(n).to(dtype) if i % 2 else None
    got = gemv.fp8_linear(x, codes, scale, scale_n, bias, config=cfg, round_scale=round_scale)
    want = quantized_reference(x, codes, scale, scale_n, bias.float() if bias is not None else None, round_scale)
    check(got, want, dtype, (kind, cfg, round_scale))
    assert counters_zero(), (kind, cfg)
# dot16 / wg16: the weight-only product on the f16 tensor cores, x scaled into f16 by a power of
# two per row and group: held to the unquantized reference like fma and dot, with one group of a
# row a million times smaller than the rest (it must keep its own scale) and fp16 / fp32 x
for i, (kind, n, k, m, dtype, cfg) in enumerate([
        ("block", 40, 512, 1, torch.bfloat16, ("dot16", 16, 256, 2, 4, 2)),
        ("block", 72, 512, 16, torch.bfloat16, ("wg16", 32, 128, 4, 4, 2)),
        ("rows", 40, 512, 3, torch.float16, ("dot16", 32, 256, 1, 4, 2)),
        ("channel", 40, 320, 5, torch.bfloat16, ("wg16", 16, 128, 2, 4, 2)),
        ("tensor", 40, 512, 2, torch.float32, ("dot16", 16, 256, 2, 4, 2)),
        ("block", 40, 512, 2, torch.bfloat16, ("dot16", 16, 256, 2, 4, 2)),      # X_ROWS 2 of 16
        ("block", 72, 512, 5, torch.bfloat16, ("wg16", 32, 128, 4, 4, 2))]):     # X_ROWS 8 of 64
    codes, scale, scale_n = weights(kind, n, k)
    x = torch.randn(m, k) * 3
    x[0, 128:256] *= 1e-6
    x[-1, :128] *= 1e3  # and one 1000 times larger
    x = x.to(dtype)
    bias = torch.randn(n).to(dtype) if i % 2 else None
    got = gemv.fp8_linear(x, codes, scale, scale_n, bias, config=cfg)
    check(got, reference(x, codes, scale, scale_n, bias.float() if bias is not None else None), dtype, (kind, cfg))
    assert counters_zero(), (kind, cfg)
# "mma", the CUDA kernel of engine/kernels/fp8_mma.py, is not usable here: a forced mma launch
# runs the Triton kernel's launch for the shape; mma entries are mma launches of at most 8 rows
codes, scale, scale_n = weights("block", 40, 512)
x = torch.randn(3, 512).to(torch.bfloat16)
assert torch.equal(gemv.fp8_linear(x, codes, scale, scale_n, config=("mma", 16, 256, 1, 8, 2)),
                   gemv.fp8_linear(x, codes, scale, scale_n))
assert gemv.config_for("fp8", 40, 512, 3, x.device)[0] != "mma"
for bad in [{("mma", 72, 512, 4): ("fma", 8, 128, 2, 4, 2)}, {("fp8", 72, 512, 4): ("mma", 16, 256, 1, 8, 2)},
            {("mma", 72, 512, 16): ("mma", 16, 256, 1, 8, 2)}]:
    try:
        gemv.install_table(bad)
        raise AssertionError(f"{bad} was accepted")
    except ValueError:
        pass
for variant in ("dot16", "wg16", "mma", *gemv.QUANTIZING_VARIANTS):  # e4m3 codes only
    try:
        gemv.plain_linear(torch.randn(1, 512), torch.randn(40, 512), config=(variant, 64, 256, 1, 4, 2))
        raise AssertionError(f"{variant} ran over plain weights")
    except ValueError:
        pass
print("ok")
"""


def test_gemv_kernel_matches_torch_interpreted(run_interpreted):
    run_interpreted(SCRIPT)
