"""The persistent TMA FP8 GEMM (engine/kernels/fp8_tma.py, CUDA only) on CPU through Triton's
interpreter (tests/engine/conftest.py) against float32 matmuls over the dequantized weights and
activations, at small shapes that exercise its edges; and the FP8 route table's choices
(engine/kernels/fp8.py block_route)."""

import pytest

pytest.importorskip("triton")

from fp8_interpreter import FP8_CAST  # noqa: E402  (tests/support)

SCRIPT = FP8_CAST + r"""
import torch.nn.functional as F

from specdeploy.engine.kernels import fp8 as kernels
from specdeploy.engine.kernels import fp8_tma
from specdeploy.engine.models import fp8

torch.manual_seed(0)

def reference(a, a_s, codes, scale, scale_n, bias):
    k = a.shape[1]
    x = a.float() * a_s.repeat_interleave(128, 1)[:, :k]
    w = codes.float() * fp8.expand_scale(scale, tuple(codes.shape), scale_n, 128)
    return F.linear(x, w, bias)

# (M, N, K, config, programs, scale_n, column-major activation scales, bias, out dtype):
# partial M, N and K tiles (K 336: a partial last scale block), fewer programs than tiles (the
# persistent loop walks several), GROUP_M swizzle across a partial group, per-row scale grids.
cases = [
    (40, 200, 336, (32, 64, 2, 4, 2), 3, 128, False, True, torch.float32),
    (70, 256, 256, (32, 128, 2, 4, 2), 2, 128, True, False, torch.bfloat16),
    (17, 96, 384, (16, 32, 4, 4, 2), 5, 1, True, True, torch.float32),
    (5, 128, 128, (16, 64, 8, 4, 2), 1, 128, False, False, torch.bfloat16),
]
for m, n, k, config, programs, scale_n, column_major, with_bias, dtype in cases:
    w = torch.randn(n, k) * 0.05
    codes, scale = fp8.quantize_fp8_block(w, (128, 128))
    if scale_n == 1:
        scale = scale.repeat_interleave(128, 0)[:n].contiguous()
    x = torch.randn(m, k) * 2
    a, a_s = kernels.act_quant(x, column_major=column_major)
    bias = torch.randn(n) if with_bias else None
    out = torch.full((m, n), float("nan"), dtype=dtype)
    got = fp8_tma.fp8_tma_gemm(a, a_s, codes, scale, scale_n, bias, out, config=config, programs=programs)
    assert got is out and not torch.isnan(out.float()).any(), (m, n, k)
    want = reference(a, a_s, codes, scale, scale_n, bias)
    err = (out.float() - want).abs()
    # exact products, float32 sums; one rounding to the output dtype
    tol = 1e-5 if dtype == torch.float32 else 2 ** -8
    assert (err <= want.abs() * tol + want.abs().amax() * 1e-6).all(), (m, n, k, err.max())
    # and within e4m3 activation error of the unquantized product
    exact = F.linear(x, codes.float() * fp8.expand_scale(scale, tuple(codes.shape), scale_n, 128), bias)
    assert (out.float() - exact).norm() / exact.norm() < 2 ** -4, (m, n, k)

# M = 0: nothing launched, out returned as is
empty = torch.empty(0, 128, dtype=torch.bfloat16)
a0, s0 = kernels.act_quant(torch.empty(0, 128))
assert fp8_tma.fp8_tma_gemm(a0, s0, codes[:128, :128].contiguous(), scale[:1, :1].contiguous(), 128, None,
                            empty) is empty

# bad input: a clear error
codes, scale = fp8.quantize_fp8_block(torch.randn(128, 136), (128, 128))
a, a_s = kernels.act_quant(torch.randn(4, 136))
codes_ok = codes[:, :128].contiguous()
misaligned = torch.empty(4 * 128 + 1)[1:].view(4, 128)
for args, needle in [((a, a_s, codes, scale, 128, None, torch.empty(4, 128)), "TMA needs"),
                     ((a[:, :128].contiguous(), a_s[:, :1].contiguous(), codes_ok, scale[:, :1].contiguous(), 128,
                       None, misaligned), "aligned"),
                     ((a, a_s, codes, scale[:, :1], 128, None, torch.empty(4, 128)), "scale grid"),
                     ((a, a_s, codes, scale, 128, None, torch.empty(5, 128)), "fp8_tma_gemm")]:
    try:
        fp8_tma.fp8_tma_gemm(*args)
    except ValueError as e:
        assert needle in str(e), e
    else:
        raise AssertionError(needle)
print("ok")
"""


def test_fp8_tma_gemm_interpreted(run_interpreted):
    run_interpreted(SCRIPT)


def test_block_route_follows_the_table_and_falls_back():
    from specdeploy.engine.kernels import fp8 as kernels
    from specdeploy.engine.kernels import gemv

    table = ((gemv.GEMV_MAX_M, "gemv"), (1024, "torch_block"), (None, "tma"))
    assert kernels.block_route(1, True, True, table) == "gemv"
    assert kernels.block_route(gemv.GEMV_MAX_M, False, False, table) == "gemv"
    assert kernels.block_route(gemv.GEMV_MAX_M + 1, True, True, table) == "torch_block"
    assert kernels.block_route(1024, True, True, table) == "torch_block"
    assert kernels.block_route(1025, True, True, table) == "tma"
    assert kernels.block_route(8192, True, True, table) == "tma"
    # an option not available here: torch's GEMM where it runs, else the Triton kernels
    assert kernels.block_route(8192, True, False, table) == "torch_block"
    assert kernels.block_route(8192, False, False, table) == "triton"
    assert kernels.block_route(100, False, True, table) == "triton"
    # the committed table: the small-M kernel to 16 rows, then an option every route knows
    assert kernels.block_route(1, True, True) == "gemv"
    assert kernels.block_route(17, True, True) in kernels.BLOCK_OPTIONS
    assert kernels.BLOCK_ROUTE[-1][0] is None
    assert all(option in kernels.BLOCK_OPTIONS for _, option in kernels.BLOCK_ROUTE)
    with pytest.raises(ValueError, match="unknown option"):
        kernels.block_route(100, True, True, ((None, "cutlass"),))
    with pytest.raises(ValueError, match="gemv serves"):
        kernels.block_route(100, True, True, ((None, "gemv"),))
    with pytest.raises(ValueError, match=">= 0"):
        kernels.block_route(-1, True, True)


def test_tma_config_table_names_known_configs():
    from specdeploy.engine.kernels import fp8_tma

    assert fp8_tma.TMA_CONFIG_BY_M[-1][0] is None
    for m in (1, 16, 256, 257, 8192):
        block_m, block_n, group_m, warps, stages = fp8_tma.config_for(m)
        assert block_m >= 16 and block_n >= 16 and warps in (4, 8) and stages >= 2
    assert fp8_tma.config_for(8192) == fp8_tma.TMA_CONFIGS[fp8_tma.TMA_CONFIG_BY_M[-1][1]]


def test_allocator_is_set_per_thread_and_kept_where_set():
    """Triton keeps its allocator per context: a new thread has none until the kernel's launch
    sets one there; an allocator someone else set stays."""
    import contextvars
    import threading

    import triton
    from triton.runtime import _allocation

    from specdeploy.engine.kernels import fp8_tma

    def in_thread(results):
        results.append(isinstance(_allocation._allocator.get(), _allocation.NullAllocator))
        fp8_tma.ensure_allocator()
        results.append(_allocation._allocator.get() is fp8_tma._torch_scratch)

    def other(size, alignment, stream):
        raise AssertionError("not called")

    def keeps_other(results):
        triton.set_allocator(other)
        fp8_tma.ensure_allocator()
        results.append(_allocation._allocator.get() is other)

    for target in (in_thread, keeps_other):
        results: list = []
        thread = threading.Thread(target=contextvars.Context().run, args=(target, results))
        thread.start()
        thread.join()
        assert results and all(results), (target.__name__, results)
