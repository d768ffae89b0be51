"""The Triton slot-pool attention kernel checked against the reference attention on CPU through
Triton's interpreter (a subprocess: the interpreter is chosen when Triton is first imported)."""

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

SCRIPT = r"""
import torch
from specdeploy.engine.attention import AttnBatch, reference
from specdeploy.engine import attention_triton
torch.manual_seed(0)
for b, nq, hq, hkv, d, width in [(3, 5, 4, 2, 16, 45), (2, 1, 4, 4, 32, 70), (2, 19, 2, 1, 16, 1)]:
    k, v = torch.randn(300, hkv, d), torch.randn(300, hkv, d)
    q = torch.randn(b, nq, hq, d)
    lens = torch.randint(0, width + 1, (b,))
    prefix = torch.randint(1, 300, (b, width))
    new = torch.randint(1, 300, (b, nq))
    mask = (torch.rand(b, nq, nq) < 0.5).tril() | torch.eye(nq, dtype=torch.bool)
    batch = AttnBatch(new, prefix, lens, new, mask)
    diff = (reference(q, k, v, batch, 0.3) - attention_triton.attend(q, k, v, batch, 0.3)).abs().max()
    assert diff < 1e-5, diff
print("ok")
"""


def test_triton_kernel_matches_reference_interpreted():
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-2000:]
