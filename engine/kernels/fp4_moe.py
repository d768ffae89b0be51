"""Triton grouped GEMM for DeepSeek-V4's FP4 routed experts (engine/models/deepseek_v4.py _Experts;
CUDA only: the torch code there runs elsewhere and is what this kernel is held to).

The weights stay as stored: e2m1 pairs [E, N, K / 2] (element 2j in the low nibble, 2j + 1 in the
high) and E8M0 scale bytes [E, N, K / 32] (value = e2m1 x 2^(bits - 127)). Each program loads the
codes [BN, BK / 2] and scale bytes of one expert, builds bf16 weights in registers and accumulates
tl.dot in float32: no dequantized copy of any weight is ever written, so a step reads 0.53 bytes
per weight it uses, against 2 in bf16.

A weight costs a few instructions: a nibble s e1 e0 m is placed into an e4m3 byte as
s << 7 | e1 e0 m << 2, whose value is e2m1 x 2^-6 for every code (em = 1, the 0.5, lands on the
e4m3 subnormal 4/8 x 2^-6), converted to bf16 by the hardware; the scale 2^(bits - 121) then
multiplies either the bf16 weights (exact: a power of two times a normal bf16) or, config's
group_dot, each 32-weight group's float32 partial dot. Exact for scale bits 2 .. 248 (checkpoints'
scales lie well inside). The low and high nibbles are never interleaved: K is permuted instead, the
low weights of bytes j meet activation columns 2j and the high ones 2j + 1 (two stride-2 loads of
the small activation tile), so a block is dot(x_even, lo^T) + dot(x_odd, hi^T).

Two ways to map programs to rows, both with a grid fixed by the call's shapes (no host sync, so
CUDA graphs capture them):
    gathered  a tile per row r (expert ids[r], activation row r // topk): decode, fewer rows than
              experts, so nothing to sort; a row's weights are read once per row
    grouped   rows sorted by expert; tile t covers rows [start_t, end_t) of expert_t, a map built
              on the device (tile_map) for a grid of cdiv(R, BM) + min(E, R) tiles, an upper bound
              of sum over experts of cdiv(rows_e, BM); the programs past the real tiles exit
The gate/up projection can finish with the experts' activation (act=True: output column n is
silu(min(g_n, limit)) x clamp(u_n, -limit, limit) with g_n row n and u_n row N + n of the codes),
the down projection with the routing weight (row_weight: the output row times its weight).

Configs: CONFIGS names block shapes; choose_config picks one by (rows, N, K) from a fixed table
(no autotuning, which could not run inside a graph capture). bench/fp4_moe_bench.py times every
config at the V4-Flash expert shapes.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

GROUP = 32  # weights per E8M0 scale
# _halves builds e2m1 x 2^-6 (the e4m3 bytes' bias); a scale byte b then multiplies by 2^(b - 127 + 6)
SCALE_BIAS = tl.constexpr(6)


class Config(NamedTuple):
    bm: int
    bn: int
    bk: int
    warps: int
    stages: int
    group_dot: bool = False  # scales on each group's float32 partial (K 16 dots), else on the weights
    ptx: bool = False        # the weights built by inline PTX, four code bytes a step (GPU only)


CONFIGS = {
    "m16n16k128": Config(16, 16, 128, 4, 4),
    "m16n32k128": Config(16, 32, 128, 4, 4),
    "m16n32k256": Config(16, 32, 256, 4, 3),
    "m16n64k128": Config(16, 64, 128, 4, 3),
    "m16n64k256": Config(16, 64, 256, 8, 3),
    "m16n32k128g": Config(16, 32, 128, 4, 4, True),
    "m16n64k128g": Config(16, 64, 128, 4, 3, True),
    "m16n64k256g": Config(16, 64, 256, 8, 3, True),
    "m16n32k128p": Config(16, 32, 128, 4, 4, False, True),
    "m16n64k128p": Config(16, 64, 128, 4, 3, False, True),
    "m16n32k128gp": Config(16, 32, 128, 4, 4, True, True),
    "m16n64k128gp": Config(16, 64, 128, 4, 3, True, True),
    "m16n64k256gp": Config(16, 64, 256, 8, 3, True, True),
    "m32n64k128": Config(32, 64, 128, 4, 3),
    "m64n64k128": Config(64, 64, 128, 4, 3),
    "m64n128k64": Config(64, 128, 64, 8, 3),
}
# (most rows per expert on average, config): the first whose bound holds. Decode (a row or two
# per expert) streams weights with narrow BN for many programs; prefill tiles grow with the rows.
# Up to two rows per expert (V4-Flash decode at batch 1-64: 6 of 256 experts a token) the sweep's
# fastest at every batch was m16n64k128gp (H200, bench/fp4_moe_bench.py at e05fd9d,
# docs/benchmarks/runs/2026-12-02-final/fp4_moe.json: 0.123 ms at batch 1 against 0.179 ms in bf16,
# 2.99 against 3.39 ms at batch 64); the larger buckets are not yet measured.
CONFIG_TABLE = ((2, "m16n64k128gp"), (16, "m16n64k128"), (48, "m32n64k128"), (None, "m64n128k64"))
# The tile map by rows R over E experts: a tile per row while R <= GATHERED_MAX_FRACTION x E, rows
# sorted by expert above. A tile per row reads an expert's weights once per row that uses it; the
# sorted map reads each hit expert's once but costs the map's launches (argsort, cumsums,
# searchsorted: ~8 small kernels). At V4-Flash's 256 experts, 6 a token, a random batch of 32
# (192 rows) hits ~135 experts: the per-row map reads 1.42x the weights, and ran at 0.94x bf16
# there while the sorted map at batch 64 ran at 1.13x (bench/fp4_moe_bench.py at e05fd9d).
# bench/fp4_moe_bench.py times both maps at every batch ("map_ms").
GATHERED_MAX_FRACTION = 0.25


def gathered_map(rows: int, num_experts: int) -> bool:
    """Whether a call of `rows` (token, expert) rows over `num_experts` experts takes a tile per row."""
    return rows <= GATHERED_MAX_FRACTION * num_experts


def choose_config(rows: int, n: int, k: int, num_experts: int, cuda: bool = True) -> str:
    """The config for `rows` (token, expert) rows over `num_experts` experts of [N, K] weights;
    off CUDA (Triton's interpreter) a PTX config's twin that builds the same weights in Triton."""
    if rows < 0 or n <= 0 or k <= 0 or num_experts <= 0:
        raise ValueError(f"bad shapes rows={rows} n={n} k={k} experts={num_experts}")
    per_expert = rows / min(num_experts, max(rows, 1))
    for bound, name in CONFIG_TABLE:
        if bound is None or per_expert <= bound:
            return name if cuda or not CONFIGS[name].ptx else name.removesuffix("p")
    raise AssertionError("CONFIG_TABLE ends with an unbounded row")


# _halves on four code bytes at once (one 32-bit register): the e4m3 placement on the packed
# word, then e4m3x2 -> f16x2 -> f32 -> bf16x2 (exact: the values are normal f16 and bf16 numbers);
# outputs $0 $1 the low nibbles' bf16 (elements 0 1, 2 3), $2 $3 the high nibbles'.
_HALVES_HEAD = """{
.reg .b32 t, l, h, f;
.reg .b16 p<4>, q<2>;
.reg .f32 a, b;
and.b32 t, $4, 0x07070707;
shl.b32 l, t, 2;
and.b32 t, $4, 0x08080808;
shl.b32 t, t, 4;
or.b32 l, l, t;
shr.u32 t, $4, 2;
and.b32 t, t, 0x1C1C1C1C;
and.b32 h, $4, 0x80808080;
or.b32 h, h, t;
mov.b32 {p0, p1}, l;
mov.b32 {p2, p3}, h;
"""
# one e4m3 pair -> one bf16x2 output, for each of the four pairs p0..p3 (outputs $0..$3)
_HALVES_CVT = """cvt.rn.f16x2.e4m3x2 f, p{i};
mov.b32 {{q0, q1}}, f;
cvt.f32.f16 a, q0;
cvt.f32.f16 b, q1;
cvt.rn.bf16x2.f32 ${i}, b, a;
"""
_HALVES_PTX = tl.constexpr(_HALVES_HEAD + "".join(_HALVES_CVT.format(i=i) for i in range(4)) + "}")


@triton.jit
def _halves(c, PTX: tl.constexpr):
    """bf16 (lo, hi) of code bytes c (uint8): the low and high nibbles' e2m1 values times 2^-6,
    placed as e4m3 bytes (sign to bit 7, exponent and mantissa to bits 2..4) and converted
    (PTX: four bytes a step in inline PTX, else elementwise Triton; the same values)."""
    if PTX:
        return tl.inline_asm_elementwise(_HALVES_PTX, "=r,=r,=r,=r,r", [c], dtype=(tl.bfloat16, tl.bfloat16),
                                         is_pure=True, pack=4)
    lo = ((c & 0x08) << 4) | ((c & 0x07) << 2)
    hi = (c & 0x80) | ((c >> 2) & 0x1C)
    return (lo.to(tl.float8e4nv, bitcast=True).to(tl.bfloat16),
            hi.to(tl.float8e4nv, bitcast=True).to(tl.bfloat16))


@triton.jit
def _dot_block(acc, x_even, x_odd, codes_ptr, bits_ptr, n, kb, n_ok, kb_ok, stride_cn, stride_sn,
               GROUP: tl.constexpr, PTX: tl.constexpr):
    """acc + the block's x @ W^T, W's scales applied to the weights: code bytes kb of rows n."""
    ok = n_ok[:, None] & kb_ok[None, :]
    c = tl.load(codes_ptr + n[:, None] * stride_cn + kb[None, :], mask=ok, other=0)
    b = tl.load(bits_ptr + n[:, None] * stride_sn + (kb // (GROUP // 2))[None, :], mask=ok, other=0)
    scale = (((b.to(tl.int32) + SCALE_BIAS) << 23).to(tl.float32, bitcast=True)).to(tl.bfloat16)
    lo, hi = _halves(c, PTX)
    acc = tl.dot(x_even, tl.trans(lo * scale), acc)
    return tl.dot(x_odd, tl.trans(hi * scale), acc)


@triton.jit
def _dot_group(acc, x_even, x_odd, codes_ptr, bits_ptr, n, kb, g, n_ok, kb_ok, g_ok, stride_cn, stride_sn,
               PTX: tl.constexpr):
    """acc + one scale group's x @ W^T, the scale applied to the float32 partial: code bytes kb
    (GROUP / 2 of them) of rows n, group g (g_ok [BN]: the group lies inside K)."""
    c = tl.load(codes_ptr + n[:, None] * stride_cn + kb[None, :], mask=n_ok[:, None] & kb_ok[None, :], other=0)
    b = tl.load(bits_ptr + n * stride_sn + g, mask=n_ok & g_ok, other=0)
    scale = ((b.to(tl.int32) + SCALE_BIAS) << 23).to(tl.float32, bitcast=True)
    lo, hi = _halves(c, PTX)
    part = tl.dot(x_even, tl.trans(lo))
    part = tl.dot(x_odd, tl.trans(hi), part)
    return acc + part * scale[None, :]


@triton.jit
def _fp4_moe_kernel(x_ptr, src_ptr, ids_ptr, start_ptr, end_ptr, codes_ptr, bits_ptr, out_ptr, weight_ptr,
                    N, K, stride_xm, stride_ce, stride_cn, stride_se, stride_sn, stride_om, limit,
                    GATHERED: tl.constexpr, TOPK: tl.constexpr, ACT: tl.constexpr, LIMIT: tl.constexpr,
                    WEIGHTED: tl.constexpr, GROUP: tl.constexpr, GROUP_DOT: tl.constexpr, PTX: tl.constexpr,
                    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    tile = tl.program_id(0)
    expert = tl.load(ids_ptr + tile).to(tl.int64)
    if GATHERED:
        start = tile
        end = tile + 1
    else:
        start = tl.load(start_ptr + tile)
        end = tl.load(end_ptr + tile)
    if start >= end:
        return
    rows = start + tl.arange(0, BM)
    r_ok = rows < end
    if GATHERED:
        src = rows // TOPK
    else:
        src = tl.load(src_ptr + rows, mask=r_ok, other=0)
    x_rows = x_ptr + src.to(tl.int64)[:, None] * stride_xm
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    n_ok = n < N
    codes = codes_ptr + expert * stride_ce
    bits = bits_ptr + expert * stride_se
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    if ACT:
        acc_up = tl.zeros((BM, BN), dtype=tl.float32)
    KB = K // 2
    # K permuted (the dot is order-free): byte j's low nibble meets x[:, 2j], its high x[:, 2j + 1]
    for k0 in range(0, KB, BK // 2):
        if GROUP_DOT:
            for gi in tl.static_range(BK // GROUP):
                g0 = k0 + gi * (GROUP // 2)                     # the group's first code byte
                kb = g0 + tl.arange(0, GROUP // 2)
                kb_ok = kb < KB
                g_ok = (g0 + tl.zeros((BN,), tl.int32)) < KB
                x_ok = r_ok[:, None] & kb_ok[None, :]
                x_even = tl.load(x_rows + 2 * kb[None, :], mask=x_ok, other=0.0)
                x_odd = tl.load(x_rows + 2 * kb[None, :] + 1, mask=x_ok, other=0.0)
                g = g0 // (GROUP // 2)
                acc = _dot_group(acc, x_even, x_odd, codes, bits, n, kb, g, n_ok, kb_ok, g_ok, stride_cn, stride_sn, PTX)
                if ACT:
                    acc_up = _dot_group(acc_up, x_even, x_odd, codes, bits, n + N, kb, g, n_ok, kb_ok, g_ok,
                                        stride_cn, stride_sn, PTX)
        else:
            kb = k0 + tl.arange(0, BK // 2)
            kb_ok = kb < KB
            x_ok = r_ok[:, None] & kb_ok[None, :]
            x_even = tl.load(x_rows + 2 * kb[None, :], mask=x_ok, other=0.0)
            x_odd = tl.load(x_rows + 2 * kb[None, :] + 1, mask=x_ok, other=0.0)
            acc = _dot_block(acc, x_even, x_odd, codes, bits, n, kb, n_ok, kb_ok, stride_cn, stride_sn, GROUP, PTX)
            if ACT:
                acc_up = _dot_block(acc_up, x_even, x_odd, codes, bits, n + N, kb, n_ok, kb_ok, stride_cn,
                                    stride_sn, GROUP, PTX)
    if ACT:
        gate = acc
        up = acc_up
        if LIMIT:
            gate = tl.minimum(gate, limit)
            up = tl.minimum(tl.maximum(up, -limit), limit)
        acc = gate * tl.sigmoid(gate) * up
    if WEIGHTED:
        acc = acc * tl.load(weight_ptr + rows, mask=r_ok, other=0.0).to(tl.float32)[:, None]
    out = out_ptr + rows.to(tl.int64)[:, None] * stride_om + n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=r_ok[:, None] & n_ok[None, :])


def max_tiles(rows: int, num_experts: int, bm: int) -> int:
    """Upper bound of sum over experts of cdiv(rows_e, bm), the rows_e summing to `rows`."""
    return triton.cdiv(rows, bm) + min(num_experts, rows)


def tile_map(ids: torch.Tensor, num_experts: int, bm: int) -> tuple[torch.Tensor, ...]:
    """ids [R] (each row's expert) -> (order [R]: rows sorted by expert, stable; tile_expert,
    tile_start, tile_end [max_tiles] int64: tile t covers sorted rows [start, end) of its expert,
    empty past the real tiles), all on the device without a host sync. The kernel reads index and
    weight tensors in their own dtypes: no conversion launches."""
    r = ids.numel()
    ids = ids.reshape(-1)
    order = torch.argsort(ids, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=ids.device).scatter_add_(
        0, ids.long(), torch.ones_like(ids, dtype=torch.int64))
    ends = counts.cumsum(0)
    tiles = (counts + bm - 1) // bm
    tile_ends = tiles.cumsum(0)
    t = torch.arange(max_tiles(r, num_experts, bm), device=ids.device)
    expert = torch.searchsorted(tile_ends, t, right=True).clamp_(max=num_experts - 1)
    start = ends[expert] - counts[expert] + (t - tile_ends[expert] + tiles[expert]) * bm
    end = torch.where(t < tile_ends[-1], torch.minimum(ends[expert], start + bm), start)
    return order, expert, start, end


def _check(x: torch.Tensor, codes: torch.Tensor, bits: torch.Tensor, act: bool) -> tuple[int, int]:
    if x.dtype != torch.bfloat16 or x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"x must be a row-major [rows, K] bf16 matrix, got {x.dtype} {tuple(x.shape)}")
    if codes.dim() != 3 or bits.dim() != 3 or codes.stride(-1) != 1 or bits.stride(-1) != 1:
        raise ValueError("codes [E, N, K / 2] and scale bits [E, N, K / 32] must be row-major")
    e, n, kb = codes.shape
    k = 2 * kb
    if x.shape[1] != k or k % GROUP or tuple(bits.shape) != (e, n, k // GROUP):
        raise ValueError(f"shapes x {tuple(x.shape)}, codes {tuple(codes.shape)}, bits {tuple(bits.shape)} "
                         f"disagree (K a multiple of {GROUP})")
    if act and n % 2:
        raise ValueError(f"gate/up codes need an even N, got {n}")
    return (n // 2 if act else n), k


def _launch(x, src, ids, start, end, codes, bits, out, weight, tiles, n, k, limit, gathered, topk, act,
            config: str) -> None:
    cfg = CONFIGS[config]
    if cfg.ptx and x.device.type != "cuda":
        raise ValueError(f"config {config} builds its weights in inline PTX: CUDA only")
    grid = (tiles, triton.cdiv(n, cfg.bn))
    dummy = ids
    _fp4_moe_kernel[grid](
        x, dummy if src is None else src, ids, dummy if start is None else start, dummy if end is None else end,
        codes.view(torch.uint8), bits, out, dummy if weight is None else weight,
        n, k, x.stride(0), codes.stride(0), codes.stride(1), bits.stride(0), bits.stride(1), out.stride(0),
        float(limit or 0.0), GATHERED=gathered, TOPK=topk, ACT=act, LIMIT=bool(limit), WEIGHTED=weight is not None,
        GROUP=GROUP, GROUP_DOT=cfg.group_dot, PTX=cfg.ptx, BM=cfg.bm, BN=cfg.bn, BK=cfg.bk, num_warps=cfg.warps, num_stages=cfg.stages)


def fp4_moe_gathered(x: torch.Tensor, ids: torch.Tensor, codes: torch.Tensor, bits: torch.Tensor, *,
                     topk: int = 1, act: bool = False, limit: float | None = None,
                     row_weight: torch.Tensor | None = None, config: str | None = None) -> torch.Tensor:
    """Row r = x[r // topk] through expert ids[r]'s weights: x [T, K] bf16, ids [R = T topk] ->
    [R, N] (act: [R, N / 2], the activation of the gate/up halves; row_weight [R]: times it)."""
    n, k = _check(x, codes, bits, act)
    ids = ids.reshape(-1)
    r = ids.numel()
    if r != x.shape[0] * topk:
        raise ValueError(f"{r} rows for {x.shape[0]} activation rows x topk {topk}")
    out = torch.empty(r, n, dtype=x.dtype, device=x.device)
    if r:
        cfg = config or choose_config(r, n, k, codes.shape[0], x.device.type == "cuda")
        weight = None if row_weight is None else row_weight.reshape(-1)
        _launch(x, None, ids, None, None, codes, bits, out, weight, r, n, k, limit, True, topk, act, cfg)
    return out


def fp4_moe_grouped(x: torch.Tensor, src: torch.Tensor, tiles: tuple[torch.Tensor, ...], codes: torch.Tensor,
                    bits: torch.Tensor, *, act: bool = False, limit: float | None = None,
                    row_weight: torch.Tensor | None = None, config: str) -> torch.Tensor:
    """Sorted row i = x[src[i]] through its tile's expert: src [R], tiles (expert, start, end) of
    tile_map at `config`'s BM -> [R, N] (act, row_weight: as fp4_moe_gathered)."""
    n, k = _check(x, codes, bits, act)
    r = src.numel()
    out = torch.empty(r, n, dtype=x.dtype, device=x.device)
    expert, start, end = tiles
    if r:
        weight = None if row_weight is None else row_weight.reshape(-1)
        _launch(x, src.reshape(-1), expert, start, end, codes, bits, out, weight, expert.numel(), n, k,
                limit, False, 1, act, config)
    return out


def fp4_moe(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: tuple[torch.Tensor, torch.Tensor],
            down: tuple[torch.Tensor, torch.Tensor], limit: float | None = None, gathered: bool | None = None,
            configs: tuple[str, str] | None = None) -> torch.Tensor:
    """The routed experts' sum: x [T, H] bf16, ids / weights [T, k] (local expert ids), gate_up
    (codes [E, 2I, H / 2], bits) and down (codes [E, H, I / 2], bits) -> [T, H] = sum over j of
    weights[t, j] down_e(act(gate_up_e(x[t]))) with e = ids[t, j]. gathered: a tile per row (None:
    gathered_map's choice); configs: (gate/up, down) config names (None: choose_config)."""
    t, topk = ids.shape
    e = gate_up[0].shape[0]
    r = t * topk
    if gathered is None:
        gathered = gathered_map(r, e)
    i, h = gate_up[0].shape[1] // 2, down[0].shape[1]
    cuda = x.device.type == "cuda"
    c_up, c_down = configs or (choose_config(r, i, x.shape[1], e, cuda), choose_config(r, h, i, e, cuda))
    if gathered:
        act = fp4_moe_gathered(x, ids, *gate_up, topk=topk, act=True, limit=limit, config=c_up)
        ys = fp4_moe_gathered(act, ids, *down, row_weight=weights, config=c_down)
        return ys.view(t, topk, h).sum(1)
    flat = ids.reshape(-1)
    order, *tiles_up = tile_map(flat, e, CONFIGS[c_up].bm)
    token = order // topk
    act = fp4_moe_grouped(x, token, tiles_up, *gate_up, act=True, limit=limit, config=c_up)
    tiles_down = tiles_up if CONFIGS[c_down].bm == CONFIGS[c_up].bm else tile_map(flat, e, CONFIGS[c_down].bm)[1:]
    ys = fp4_moe_grouped(act, torch.arange(r, device=x.device), tiles_down, *down,
                         row_weight=weights.reshape(-1)[order], config=c_down)
    # back to (token, slot) order, then the slots' sum: deterministic (index_add_ over repeated
    # tokens adds in an arbitrary order on CUDA) and rounded once, as the gathered path
    return ys.new_empty(ys.shape).index_copy_(0, order, ys).view(t, topk, h).sum(1)
