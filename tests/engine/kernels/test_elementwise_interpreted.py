"""The Triton RMSNorm (with and without the residual add), SiLU-times-up and rope + K/V-store
kernels (used on CUDA only) checked against the torch code of layers.py and model.py on CPU
through Triton's interpreter (tests/engine/conftest.py: run_interpreted)."""

import pytest

pytest.importorskip("triton")

SCRIPT = r"""
import torch
import torch.nn.functional as F
from specdeploy.engine.kernels import elementwise as ew
from specdeploy.engine.models.layers import RMSNorm

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
    # With the residual add in front: x + delta is rounded like torch's add, then normalised.
    delta = torch.randn(shape).to(x_dtype)
    want_sum = x + delta
    got_sum, got = ew.add_rms_norm(x, delta, norm.weight, norm.eps)
    assert torch.equal(got_sum, want_sum)
    assert_close(got, norm(want_sum), x_dtype)

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


ROPE_SCRIPT = r"""
import torch
from specdeploy.engine.kernels import elementwise as elementwise_triton
from specdeploy.engine.models import llama as model_module
from specdeploy.engine.models.attention import causal_batch
from specdeploy.engine.models.llama import Attention, rope_tables
from specdeploy.engine.models.layers import rope_inv_freq
from specdeploy.engine.demo.toy import init_random_, tiny_config

torch.manual_seed(0)
for dtype, heads, kv_heads, head_dim in [(torch.float32, 4, 2, 8), (torch.bfloat16, 8, 2, 16),
                                         (torch.bfloat16, 4, 4, 32)]:
    cfg = tiny_config(num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, qkv_bias=True)
    attn = Attention(cfg)
    init_random_(attn, torch.Generator().manual_seed(1), std=0.2)
    attn.to(dtype)
    b, q = 2, 3
    x = torch.randn(b, q, cfg.hidden_size).to(dtype)
    positions = torch.randint(0, 500, (b, q))
    cos, sin = rope_tables(rope_inv_freq(head_dim, 10000.0, None), positions, dtype)
    slots = torch.arange(1, 1 + b * q).view(b, q)
    batch = causal_batch(slots, torch.tensor([q, 2]), torch.zeros(b, 0, dtype=torch.int64),
                         torch.zeros(b, dtype=torch.int64))
    outs, caches = [], []
    for use_kernel in (False, True):
        model_module.fused_kernels = (lambda *a: elementwise_triton) if use_kernel else (lambda *a: None)
        k_cache = torch.zeros(16, kv_heads, head_dim, dtype=dtype)
        v_cache = torch.zeros_like(k_cache)
        with torch.no_grad():
            outs.append(attn(x, cos, sin, k_cache, v_cache, batch))
        caches.append((k_cache, v_cache))
    # Same roundings as the torch code: K/V in the pool and the attention output are equal.
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1]), dtype
    assert caches[1][0][1:1 + b * q].abs().sum() > 0
    assert torch.equal(outs[0], outs[1]), (dtype, (outs[0] - outs[1]).abs().max())
print("ok")
"""


def test_rope_store_kernel_matches_torch_interpreted(run_interpreted):
    run_interpreted(ROPE_SCRIPT)


MODEL_SCRIPT = r"""
import torch
from specdeploy.engine.kernels import attention as attention_triton
from specdeploy.engine.kernels import elementwise as elementwise_triton
from specdeploy.engine.models import layers
from specdeploy.engine.models import llama as model_module
from specdeploy.engine.models.attention import AttnBatch
from specdeploy.engine.memory.kv import KVPool
from specdeploy.engine.demo.toy import predictable_target, tiny_config

from specdeploy.engine import kernels
from specdeploy.engine.kernels import gemv

# The small-M linear kernel on every plain linear of <= 16 rows (on CUDA the launch table decides
# between it and cuBLAS): split-K at 5-16 rows, the fma loop below.
gemv.config_for = lambda kind, n, k, m, device: ("dot", 16, 128, 2, 4, 2) if m > 4 else ("fma", 8, 128, 2, 4, 2)

def use_kernels(on):
    # What CUDA would take: the Triton kernels wherever no gradient is tracked.
    pick = (lambda *a, ops=kernels.elementwise_ops: ops()) if on else (lambda *a, **kw: None)
    layers.fused_kernels = model_module.fused_kernels = pick
    model_module.attend = attention_triton.attend if on else model_module.attention_attend

model_module.attention_attend = model_module.attend
torch.manual_seed(0)
for dtype, feature in [(torch.float32, "eagle3"), (torch.bfloat16, "mtp")]:
    cfg = tiny_config(num_heads=4, num_kv_heads=2, head_dim=16, hidden_size=64)
    target, _ = predictable_target(cfg, seed=2, dtype=dtype)
    target.set_feature(feature)
    b, n, width = 2, 4, 40
    ids = torch.randint(0, cfg.vocab_size, (b, n))
    lens = torch.tensor([37, 5])
    prefix = torch.arange(1, 1 + b * width).view(b, width)
    slots = torch.arange(200, 200 + b * n).view(b, n)
    mask = (torch.rand(b, n, n) < 0.5).tril() | torch.eye(n, dtype=torch.bool)
    batch = AttnBatch(slots, prefix, lens, slots, mask)
    pos = lens[:, None] + torch.arange(n)
    results = []
    kv_shape = (cfg.num_layers, 300, cfg.num_kv_heads, cfg.head_dim)
    k0, v0 = torch.randn(kv_shape).to(dtype), torch.randn(kv_shape).to(dtype)   # the prefix K/V
    for on in (False, True):
        use_kernels(on)
        kv = KVPool(cfg.num_layers, 300, cfg.num_kv_heads, cfg.head_dim, dtype, "cpu")
        kv.k.copy_(k0)
        kv.v.copy_(v0)
        with torch.no_grad():
            out = target(ids, pos, batch, kv)
        results.append((target.logits(out.hidden), out.feature.float(), kv.k.float(), kv.v.float()))
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    for want, got in zip(*results):
        diff = (want - got).abs().max().item()
        assert diff < tol * (1 + want.abs().max().item()), (dtype, diff)
print("ok")
"""


def test_model_forward_on_the_kernel_path_matches_torch_interpreted(run_interpreted):
    """A whole target forward (verify-shaped: prefix plus a tree) through every Triton kernel, as
    on CUDA, against the torch code: logits, draft feature and the pool's K/V."""
    run_interpreted(MODEL_SCRIPT)


ARGMAX_SCRIPT = r"""
import torch
from specdeploy.engine.kernels import elementwise as ew

g = torch.Generator().manual_seed(1)
# Rows longer than a chunk and not a multiple of it, a leading batch shape, bf16 and float32;
# ties inside a chunk and across chunks resolve to the first index, as torch.argmax does.
for shape, dtype in [((3, 2, 9000), torch.float32), ((5, 4100), torch.bfloat16), ((2, 7), torch.float32)]:
    x = torch.randn(shape, generator=g).to(dtype)
    got = ew.argmax(x)
    assert got.dtype == torch.int64 and got.shape == shape[:-1]
    assert torch.equal(got, x.argmax(-1)), (shape, dtype)
x = torch.zeros(4, 9000)
x[0, [5, 4096, 8999]] = 3.0           # tie across chunks
x[1, [4097, 4098]] = 2.0              # tie inside the second chunk
x[2, -1] = 1.0                        # maximum in the last, partial chunk
x[3] = -1.0                           # every entry equal
assert ew.argmax(x).tolist() == [5, 4097, 8999, 0] == x.argmax(-1).tolist()
print("ok")
"""


def test_argmax_kernel_matches_torch_interpreted(run_interpreted):
    run_interpreted(ARGMAX_SCRIPT)
