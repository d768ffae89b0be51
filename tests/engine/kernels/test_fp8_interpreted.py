"""The FP8 Triton kernels (engine/kernels/fp8.py, used on CUDA only) on CPU through Triton's
interpreter (tests/engine/conftest.py): activation quantization code for code against
DeepSeek's definition in torch, and both linear paths (weight-only decode, W8A8 prefill) against
float32 matmuls over the dequantized weights, for every scale layout the engine uses; the
slot-pool attention kernel over an e4m3 KV pool with per-layer scales against the reference;
and the block-scaled route's choices by M (block_route)."""

import pytest

pytest.importorskip("triton")

from fp8_interpreter import FP8_CAST  # noqa: E402  (tests/support)

SCRIPT = FP8_CAST + r"""
import torch.nn.functional as F

from specdeploy.engine.kernels import fp8 as kernels
from specdeploy.engine.models import fp8

torch.manual_seed(0)

# activation quantization: the same codes and scales as the torch definition
for m, k, round_scale in [(3, 300, False), (2, 4096, True), (1, 128, False), (0, 256, False), (37, 1000, True)]:
    x = torch.randn(m, k) * 3
    if m > 1:
        x[1, :128] = 0.0
    y, s = kernels.act_quant(x, round_scale)
    want_y, want_s = fp8.act_quant_reference(x, 128, round_scale)
    assert torch.equal(s, want_s), (m, k, (s - want_s).abs().max())
    assert torch.equal(y.view(torch.uint8), want_y.view(torch.uint8)), (m, k)
    # the layout cuBLASLt's 1x128 block scaling reads: the same scales, M-fastest
    y_t, s_t = kernels.act_quant(x, round_scale, column_major=True)
    assert torch.equal(s_t, want_s) and (m < 2 or s_t.stride() == (1, m)), (m, k, s_t.stride())
    assert torch.equal(y_t.view(torch.uint8), want_y.view(torch.uint8)), (m, k)
    # rows padded to a multiple of 16 for cuBLASLt: the real rows as above, codes 0 and scales 1 after
    y_p, s_p = kernels.act_quant(x, round_scale, column_major=True, pad_rows_to=16)
    rows = -(-m // 16) * 16
    assert y_p.shape[0] == s_p.shape[0] == rows and (rows == 0 or s_p.stride() == (1, rows))
    assert torch.equal(s_p[:m], want_s) and torch.equal(y_p[:m].view(torch.uint8), want_y.view(torch.uint8))
    assert (s_p[m:] == 1).all() and (y_p[m:].float() == 0).all()
    # any program tile (rows x groups) quantizes the same: one row of 4 groups, 4 x 8 (past K)
    for tile in ((1, 4), (4, 8)):
        y_g, s_g = kernels.act_quant(x, round_scale, column_major=True, tile=tile)
        assert torch.equal(s_g, want_s) and torch.equal(y_g.view(torch.uint8), want_y.view(torch.uint8)), tile

def layouts(n, k):
    w = torch.randn(n, k) * 0.05
    codes, grid = fp8.quantize_fp8_block(w, (128, 128))
    yield "block", w, codes, grid, 128
    # fused parts whose blocks cut across rows: one scale row per output row
    yield "rows", w, codes, grid.repeat_interleave(128, 0)[:n].contiguous(), 1
    codes, per_row = fp8.quantize_fp8_channel(w)
    yield "channel", w, codes, per_row.reshape(-1).contiguous(), 1
    single = (w.abs().max() / 448).reshape(1)
    yield "tensor", w, (w / single).to(torch.float8_e4m3fn), single, 1

def dequantized(codes, scale, scale_n):
    return codes.float() * fp8.expand_scale(scale, tuple(codes.shape), scale_n, 128)

# N and K not multiples of 128 (partial tiles and scale blocks), every layout; then whole blocks,
# a second M tile of the prefill kernel.
cases = [(200, 300, kind, m) for kind in ("block", "rows", "channel", "tensor") for m in (1, 40, 70)]
cases += [(64, 256, "block", m) for m in (17, 130)]
for n, k, want_kind, m in cases:
    kind, w, codes, scale, scale_n = next(c for c in layouts(n, k) if c[0] == want_kind)
    bias = torch.randn(n)
    wd = dequantized(codes, scale, scale_n)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(m, k).to(dtype)
        got = kernels.fp8_linear(x, codes, scale, scale_n, bias if m % 2 else None)
        assert got.dtype == dtype and got.shape == (m, n)
        b = bias if m % 2 else torch.zeros(n)
        if m <= kernels.DECODE_MAX_M:
            # weight-only: exact products, float32 sums, one rounding to the output dtype
            want = F.linear(x.float(), wd, b)
        else:
            # W8A8: the activations quantized as DeepSeek does, then exact products
            xq, xs = fp8.act_quant_reference(x.float())
            want = F.linear(xq.float() * xs.repeat_interleave(128, 1)[:, :k], wd, b)
            # and within the quantization error of the unquantized product
            exact = F.linear(x.float(), wd, b)
            rel = (got.float() - exact).norm() / exact.norm()
            assert rel < 0.05, (kind, m, rel)
        tol = 1e-5 if dtype == torch.float32 else 2 ** -8
        err = (got.float() - want).abs()
        assert (err <= tol * want.abs() + tol * want.abs().max() * 0.05 + 1e-5).all(), (
            kind, n, k, m, dtype, err.max())
print("ok")
"""


def test_fp8_kernels_match_torch_interpreted(run_interpreted):
    run_interpreted(SCRIPT)


KV_SCRIPT = FP8_CAST + r"""
import torch
from specdeploy.engine.kernels import attention as attention_triton
from specdeploy.engine.models.attention import AttnBatch, reference, store_kv

torch.manual_seed(0)
SLOTS = 300
for b, nq, hq, hkv, d, width, lens, splits, dtype, scales in [
        (2, 1, 8, 2, 32, 150, [150, 70], None, torch.bfloat16, (0.05, 0.1)),   # decode, chosen splits
        (2, 5, 4, 2, 16, 40, [0, 40], 1, torch.float32, (1.0, 1.0)),           # tree rows, one split
        (1, 3, 4, 4, 16, 90, [90], 2, torch.bfloat16, (0.5, 2.0))]:            # MHA, two splits
    k = store_kv(3 * torch.randn(SLOTS, hkv, d), torch.float8_e4m3fn, scales[0])
    v = store_kv(3 * torch.randn(SLOTS, hkv, d), torch.float8_e4m3fn, scales[1])
    q = torch.randn(b, nq, hq, d).to(dtype)
    prefix = torch.randint(1, SLOTS, (b, width))
    new = torch.randint(1, SLOTS, (b, nq))
    mask = (torch.rand(b, nq, nq) < 0.5).tril() | torch.eye(nq, dtype=torch.bool)
    batch = AttnBatch(new, prefix, torch.tensor(lens), new, mask)
    # the reference over the same codes, read back in float32
    want = reference(q.float(), k, v, batch, 0.3, scales)
    got = attention_triton.attend(q, k, v, batch, 0.3, num_splits=splits, kv_scales=scales)
    assert got.dtype == dtype
    # bf16: q, the widened codes and P rounded to bf16, the output too: relative to its size
    tol = 1e-5 if dtype == torch.float32 else 2e-2 * want.abs().max().item()
    diff = (want - got.float()).abs().max().item()
    assert diff < tol, (b, nq, splits, dtype, scales, diff)

# rope + K/V writes into an e4m3 pool in one launch: the codes the torch path writes
from specdeploy.engine.kernels import elementwise
from specdeploy.engine.models.layers import apply_rope
for dtype in (torch.float32, torch.bfloat16):
    b, q_len, hq, hkv, d = 2, 3, 4, 2, 16
    qkv = (3 * torch.randn(b, q_len, (hq + 2 * hkv) * d)).to(dtype)
    ang = torch.rand(b, q_len, d // 2).repeat(1, 1, 2) * 6
    cos, sin = ang.cos().to(dtype), ang.sin().to(dtype)
    slots = (torch.randperm(49)[:b * q_len] + 1).reshape(b, q_len)  # distinct slots
    k_pool = torch.zeros(50, hkv, d, dtype=torch.float8_e4m3fn)
    v_pool = torch.zeros_like(k_pool)
    q = elementwise.rope_store(qkv, cos, sin, k_pool, v_pool, slots, hq, hkv, (0.02, 0.5))
    qk = apply_rope(qkv[..., :(hq + hkv) * d].view(b, q_len, hq + hkv, d), cos, sin)
    want_q, want_k = qk.split((hq, hkv), dim=2)
    want_v = qkv[..., (hq + hkv) * d:].view(b, q_len, hkv, d)
    assert torch.equal(q, want_q), dtype
    assert torch.equal(k_pool[slots].view(torch.uint8), store_kv(want_k, torch.float8_e4m3fn, 0.02).view(torch.uint8))
    assert torch.equal(v_pool[slots].view(torch.uint8), store_kv(want_v, torch.float8_e4m3fn, 0.5).view(torch.uint8))
print("ok")
"""


def test_attention_over_an_fp8_pool_interpreted(run_interpreted):
    run_interpreted(KV_SCRIPT)


def test_torch_block_route_takes_only_the_layout_cublaslt_reads():
    """torch's block-scaled GEMM reads codes and 128x128 scales in place: row-major codes, K a
    multiple of 512, N of 128, one float32 scale per tile; anything else stays on the Triton kernels."""
    import torch

    from specdeploy.engine.kernels import fp8 as kernels
    from specdeploy.engine.models import fp8

    def block(n, k):
        return fp8.quantize_fp8_block(torch.randn(n, k) * 0.05, (128, 128))

    codes, grid = block(256, 1024)
    assert kernels.torch_block_shape_ok(codes, grid, 128)
    assert not kernels.torch_block_shape_ok(codes, grid.repeat_interleave(128, 0).contiguous(), 1)  # a row each
    assert not kernels.torch_block_shape_ok(codes, grid.t().contiguous().t(), 128)  # column-major grid
    assert not kernels.torch_block_shape_ok(*block(256, 384), 128)  # K/128 = 3: unaligned scale rows
    assert not kernels.torch_block_shape_ok(*block(200, 1024), 128)  # a partial N tile
    wide, wide_grid = block(256, 2048)
    assert not kernels.torch_block_shape_ok(wide[:, :1024], wide_grid[:, :8], 128)  # strided codes


def test_block_route_follows_the_table_and_falls_back():
    from specdeploy.engine.kernels import fp8 as kernels
    from specdeploy.engine.kernels import gemv

    def only(*names):
        return lambda option: option in names

    table = ((gemv.GEMV_MAX_M, "gemv"), (1024, "torch_block"), (None, "triton"))
    assert kernels.block_route(1, only("torch_block"), table) == "gemv"
    assert kernels.block_route(gemv.GEMV_MAX_M, only(), table) == "gemv"
    assert kernels.block_route(gemv.GEMV_MAX_M + 1, only("torch_block"), table) == "torch_block"
    assert kernels.block_route(1024, only("torch_block"), table) == "torch_block"
    assert kernels.block_route(1025, only("torch_block"), table) == "triton"
    # torch's block GEMM not available here: the Triton kernels
    assert kernels.block_route(100, only(), table) == "triton"
    # the committed table: the small-M kernel to 4 rows, DeepGEMM above; without DeepGEMM the
    # small-M kernel to 16 rows and torch's block GEMM above, without both the Triton kernels
    both = only("deep_gemm", "torch_block")
    assert kernels.block_route(1, both) == "gemv"
    assert kernels.block_route(4, both) == "gemv"
    assert kernels.block_route(5, both) == "deep_gemm"
    assert kernels.block_route(gemv.GEMV_MAX_M, both) == "deep_gemm"
    assert kernels.block_route(8192, both) == "deep_gemm"
    assert kernels.block_route(5, only("torch_block")) == "gemv"
    assert kernels.block_route(gemv.GEMV_MAX_M, only()) == "gemv"
    assert kernels.block_route(gemv.GEMV_MAX_M + 1, only("torch_block")) == "torch_block"
    assert kernels.block_route(8192, only("deep_gemm")) == "deep_gemm"
    assert kernels.block_route(8192, only()) == "triton"
    # the chain ends at the always-available Triton kernels, each library falling back once
    assert set(kernels.LIBRARY_FALLBACK) | {"triton"} == set(kernels.BLOCK_OPTIONS) - {"gemv"}
    asked = []
    assert kernels.block_route(64, lambda o: asked.append(o) or False) == "triton"
    assert asked == ["deep_gemm", "torch_block"]
    assert kernels.BLOCK_ROUTE[-1][0] is None
    # fp8_linear sends one row straight to the small-M kernel: the table must agree
    assert kernels.BLOCK_ROUTE[0][1] == "gemv" and (kernels.BLOCK_ROUTE[0][0] or 0) >= 1
    assert all(option in kernels.BLOCK_OPTIONS for _, option in kernels.BLOCK_ROUTE)
    with pytest.raises(ValueError, match="unknown option"):
        kernels.block_route(100, both, ((None, "tma"),))
    with pytest.raises(ValueError, match="gemv serves"):
        kernels.block_route(100, both, ((None, "gemv"),))
    with pytest.raises(ValueError, match=">= 0"):
        kernels.block_route(-1, both)
