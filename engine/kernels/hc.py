"""Triton kernels for the hyper-connection (mHC) residual of hc_mult > 1 models (engine/models/hc.py;
CUDA only: hc.py calls them where no autograd is involved and runs its torch code otherwise).

The torch code of one sublayer's mixing is about a hundred kernel launches, most of them the
Sinkhorn iterations over a [hc, hc] matrix per token; at decode and verify sizes each costs a
launch (a few microseconds) and moves almost nothing. Here the whole residual of a sublayer is
two launches around the mixes projection (one cuBLAS matmul on the float32 streams):

    hc_pre     per token: 1 / rms of the flattened streams, the pre / post gates, Sinkhorn on the
               comb logits in registers, and the collapse of the streams into the sublayer input
               (or, for the head after the last block, the pre gate and the collapse only)
    hc_expand  per token and column block: post ⊗ sublayer output + combᵀ · streams, cast once

Everything is float32 with the torch code's casts in the same places, so the results agree with
it up to the order of float32 sums.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Columns one program handles at a time: hc_pre (one program per token) walks the flattened
# streams in PRE_BLOCK steps; hc_expand spreads each token's columns over EXPAND_BLOCK-wide programs.
PRE_BLOCK = 1024
EXPAND_BLOCK = 1024


@triton.jit
def _hc_pre_kernel(streams_ptr, mixes_ptr, base_ptr, scale_ptr, pre_ptr, post_ptr, comb_ptr, x_ptr,
                   hidden, hc, num_mixes, sinkhorn_iters, norm_eps, hc_eps,
                   HEAD: tl.constexpr, HC_P: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    row = streams_ptr + t * hc * hidden
    # 1 / rms over the flattened streams [hc * H], in float32.
    width = hc * hidden
    cols = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, width, BLOCK):
        v = tl.load(row + start + cols, mask=start + cols < width, other=0.0).to(tl.float32)
        acc += v * v
    inv_rms = 1.0 / tl.sqrt(tl.sum(acc, 0) / width + norm_eps)

    i = tl.arange(0, HC_P)
    valid = i < hc
    mixes = mixes_ptr + t * num_mixes
    # pre = sigmoid(mix * scale[0] + base) + eps
    pre = tl.load(mixes + i, mask=valid, other=0.0) * inv_rms
    pre = tl.sigmoid(pre * tl.load(scale_ptr) + tl.load(base_ptr + i, mask=valid, other=0.0)) + hc_eps
    pre = tl.where(valid, pre, 0.0)
    tl.store(pre_ptr + t * hc + i, pre, mask=valid)
    if not HEAD:
        # post = 2 * sigmoid(mix * scale[1] + base)
        post = tl.load(mixes + hc + i, mask=valid, other=0.0) * inv_rms
        post = 2.0 * tl.sigmoid(post * tl.load(scale_ptr + 1) + tl.load(base_ptr + hc + i, mask=valid, other=0.0))
        tl.store(post_ptr + t * hc + i, post, mask=valid)
        # comb: Sinkhorn on [hc, hc] logits (rows i, columns j), as hc.sinkhorn.
        ij = i[:, None] * hc + i[None, :]
        both = valid[:, None] & valid[None, :]
        logits = tl.load(mixes + 2 * hc + ij, mask=both, other=0.0) * inv_rms
        logits = logits * tl.load(scale_ptr + 2) + tl.load(base_ptr + 2 * hc + ij, mask=both, other=0.0)
        logits = tl.where(both, logits, -1e30)  # padded lanes: finite, so no NaN, masked below
        e = tl.exp(logits - tl.max(logits, 1)[:, None])
        comb = tl.where(both, e / tl.sum(e, 1)[:, None] + hc_eps, 0.0)
        comb = comb / (tl.sum(comb, 0)[None, :] + hc_eps)
        for _ in range(sinkhorn_iters - 1):
            comb = comb / (tl.sum(comb, 1)[:, None] + hc_eps)
            comb = comb / (tl.sum(comb, 0)[None, :] + hc_eps)
        tl.store(comb_ptr + t * hc * hc + ij, comb, mask=both)
    # Collapse: x = sum_i pre[i] * S[i], in float32, cast to the streams' dtype.
    for start in range(0, hidden, BLOCK):
        c = start + cols
        m = c < hidden
        s = tl.load(row + i[:, None] * hidden + c[None, :], mask=valid[:, None] & m[None, :],
                    other=0.0).to(tl.float32)
        x = tl.sum(pre[:, None] * s, 0)
        tl.store(x_ptr + t * hidden + c, x.to(x_ptr.dtype.element_ty), mask=m)


@triton.jit
def _hc_expand_kernel(out_ptr, f_ptr, streams_ptr, post_ptr, comb_ptr, hidden, hc,
                      HC_P: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = c < hidden
    j = tl.arange(0, HC_P)
    valid = j < hc
    f = tl.load(f_ptr + t * hidden + c, mask=m, other=0.0).to(tl.float32)
    post = tl.load(post_ptr + t * hc + j, mask=valid, other=0.0)
    written = post[:, None] * f[None, :]                              # [hc (j), BLOCK]
    row = streams_ptr + t * hc * hidden
    carried = tl.zeros([HC_P, BLOCK], dtype=tl.float32)
    for i in range(0, hc):
        s = tl.load(row + i * hidden + c, mask=m, other=0.0).to(tl.float32)
        w = tl.load(comb_ptr + t * hc * hc + i * hc + j, mask=valid, other=0.0)  # comb[i, :]
        carried += w[:, None] * s[None, :]
    out = (written + carried).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + t * hc * hidden + j[:, None] * hidden + c[None, :], out,
             mask=valid[:, None] & m[None, :])


def _rows(streams: torch.Tensor) -> torch.Tensor:
    hc, h = streams.shape[-2:]
    return streams.reshape(-1, hc, h).contiguous()


def hc_pre(streams: torch.Tensor, mixes: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
           sinkhorn_iters: int, norm_eps: float, hc_eps: float, head: bool = False):
    """streams [*, hc, H]; mixes [*, M] = flatten(streams).float() @ fnᵀ (not yet scaled by the
    rms); base [M], scale [3] (float32) -> (x [*, H] in the streams' dtype, pre [*, hc],
    post [*, hc], comb [*, hc, hc]) as HyperConnection. head=True (HyperHead: M = hc, scale [1])
    -> (x, pre, None, None)."""
    lead, (hc, h) = streams.shape[:-2], streams.shape[-2:]
    rows = _rows(streams)
    t = rows.shape[0]
    mix = mixes.reshape(t, mixes.shape[-1]).float().contiguous()
    dev = streams.device
    x = torch.empty(t, h, dtype=streams.dtype, device=dev)
    pre = torch.empty(t, hc, dtype=torch.float32, device=dev)
    post = None if head else torch.empty(t, hc, dtype=torch.float32, device=dev)
    comb = None if head else torch.empty(t, hc, hc, dtype=torch.float32, device=dev)
    if t:
        _hc_pre_kernel[(t,)](rows, mix, base, scale, pre, pre if head else post, pre if head else comb, x,
                             h, hc, mix.shape[1], sinkhorn_iters, norm_eps, hc_eps, HEAD=head,
                             HC_P=triton.next_power_of_2(hc), BLOCK=min(PRE_BLOCK, triton.next_power_of_2(h)))
    if head:
        return x.view(*lead, h), pre.view(*lead, hc), None, None
    return x.view(*lead, h), pre.view(*lead, hc), post.view(*lead, hc), comb.view(*lead, hc, hc)


def hc_expand(sublayer_out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor,
              comb: torch.Tensor) -> torch.Tensor:
    """New streams [*, hc, H] = post ⊗ sublayer_out + combᵀ · streams, as hc.hc_expand."""
    hc, h = streams.shape[-2:]
    rows = _rows(streams)
    t = rows.shape[0]
    f = sublayer_out.reshape(t, h).contiguous()
    out = torch.empty_like(rows)
    if t:
        block = min(EXPAND_BLOCK, triton.next_power_of_2(h))
        _hc_expand_kernel[(t, triton.cdiv(h, block))](
            out, f, rows, post.reshape(t, hc).contiguous(), comb.reshape(t, hc, hc).contiguous(),
            h, hc, HC_P=triton.next_power_of_2(hc), BLOCK=block)
    return out.view(streams.shape)
