"""The Triton slot-pool attention (split-KV kernel + combine) checked against the reference
attention on CPU through Triton's interpreter (a subprocess: the interpreter is chosen when Triton
is first imported). Cases cover decode (one query), verify (a tree mask over several queries) and
prefill-like rows; GQA ratios 1, 2 and 4; prefixes of 0, 1, exactly one split, one key past a
split and many splits; one split (the kernel normalises itself) and several (the combine);
float32 and bfloat16; other key tiles than the chosen one; bad launch options refused."""

import pytest

pytest.importorskip("triton")

SCRIPT = r"""
import torch
from specdeploy.engine.models.attention import AttnBatch, reference
from specdeploy.engine.kernels import attention as attention_triton

torch.manual_seed(0)
SLOTS = 400
CASES = [  # b, queries, hq, hkv, d, prefix width, prefix lens, splits (None: chosen), dtype
    (3, 5, 4, 2, 16, 45, [0, 1, 45], None, torch.float32),      # tree rows, GQA 2
    (2, 1, 8, 2, 32, 200, [200, 130], None, torch.float32),     # decode, GQA 4, chosen splits
    (1, 1, 4, 1, 16, 100, [100], 8, torch.float32),             # decode, 8 splits of 13 keys
    (2, 19, 2, 1, 16, 1, [1, 0], 2, torch.float32),             # prefill-like, 2 row blocks
    (4, 4, 4, 4, 16, 70, [0, 32, 33, 70], 2, torch.bfloat16),   # MHA, split edge +- 1 key
    (2, 6, 8, 2, 16, 90, [90, 33], 1, torch.bfloat16),          # single split
    (1, 1, 8, 2, 16, 300, [300], None, torch.bfloat16),         # decode, long prefix
]
for b, nq, hq, hkv, d, width, lens, splits, dtype in CASES:
    k = torch.randn(SLOTS, hkv, d).to(dtype)
    v = torch.randn(SLOTS, hkv, d).to(dtype)
    q = torch.randn(b, nq, hq, d).to(dtype)
    prefix = torch.randint(1, SLOTS, (b, width))
    new = torch.randint(1, SLOTS, (b, nq))
    mask = (torch.rand(b, nq, nq) < 0.5).tril() | torch.eye(nq, dtype=torch.bool)
    batch = AttnBatch(new, prefix, torch.tensor(lens), new, mask)
    want = reference(q.float(), k.float(), v.float(), batch, 0.3)
    got = attention_triton.attend(q, k, v, batch, 0.3, num_splits=splits)
    assert got.dtype == dtype
    # bf16: the output is rounded to bf16 and P is rounded before P @ V.
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    diff = (want - got.float()).abs().max().item()
    assert diff < tol, (b, nq, hq, hkv, width, lens, splits, dtype, diff)
    if splits in (1, 8):  # other key tiles (bench/decode_kernels.py sweeps them)
        for block_k in (16, 32, 64):
            got = attention_triton.attend(q, k, v, batch, 0.3, num_splits=splits, block_k=block_k)
            diff = (want - got.float()).abs().max().item()
            assert diff < tol, (splits, block_k, diff)
for bad in (dict(block_k=24), dict(block_k=8), dict(num_splits=3), dict(num_splits=0)):
    try:
        attention_triton.attend(q, k, v, batch, 0.3, **bad)
    except ValueError:
        pass
    else:
        raise AssertionError(f"{bad} was accepted")
print("ok")
"""


def test_triton_kernel_matches_reference_interpreted(run_interpreted):
    run_interpreted(SCRIPT)


def test_split_count_depends_on_shapes_only():
    from specdeploy.engine.kernels.attention import MAX_SPLITS, num_kv_splits
    # Batch 1, 8 kv heads, 132 SMs, decode rows (16-row blocks): fill the device, bounded by
    # MAX_SPLITS.
    assert num_kv_splits(8, 2048, 132, 16) == MAX_SPLITS
    # From 1024 keys wide, splits may be 32 keys short (measured best at batch 1, 1024 keys:
    # 32 splits); a narrower table keeps 64 keys a split (512 / 64 = 8), and so do wider row
    # blocks (verify, prefill: not measured): 1024 / 64 = 16.
    assert num_kv_splits(8, 1024, 132, 16) == 32
    assert num_kv_splits(8, 512, 132, 16) == 8
    assert num_kv_splits(8, 1024, 132, 32) == 16
    # Batch 2: the SM count bounds it first.
    assert num_kv_splits(16, 1024, 132, 16) == 16
    # A large batch already fills the device: one split, no combine.
    assert num_kv_splits(64 * 8, 2048, 132, 16) == 1
    # No prefix at all (prefill from scratch) never splits; counts are powers of two.
    assert num_kv_splits(1, 0, 132, 64) == 1
    assert num_kv_splits(24, 4096, 132, 64) == 8


def test_key_tile_is_wider_for_one_split_of_few_rows():
    from specdeploy.engine.kernels.attention import BLOCK_K, SINGLE_SPLIT_BLOCK_K, launch_block_k
    assert SINGLE_SPLIT_BLOCK_K != BLOCK_K
    # Decode at batch 64 (one split, 4 rows in a 16-row block): the measured launch.
    assert launch_block_k(1, 16) == SINGLE_SPLIT_BLOCK_K
    # Split launches and larger row blocks (prefill, wide verify) keep BLOCK_K.
    assert launch_block_k(32, 16) == BLOCK_K
    assert launch_block_k(1, 64) == BLOCK_K
