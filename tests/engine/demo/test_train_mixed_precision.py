"""Training under bf16 autocast (the GPU benchmark's setting) must train the float32 weights it
returns: autocast caches the bf16 copy of each weight until its region exits, so a loop inside
one region would otherwise run every forward on the first step's weights."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

from specdeploy.engine.demo import train
from specdeploy.engine.models.attention import causal_batch
from specdeploy.engine.memory.kv import KVPool

VOCAB, SEQ = 64, 32


def _stream(n: int = 20_000) -> torch.Tensor:
    # Each token is mostly (previous + 1) mod a small cycle: learnable in a few dozen steps, and
    # a model that learned nothing scores about ln(VOCAB).
    gen = torch.Generator().manual_seed(0)
    out = torch.empty(n, dtype=torch.int64)
    out[0] = 0
    noise = torch.rand(n, generator=gen) < 0.1
    jumps = torch.randint(0, VOCAB, (n,), generator=gen)
    for i in range(1, n):
        out[i] = jumps[i] if noise[i] else (out[i - 1] + 1) % 13
    return out


@torch.no_grad()
def _loss(model, stream: torch.Tensor) -> float:
    ids = torch.stack([stream[s:s + SEQ + 1] for s in range(0, 8 * (SEQ + 1), SEQ + 1)])
    b = ids.shape[0]
    c = model.cfg
    kv = KVPool(c.num_layers, b * SEQ + 1, c.num_kv_heads, c.head_dim, torch.float32, "cpu")
    slots = torch.arange(1, b * SEQ + 1).view(b, SEQ)
    batch = causal_batch(slots, torch.full((b,), SEQ), torch.zeros(b, 0, dtype=torch.int64),
                         torch.zeros(b, dtype=torch.int64))
    out = model(ids[:, :-1], torch.arange(SEQ).expand(b, SEQ), batch, kv)
    return F.cross_entropy(model.logits(out.hidden).flatten(0, 1), ids[:, 1:].flatten()).item()


@pytest.mark.parametrize("how", ["per-step", "caller's region"])
def test_bf16_autocast_training_learns_the_float32_weights(how):
    config = train.llama_config(VOCAB, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1,
                                intermediate_size=64, max_position_embeddings=64, bos_token_id=0, eos_token_id=1)
    stream = _stream()
    kwargs = dict(max_steps=60, budget_s=120.0, batch_size=4, seq_len=SEQ, peak_lr=1e-2, progress=lambda line: None)
    if how == "per-step":
        model = train.train_target(config, stream, autocast_dtype=torch.bfloat16, **kwargs)
        region = contextlib.nullcontext()
    else:
        region = torch.autocast("cpu", dtype=torch.bfloat16)
        with region:
            model = train.train_target(config, stream, **kwargs)
    loss = _loss(model, stream)
    # ln(64) = 4.16; the cycle with 10% noise is worth well under 2 nats. With stale bf16
    # weights the float32 model scores far above ln(64).
    assert loss < 2.5, loss
