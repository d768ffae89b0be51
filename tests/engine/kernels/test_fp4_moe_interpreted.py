"""The fused FP4 MoE GEMM (engine/kernels/fp4_moe.py, CUDA only) against float32 references built
from fp8.dequantize_fp4's weights, on CPU through Triton's interpreter (tests/engine/conftest.py):
random rows per expert with experts that get none, rows not a multiple of BM, N and K past a
block, the gate/up activation with its clamp, the routing weights; both tile maps (gathered and
grouped); and _Experts' FP4 forward through the kernel against its torch code.

Tolerance: the kernel multiplies bf16 values exactly and sums in float32, rounding each output once
to bf16, so |got - want| <= 2^-8 |want| + K 2^-22 (|x| @ |W|^T) (float32 summation order);
the full MoE rounds twice more (the activation, and the weighted rows before their sum), a
one-ulp difference in an activation (2^-7 relative) moves the output by at most 2^-7 of its
absolute terms |a| @ |W_down|^T, so there the bound is 2^-6 (|want| + those terms)."""

import pytest
from v4_tiny import TINY

pytest.importorskip("triton")

COMMON = r"""
import torch
from specdeploy.engine.kernels import fp4_moe as K
from specdeploy.engine.models.fp8 import dequantize_fp4

g = torch.Generator().manual_seed(0)

def experts(e, n, k):
    codes = torch.randint(-128, 128, (e, n, k // 2), generator=g, dtype=torch.int8)
    bits = torch.randint(118, 126, (e, n, k // 32), generator=g, dtype=torch.uint8)
    w = torch.stack([dequantize_fp4(codes[j], bits[j], dtype=torch.float32) for j in range(e)])
    return codes, bits, w

def within(got, want, bound, factor, spread):
    err = (got.float() - want).abs()
    tol = factor * want.abs() + spread * bound + 1e-30
    assert bool((err <= tol).all()), float((err / tol).max())

def act_ref(gu, limit):
    gate, up = gu.chunk(2, dim=-1)
    if limit:
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return torch.nn.functional.silu(gate) * up
"""

GEMM = COMMON + r"""
e, h, i = 5, 96, 40                                   # K = 96: past a BK of 64, under 128 and 256
codes, bits, w = experts(e, 2 * i, h)
t, topk = 9, 2
x = torch.randn(t, h, generator=g).to(torch.bfloat16)
ids = torch.randint(0, e - 1, (t, topk), generator=g)  # expert e - 1 gets no rows
ids[0] = 0
ids[1:5] = 2                                          # 8 rows on one expert: tiles of BM 16 hold them
flat = ids.reshape(-1)
xr = x.float()[torch.arange(t * topk) // topk]
want = torch.einsum("rk,rnk->rn", xr, w[flat])
bound = torch.einsum("rk,rnk->rn", xr.abs(), w[flat].abs())
for cfg in ("m16n16k128", "m16n32k256", "m16n32k128g", "m32n64k128", "m64n128k64"):
    got = K.fp4_moe_gathered(x, flat, codes, bits, topk=topk, config=cfg)
    assert got.shape == (t * topk, 2 * i) and got.dtype == torch.bfloat16
    within(got, want, bound, 2**-8, h * 2**-22)
    bm = K.CONFIGS[cfg].bm
    order, *tiles = K.tile_map(flat, e, bm)
    expert, start, end = tiles
    assert expert.numel() == K.max_tiles(t * topk, e, bm)
    real = start < end                                  # every sorted row in exactly one real tile
    cover = torch.zeros(t * topk, dtype=torch.int64)
    for ex, s, n in zip(expert[real].tolist(), start[real].tolist(), end[real].tolist()):
        assert n - s <= bm and bool((flat[order[s:n]] == ex).all())
        cover[s:n] += 1
    assert bool((cover == 1).all())
    got = K.fp4_moe_grouped(x, order // topk, tiles, codes, bits, config=cfg)
    within(got, want[order], bound[order], 2**-8, h * 2**-22)
    # the activation epilogue, with and without the clamp; the routing weight epilogue
    for limit in (None, 0.5):
        got = K.fp4_moe_grouped(x, order // topk, tiles, codes, bits, act=True, limit=limit, config=cfg)
        assert got.shape == (t * topk, i)
        ref = act_ref(want[order], limit)
        # d act: |silu'| <= 1.1 times |up| plus |silu(gate)| <= |gate| + 0.28: the GEMM bound carried
        carried = act_ref(want[order].abs() + 2**-8 * bound[order], None).abs() * 4
        within(got, ref, carried, 2**-8, h * 2**-22)
    rw = torch.rand(t * topk, generator=g)
    got = K.fp4_moe_gathered(x, flat, codes, bits, topk=topk, row_weight=rw, config=cfg)
    within(got, want * rw[:, None], bound * rw[:, None], 2**-8, h * 2**-22)
# empty calls and bad input
assert K.fp4_moe_gathered(x[:0], flat[:0], codes, bits, topk=topk).shape == (0, 2 * i)
for bad in (lambda: K.fp4_moe_gathered(x.float(), flat, codes, bits, topk=topk),
            lambda: K.fp4_moe_gathered(x[:, :64], flat, codes, bits, topk=topk),
            lambda: K.fp4_moe_gathered(x, flat[:3], codes, bits, topk=topk),
            lambda: K.fp4_moe_gathered(x, flat, codes, bits, topk=topk, config="m16n32k128p")):  # PTX: CUDA only
    try:
        bad()
    except ValueError:
        pass
    else:
        raise AssertionError("bad input accepted")
print("ok")
"""

MOE = COMMON + r"""
e, h, i = 6, 64, 96
up_codes, up_bits, w_up = experts(e, 2 * i, h)
down_codes, down_bits, w_down = experts(e, h, i)
for t, topk, gathered in [(2, 2, True), (13, 3, False), (13, 3, True), (1, 4, None)]:
    x = (torch.randn(t, h, generator=g) * 4).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(e - 1, generator=g)[:topk] for _ in range(t)])  # expert e - 1: none
    rw = torch.rand(t, topk, generator=g)
    got = K.fp4_moe(x, ids, rw, (up_codes, up_bits), (down_codes, down_bits), limit=7.0, gathered=gathered,
                    configs=("m16n16k128", "m32n64k128") if gathered else ("m16n32k128g", "m16n64k128g"))
    assert got.shape == (t, h) and got.dtype == torch.bfloat16
    flat = ids.reshape(-1)
    xr = x.float()[torch.arange(t * topk) // topk]
    a = act_ref(torch.einsum("rk,rnk->rn", xr, w_up[flat]), 7.0).to(torch.bfloat16).float()
    y = torch.einsum("rk,rnk->rn", a, w_down[flat]) * rw.reshape(-1, 1)
    bound = torch.einsum("rk,rnk->rn", a.abs(), w_down[flat].abs()) * rw.reshape(-1, 1)
    within(got, y.view(t, topk, h).sum(1), bound.view(t, topk, h).sum(1), 2**-6, 2**-6)
print("ok")
"""

EXPERTS = r"""
import torch
import specdeploy.engine.models.deepseek_v4 as v4mod
from specdeploy.engine.kernels import fp4_moe
from specdeploy.engine.models.deepseek_v4 import V4ModelConfig, _Experts

cfg = V4ModelConfig.from_hf({**TINY, "hidden_size": 64, "moe_intermediate_size": 32, "n_routed_experts": 6})
g = torch.Generator().manual_seed(1)
for tp_rank, tp_size in ((0, 1), (1, 2)):
    m = _Experts(cfg, tp_rank, tp_size).to(torch.bfloat16)
    m.quantize("fp4")
    for name in ("gate_up_proj", "down_proj"):
        getattr(m, name).copy_(torch.randint(-128, 128, getattr(m, name).shape, generator=g, dtype=torch.int8))
        getattr(m, name + "_scale").copy_(torch.randint(119, 124, getattr(m, name + "_scale").shape, generator=g,
                                                         dtype=torch.uint8))
    for t in (1, 5):
        x = torch.randn(t, 64, generator=g).to(torch.bfloat16)
        idx = torch.stack([torch.randperm(6, generator=g)[:2] for _ in range(t)])
        w = torch.rand(t, 2, generator=g).to(torch.bfloat16)
        want = m(x, idx, w).float()                       # the torch code (CPU: no kernel)
        v4mod.fused_kernels = lambda x, *params, ops: fp4_moe if ops is v4mod.kernels.fp4_moe_ops else None
        try:
            got = m(x, idx, w).float()
        finally:
            v4mod.fused_kernels = v4mod.__dict__["_fused_kernels_saved"]
        scale = want.abs().max()
        assert float((got - want).abs().max()) <= 2**-5 * float(scale), (t, tp_rank, float((got - want).abs().max()), float(scale))
print("ok")
"""


def test_fp4_moe_gemm_interpreted(run_interpreted):
    run_interpreted(GEMM)


def test_fp4_moe_layer_interpreted(run_interpreted):
    run_interpreted(MOE)


def test_fp4_experts_forward_through_the_kernel_interpreted(run_interpreted):
    prelude = ("import specdeploy.engine.models.deepseek_v4 as _m\n"
               "_m._fused_kernels_saved = _m.fused_kernels\n")
    run_interpreted(f"TINY = {TINY!r}\n" + prelude + EXPERTS)


def test_choose_config_is_a_table():
    from specdeploy.engine.kernels import fp4_moe

    assert fp4_moe.choose_config(6, 2048, 4096, 256) == fp4_moe.choose_config(1, 4096, 2048, 256)
    # off CUDA a PTX pick becomes its Triton twin: same blocks, same weights, no inline PTX
    on_gpu, off_gpu = fp4_moe.choose_config(6, 2048, 4096, 256), fp4_moe.choose_config(6, 2048, 4096, 256, cuda=False)
    assert not fp4_moe.CONFIGS[off_gpu].ptx
    assert fp4_moe.CONFIGS[off_gpu]._replace(ptx=True) == fp4_moe.CONFIGS[on_gpu]._replace(ptx=True)
    assert fp4_moe.CONFIGS[fp4_moe.choose_config(8192 * 6, 2048, 4096, 256)].bm == 64
    assert {name for _, name in fp4_moe.CONFIG_TABLE} <= set(fp4_moe.CONFIGS)
    with pytest.raises(ValueError):
        fp4_moe.choose_config(4, 0, 4096, 256)
