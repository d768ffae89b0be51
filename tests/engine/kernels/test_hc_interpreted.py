"""The hyper-connection Triton kernels (engine/kernels/hc.py, used on CUDA only) against the
torch code of engine/models/hc.py, on CPU through Triton's interpreter (tests/engine/conftest.py):
the gates, Sinkhorn, the collapse and the expand of a sublayer, and the head."""

import pytest

pytest.importorskip("triton")

SCRIPT = r"""
import torch
import torch.nn.functional as F
from specdeploy.engine.kernels import hc as hc_triton
from specdeploy.engine.models.hc import (HCConfig, HyperConnection, HyperHead, flatten_streams, hc_collapse,
                                  hc_expand)

torch.manual_seed(0)

def close(got, want, dtype, what):
    assert got.dtype == want.dtype and got.shape == want.shape, (what, got.dtype, want.dtype, got.shape)
    if not want.numel():
        return
    diff = (got.float() - want.float()).abs()
    if dtype == torch.float32 or got.dtype == torch.float32:
        # float32 all through: the order of a few float32 sums apart.
        assert diff.max() <= 2e-5 * (1 + want.float().abs().max()), (what, diff.max())
        return
    # bf16 outputs: the same float32 value cast once, so at most one bf16 step apart, and rarely.
    assert (diff > 0).float().mean() < 0.02, (what, (diff > 0).float().mean())
    assert (diff <= want.float().abs() * 2 ** -7 + 1e-6).all(), (what, diff.max())

# hc 4 (DeepSeek-V4), 3 and 2 (padded to a power of two); H not a power of two and wider than a
# block; Sinkhorn's 20 iterations and a single one; token dims [B, Q] and [T]; streams small
# enough (1e-4) that the rms norm's eps weighs; no tokens at all.
for hc, h, lead, iters, dtype, size in [
        (4, 48, (2, 3), 20, torch.float32, 2.0), (4, 1100, (5,), 20, torch.bfloat16, 2.0),
        (3, 40, (2, 2), 1, torch.float32, 2.0), (2, 64, (1, 1), 7, torch.bfloat16, 2.0),
        (4, 32, (3,), 20, torch.float32, 1e-4), (4, 32, (0,), 20, torch.float32, 2.0)]:
    cfg = HCConfig(hidden_size=h, hc_mult=hc, sinkhorn_iters=iters)
    mod = HyperConnection(cfg)
    with torch.no_grad():
        mod.fn.normal_(0, 0.5)
        mod.base.normal_(0, 1.0)
        mod.scale.uniform_(0.5, 2.0)
    streams = (size * torch.randn(*lead, hc, h)).to(dtype)
    mixes = F.linear(flatten_streams(streams).float(), mod.fn)
    x, pre, post, comb = hc_triton.hc_pre(streams, mixes, mod.base, mod.scale, iters, mod.norm_eps,
                                          mod.hc_eps)
    want_pre, want_post, want_comb = mod.mixing_weights(streams)
    close(pre, want_pre, torch.float32, "pre")
    close(post, want_post, torch.float32, "post")
    close(comb, want_comb, torch.float32, "comb")
    if comb.numel():
        assert torch.allclose(comb.sum(-2), torch.ones(()), atol=1e-4), "columns of comb sum to 1"
    close(x, hc_collapse(streams, want_pre), dtype, "collapse")
    out = torch.randn(*lead, h).to(dtype)
    close(hc_triton.hc_expand(out, streams, want_post, want_comb), hc_expand(out, streams, want_post, want_comb),
          dtype, "expand")

    head = HyperHead(cfg)
    with torch.no_grad():
        head.fn.normal_(0, 0.5)
        head.base.normal_(0, 1.0)
        head.scale.uniform_(0.5, 2.0)
    x, pre, post, comb = hc_triton.hc_pre(streams, F.linear(flatten_streams(streams).float(), head.fn),
                                          head.base, head.scale, 1, head.norm_eps, head.hc_eps, head=True)
    assert post is None and comb is None
    close(x, head(streams), dtype, "head")
print("ok")
"""


def test_hc_kernels_match_torch_interpreted(run_interpreted):
    run_interpreted(SCRIPT)
