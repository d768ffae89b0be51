"""DeepSeek-V4 in the engine against transformers' DeepseekV4ForCausalLM, on tiny random configs.

Logits: float32, prefill chunks and then token-by-token decode through the engine's pools, held
to transformers' full-sequence forward within LOGIT_ATOL (logits are of order 5; measured
differences are below 1e-5). Both field-naming schemes, and each attention kind alone and mixed.
"""

from __future__ import annotations

import copy

import pytest
import torch

from specdeploy.engine.models import deepseek_v4 as v4mod
from specdeploy.engine.models.attention import causal_batch
from specdeploy.engine.memory.kv import SlotTable

from v4_tiny import TINY, engine_model, hf_model, original_scheme, stable_indexer_ties

pytest.importorskip("transformers.models.deepseek_v4")

LOGIT_ATOL = 1e-4

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"


def with_layers(*kinds: str, **changes) -> dict:
    config = copy.deepcopy(TINY)
    config["layer_types"] = list(kinds)
    config["num_hidden_layers"] = len(kinds)
    config["mlp_layer_types"] = ["hash_moe"] + ["moe"] * (len(kinds) - 1)
    config.update(changes)
    return config


def engine_logits(model, ids: torch.Tensor, chunks: list[int]) -> torch.Tensor:
    """Logits [n, V] of one request fed as prefill chunks of the given sizes (the rest one
    token at a time), through a SlotTable and the model's own pools."""
    n = ids.shape[1]
    table = SlotTable(n + 8, 1, n + 8, "cpu")
    kv = model.make_kv(n + 8, n + 7, 1, n + 8, torch.float32, "cpu")
    table.listeners.append(kv)
    row, length, out = table.alloc_row(), 0, []
    sizes = list(chunks) + [1] * (n - sum(chunks))
    with torch.no_grad():
        for take in sizes:
            slots = table.alloc(take)[None]
            table.req_to_slot[row, length:length + take] = slots[0]
            prefix = table.req_to_slot[[row], :length]
            positions = (length + torch.arange(take))[None]
            batch = causal_batch(slots, torch.tensor([take]), prefix, torch.tensor([length]))
            out.append(model.logits(model(ids[:, length:length + take], positions, batch, kv).hidden)[0])
            table.commit(row, length, length + take)
            length += take
    table.free_row(row, length)
    # every row of every pool is back
    for name in kv.pools:
        assert kv.free_rows(name) == kv.data[name].shape[1] - 1, name
    return torch.cat(out)


def reference_logits(hf, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad(), stable_indexer_ties():
        return hf(ids, use_cache=False).logits[0]


def ids_for(config: dict, n: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, config["vocab_size"], (1, n), generator=torch.Generator().manual_seed(seed))


CASES = {
    "mixed": (TINY, 40, [11]),
    "sliding only": (with_layers(SLIDING, SLIDING), 24, [5]),
    "csa only": (with_layers(CSA, CSA), 30, [7, 3]),
    "hca only": (with_layers(HCA, HCA), 34, [9]),
}


@pytest.mark.parametrize("name", list(CASES))
def test_logits_match_transformers_layer_types_scheme(name):
    config, n, chunks = CASES[name]
    hf = hf_model(config)
    model = engine_model(config, hf)
    ids = ids_for(config, n)
    torch.testing.assert_close(engine_logits(model, ids, chunks), reference_logits(hf, ids), atol=LOGIT_ATOL, rtol=0)


def test_logits_match_transformers_original_scheme():
    """compress_ratios (4 / 128, the MTP layer's entry last), num_hash_layers, rope_scaling: 150
    tokens so one window of 128 closes, the first 90 in one chunk (the contiguous-positions
    shortcut, queries in blocks), the rest decoded one by one."""
    config = original_scheme(TINY)
    assert "layer_types" not in config and config["compress_ratios"] == [0, 4, 128, 4, 0]
    hf = hf_model(config)
    model = engine_model(config, hf)
    ids = ids_for(config, 150)
    saved = v4mod.QUERY_BLOCK
    v4mod.QUERY_BLOCK = 32
    try:
        got = engine_logits(model, ids, [90])
    finally:
        v4mod.QUERY_BLOCK = saved
    torch.testing.assert_close(got, reference_logits(hf, ids), atol=LOGIT_ATOL, rtol=0)


def test_both_schemes_build_one_model():
    """The same weights under either naming scheme give the same logits."""
    original = original_scheme(TINY)
    newer = copy.deepcopy(TINY)
    newer["compress_rates"] = {CSA: 4, HCA: 128}
    hf = hf_model(original)
    ids = ids_for(TINY, 20)
    a = engine_logits(engine_model(original, hf), ids, [6])
    b = engine_logits(engine_model(newer, hf), ids, [6])
    assert torch.equal(a, b)
