"""The batch-1 folds of the small-M linear (engine/kernels/gemv.py: norm_linear, silu_linear) on
CPU through Triton's interpreter: residual add + RMSNorm, and silu(gate) * up, computed inside
the linear's launch. Held to a float32 reference of the unfolded pair (the norm's output is not
rounded before the product in the fold, so the bound is the linear's own), over FP8 block and
channel scales and plain bf16 / fp32 weights, bias or not, K a multiple of the tile and not; the
residual sum the fold writes equals torch's add bit for bit. Where a fold does not apply (two
rows, a split or a library launch in the table, SPECDEPLOY_FOLD=0) the entries say None and the
caller runs the two launches."""

import pytest

pytest.importorskip("triton")

from fp8_interpreter import FP8_CAST  # noqa: E402  (tests/support)

SCRIPT = FP8_CAST + r"""
import os
import torch.nn.functional as F

from specdeploy.engine.kernels import gemv, launch
from specdeploy.engine.models import fp8

torch.manual_seed(0)

def weights(kind, n, k):
    w = torch.randn(n, k) * 0.05
    if kind == "block":
        codes, grid = fp8.quantize_fp8_block(w, (128, 128))
        return codes, grid, 128
    if kind == "channel":
        codes, per_row = fp8.quantize_fp8_channel(w)
        return codes, per_row.reshape(-1).contiguous(), 1
    return w.to(kind), None, 1

def dequantized(codes, scale, scale_n):
    return codes.float() if scale is None else codes.float() * fp8.expand_scale(scale, tuple(codes.shape), scale_n, 128)

def check(got, want, dtype, what):
    assert got.dtype == dtype and got.shape == want.shape, what
    if dtype == torch.float32:
        bound = 1e-5 * want.abs() + 1e-5 * want.abs().amax(-1, keepdim=True) + 1e-6
    else:
        bound = 2 ** -8 * want.abs() + 2 ** -10 * want.abs().amax(-1, keepdim=True)
    err = (got.float() - want).abs()
    assert (err <= bound).all(), (what, err.max().item())

def kind_of(kind):
    return "plain" if isinstance(kind, torch.dtype) else "fp8"

# (weight kind, N, K, x dtype, the table's M-1 launch)
cases = [("block", 40, 512, torch.bfloat16, ("fma", 8, 256, 1, 4, 2)),
         ("block", 72, 320, torch.float32, ("fma", 16, 128, 1, 4, 2)),     # a partial group and tile
         ("channel", 40, 512, torch.bfloat16, ("fma", 32, 512, 1, 4, 2)),
         (torch.bfloat16, 72, 512, torch.bfloat16, ("fma", 8, 256, 1, 4, 2)),
         (torch.float32, 40, 320, torch.float32, ("fma", 8, 128, 1, 4, 2))]
eps = 1e-5
for i, (kind, n, k, dtype, cfg) in enumerate(cases):
    gemv.install_table({(kind_of(kind), n, k, 1): cfg})
    codes, scale, scale_n = weights(kind, n, k)
    wd = dequantized(codes, scale, scale_n)
    bias = torch.randn(n).to(dtype) if i % 2 else None
    b32 = bias.float() if bias is not None else None
    norm_w = (1 + 0.1 * torch.randn(k)).to(dtype)
    residual = (torch.randn(1, 1, k) * 2).to(dtype)
    delta = torch.randn(1, 1, k).to(dtype)
    for d in (delta, None):
        got = gemv.norm_linear(residual, d, norm_w, eps, codes, scale, scale_n, bias)
        assert got is not None, (kind, cfg)
        total, y = got
        want_total = residual + d if d is not None else residual
        assert torch.equal(total, want_total), (kind, "the residual sum")
        h = want_total.float()
        normed = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * norm_w.float()
        assert y.shape == (1, 1, n)
        check(y, F.linear(normed, wd, b32), dtype, (kind, cfg, d is None))
    # silu(gate) * up folded into the down-projection-like launch: gate/up halves of one output
    gate_up = torch.randn(1, 2 * k).to(dtype)
    gate, up = gate_up[:, :k], gate_up[:, k:]
    y = gemv.silu_linear(gate, up, codes, scale, scale_n, bias)
    check(y, F.linear((F.silu(gate) * up).float(), wd, b32), dtype, (kind, cfg, "silu"))

# silu folded into a split-K launch (the down projection's table entry at M 1 splits K)
gemv.install_table({("fp8", 40, 1024, 1): ("fma", 8, 256, 2, 4, 2)})
codes, scale, scale_n = weights("block", 40, 1024)
gate_up = torch.randn(1, 2048).to(torch.bfloat16)
y = gemv.silu_linear(gate_up[:, :1024], gate_up[:, 1024:], codes, scale, scale_n)
check(y, F.linear((F.silu(gate_up[:, :1024]) * gate_up[:, 1024:]).float(), dequantized(codes, scale, scale_n)),
      torch.bfloat16, "silu split")
assert all(int(c.abs().sum()) == 0 for _, c in gemv._WORKSPACES.values())
# ... but no norm: a split program cannot see the row's whole sum of squares
assert gemv.norm_linear(torch.randn(1, 1024).to(torch.bfloat16), None, torch.ones(1024).to(torch.bfloat16), eps,
                        codes, scale, scale_n) is None

# where the folds do not apply: two rows, a library launch in the table, dtypes that differ, the env off
codes, scale, scale_n = weights("block", 40, 512)
x2 = torch.randn(2, 512).to(torch.bfloat16)
ones = torch.ones(512).to(torch.bfloat16)
assert gemv.norm_linear(x2, None, ones, eps, codes, scale, scale_n) is None
assert gemv.silu_linear(x2, x2, codes, scale, scale_n) is None
gemv.install_table({("plain", 40, 512, 1): ("cublas", 0, 0, 1, 0, 0)})
w = torch.randn(40, 512).to(torch.bfloat16)
x1 = torch.randn(1, 512).to(torch.bfloat16)
assert gemv.norm_linear(x1, None, ones, eps, w, None) is None
assert gemv.norm_linear(x1, None, ones.float(), eps, codes, scale, scale_n) is None
os.environ[launch.FOLD_ENV] = "0"
launch.reset()
assert gemv.norm_linear(x1, None, ones, eps, codes, scale, scale_n) is None
assert gemv.silu_linear(x1, x1, codes, scale, scale_n) is None
os.environ[launch.FOLD_ENV] = "1"
launch.reset()
assert gemv.norm_linear(x1, None, ones, eps, codes, scale, scale_n) is not None
# a folded norm is a one-row fma launch; anything else is refused before it runs
for m, variant in ((2, "fma"), (1, "dot")):
    try:
        gemv.launch_constexprs("fp8", torch.bfloat16, m, 40, 512, 1, 128, False, False, variant, 16, 256, 1, 2,
                               x_fn=2)
        raise AssertionError(f"a folded norm launched on {m} rows of {variant}")
    except ValueError:
        pass
print("ok")
"""


def test_gemv_folds_match_the_unfolded_pair_interpreted(run_interpreted):
    run_interpreted(SCRIPT)
