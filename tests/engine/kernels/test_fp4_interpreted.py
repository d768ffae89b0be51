"""The FP4 expert dequantization kernel (engine/kernels/fp4.py, CUDA only) against the torch code
of engine/models/deepseek_v4.py (_Experts._fp4) and fp8.dequantize_fp4, on CPU through Triton's
interpreter (tests/engine/conftest.py): bit for bit, in bf16 and float32, every code byte and
scale, rows and columns past a block."""

import pytest
from v4_tiny import TINY

pytest.importorskip("triton")

SCRIPT = r"""
import torch
from specdeploy.engine.kernels import fp4 as fp4_triton
from specdeploy.engine.models.deepseek_v4 import V4ModelConfig, _Experts
from specdeploy.engine.models.fp8 import dequantize_fp4

experts = _Experts(V4ModelConfig.from_hf(TINY))
experts.quantize("fp4")
g = torch.Generator().manual_seed(0)
for m, k in [(37, 320), (5, 64), (16, 256)]:
    codes = torch.arange(256, dtype=torch.int32).repeat(m * k // 2 // 256 + 1)[:m * k // 2]
    codes = codes[torch.randperm(codes.numel(), generator=g)].to(torch.uint8).view(torch.int8).view(m, k // 2)
    bits = torch.randint(100, 150, (m, k // 32), generator=g, dtype=torch.uint8)
    for dtype in (torch.bfloat16, torch.float32):
        got = fp4_triton.dequant_fp4(codes, bits, dtype)
        want = experts._fp4(codes, bits, dtype, kernel=False)
        assert got.dtype == want.dtype and got.shape == want.shape == (m, k)
        assert torch.equal(got.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                           want.view(torch.int16 if dtype == torch.bfloat16 else torch.int32)), (m, k, dtype)
        assert torch.equal(got, dequantize_fp4(codes, bits, dtype=dtype))
print("ok")
"""


def test_fp4_dequant_kernel_is_the_torch_code_interpreted(run_interpreted):
    run_interpreted(f"TINY = {TINY!r}\n" + SCRIPT)  # the tiny config, as the subprocess cannot import it
