"""The Triton RMSNorm and SiLU-times-up kernels (used on CUDA only) checked against the torch
code of layers.py on CPU through Triton's interpreter (a subprocess: the interpreter is chosen
when Triton is first imported)."""

import pytest

pytest.importorskip("triton")

SCRIPT = r"""
import torch
import torch.nn.functional as F
from specdeploy.engine import elementwise_triton as ew
from specdeploy.engine.layers import RMSNorm

torch.manual_seed(0)

def assert_close(got, want, dtype):
    # float32: the order of one sum apart. bf16: the same roundings as torch, so all but a few
    # elements (a float32 difference landing on a rounding boundary) are equal, none off by
    # more than one bf16 step.
    diff = (got.float() - want.float()).abs()
    if dtype == torch.float32:
        assert diff.max() <= 1e-6 * (1 + want.float().abs().max()), diff.max()
        return
    assert (diff > 0).float().mean() < 0.01, (diff > 0).float().mean()
    assert (diff <= want.float().abs() * 2 ** -7 + 1e-6).all(), diff.max()

# RMSNorm: hidden rows [B, Q, H] (H not a power of two) and per-head q/k norms [B, Q, heads, D];
# a float32 weight over bf16 activations promotes the output to float32, as torch does.
for shape, x_dtype, w_dtype in [((2, 3, 48), torch.float32, torch.float32),
                                ((1, 1, 96), torch.bfloat16, torch.bfloat16),
                                ((2, 5, 4, 16), torch.bfloat16, torch.bfloat16),
                                ((3, 2, 40), torch.bfloat16, torch.float32)]:
    norm = RMSNorm(shape[-1], 1e-5)
    norm.weight.data = (1 + 0.1 * torch.randn(shape[-1])).to(w_dtype)
    x = (3 * torch.randn(shape)).to(x_dtype)
    want = norm(x)                                  # CPU tensors: the torch code
    got = ew.rms_norm(x, norm.weight, norm.eps)
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, want.dtype)
    assert_close(got, want, x_dtype)

# SiLU(gate) * up over the two halves of one gate/up matmul output [B, Q, 2I].
for b, q, n, dtype in [(2, 3, 40, torch.float32), (1, 1, 2500, torch.bfloat16)]:
    y = (2 * torch.randn(b, q, 2 * n)).to(dtype)
    gate, up = y.split(n, dim=-1)
    want = F.silu(gate) * up
    got = ew.silu_mul(gate, up)
    assert got.dtype == dtype and got.shape == want.shape
    assert_close(got, want, dtype)
print("ok")
"""


def test_elementwise_kernels_match_torch_interpreted(run_interpreted):
    run_interpreted(SCRIPT)
