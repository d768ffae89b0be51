"""Rotary frequencies must stay exact float32 when the model is cast to a low-precision dtype."""

import torch

from specdeploy.engine.models.layers import rope_inv_freq
from specdeploy.engine.models.llama import build_target
from specdeploy.engine.demo.toy import tiny_config


def test_bf16_model_keeps_exact_float32_rope_frequencies():
    cfg = tiny_config(rope_theta=500000.0, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64})
    model = build_target(cfg, torch.bfloat16, "cpu")
    exact = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    assert model.inv_freq.dtype == torch.float32
    assert torch.equal(model.inv_freq, exact)
    # A bf16 round trip is not exact for these frequencies, so the check above can fail.
    assert not torch.equal(exact.to(torch.bfloat16).float(), exact)
