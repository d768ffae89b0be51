"""derive_shapes on published configs: each expected value is computed here from its formula."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specdeploy.engine.planner.deepseek_v4 import RopeSpec, read_v4_config
from specdeploy.engine.planner.shapes import (
    ConfigError,
    derive_draft_shapes,
    derive_shapes,
    draft_input_hidden_size,
    kv_cache_bytes_per_token_per_gpu,
    shapes_to_dict,
)

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
BF16 = 2


def load(name: str) -> dict:
    return json.loads((CONFIGS / f"{name}.json").read_text())


def gqa_kv_bytes(layers: int, kv_heads: int, head_dim: int, dtype_bytes: int = BF16) -> int:
    return 2 * layers * kv_heads * head_dim * dtype_bytes


# name, hidden, layers, heads, kv_heads, head_dim, vocab, kv bytes/token (formula), published params
DENSE_GQA = [
    ("llama-3.1-8b-instruct", 4096, 32, 32, 8, 128, 128256, gqa_kv_bytes(32, 8, 128), 8.03e9),
    ("llama-3.3-70b-instruct", 8192, 80, 64, 8, 128, 128256, gqa_kv_bytes(80, 8, 128), 70.6e9),
    ("mistral-7b-instruct-v0.3", 4096, 32, 32, 8, 128, 32768, gqa_kv_bytes(32, 8, 128), 7.25e9),
    ("qwen3-8b", 4096, 36, 32, 8, 128, 151936, gqa_kv_bytes(36, 8, 128), 8.19e9),
    # head_dim 128 is explicit and differs from hidden / heads = 64
    ("qwen3-30b-a3b", 2048, 48, 32, 4, 128, 151936, gqa_kv_bytes(48, 4, 128), 30.5e9),
    # language model only: Qwen2.5-7B's 7.61B (the vision tower is not counted)
    ("qwen2.5-vl-7b-instruct", 3584, 28, 28, 4, 128, 152064, gqa_kv_bytes(28, 4, 128), 7.61e9),
]
PARAMS_TOLERANCE = 0.01


@pytest.mark.parametrize("name,hidden,layers,heads,kv_heads,head_dim,vocab,kv_bytes,published", DENSE_GQA)
def test_gqa_models(name, hidden, layers, heads, kv_heads, head_dim, vocab, kv_bytes, published):
    s = derive_shapes(load(name))
    assert (s.hidden_size, s.num_layers, s.num_heads, s.num_kv_heads, s.head_dim, s.vocab_size) == (
        hidden, layers, heads, kv_heads, head_dim, vocab,
    )
    assert s.attention == "gqa"
    assert s.hc_mult == 1 and s.spec_hidden_size == hidden
    assert s.dtype == "bfloat16" and s.dtype_bytes == BF16
    assert s.kv_cache_bytes_per_token == kv_bytes
    assert s.kv_cache_bytes_per_request == 0
    assert s.num_params == pytest.approx(published, rel=PARAMS_TOLERANCE)


def test_llama_3_1_8b_exact_parameter_count():
    h, inter, layers, vocab, q, kv = 4096, 14336, 32, 128256, 32 * 128, 8 * 128
    layer = h * q + 2 * h * kv + q * h + 3 * h * inter + 2 * h
    expected = 2 * vocab * h + layers * layer + h
    assert derive_shapes(load("llama-3.1-8b-instruct")).num_params == expected == 8_030_261_248


def test_llama_3_1_8b_issue_figures():
    s = derive_shapes(load("llama-3.1-8b-instruct"))
    assert s.kv_cache_bytes_per_token == 2 * 32 * 8 * 128 * 2 == 131072
    assert s.spec_hidden_size == 4096


def test_qwen3_moe_counts_every_expert():
    s = derive_shapes(load("qwen3-30b-a3b"))
    h, e, moe_inter, layers = 2048, 128, 768, 48
    assert (s.num_routed_experts, s.num_experts_per_tok, s.moe_intermediate_size) == (e, 8, moe_inter)
    assert (s.num_moe_layers, s.num_dense_layers) == (layers, 0)
    attention = h * 32 * 128 + 2 * h * 4 * 128 + 32 * 128 * h + 2 * 128  # + q/k norms
    experts = e * 3 * h * moe_inter + e * h  # all experts + router
    expected = 2 * 151936 * h + layers * (attention + experts + 2 * h) + h
    assert s.num_params == expected


def test_mixtral_intermediate_size_is_the_expert_width():
    s = derive_shapes(load("mixtral-8x7b-instruct-v0.1"))
    h, e, inter = 4096, 8, 14336
    assert (s.num_routed_experts, s.moe_intermediate_size, s.intermediate_size) == (e, inter, 0)
    assert (s.num_moe_layers, s.num_dense_layers) == (32, 0)
    layer = h * 4096 + 2 * h * 1024 + 4096 * h + e * 3 * h * inter + e * h + 2 * h
    assert s.num_params == 2 * 32000 * h + 32 * layer + h
    assert s.num_params == pytest.approx(46.7e9, rel=PARAMS_TOLERANCE)


def test_config_is_not_modified():
    for name in ("deepseek-v4-flash", "qwen2.5-vl-7b-instruct", "eagle3-llama3.1-instruct-8b"):
        config = load(name)
        nested = {"text_config": load(name), "vision_config": {}}
        derive_shapes(config)
        derive_shapes(nested)
        assert config == load(name) and nested == {"text_config": load(name), "vision_config": {}}


def test_qwen2_5_vl_flat_and_nested_text_config_agree():
    flat = load("qwen2.5-vl-7b-instruct")
    text_keys = {
        "hidden_size", "intermediate_size", "num_attention_heads", "num_hidden_layers",
        "num_key_value_heads", "vocab_size", "max_position_embeddings", "rms_norm_eps",
    }
    nested = {k: v for k, v in flat.items() if k not in text_keys}
    nested["text_config"] = {"model_type": "qwen2_5_vl_text", **{k: flat[k] for k in text_keys}}
    a, b = derive_shapes(flat), derive_shapes(nested)
    assert (a.hidden_size, a.num_layers, a.num_kv_heads, a.kv_cache_bytes_per_token, a.num_params) == (
        b.hidden_size, b.num_layers, b.num_kv_heads, b.kv_cache_bytes_per_token, b.num_params,
    )
    assert a.has_vision_tower and b.has_vision_tower


def test_text_config_wins_over_top_level():
    config = {"torch_dtype": "bfloat16", "hidden_size": 1, "text_config": load("qwen3-8b")}
    assert derive_shapes(config).hidden_size == 4096


def test_deepseek_v3_mla_and_moe():
    s = derive_shapes(load("deepseek-v3"))
    assert s.attention == "mla"
    assert (s.kv_lora_rank, s.qk_rope_head_dim) == (512, 64)
    # one latent of kv_lora_rank + rope dims per layer, shared by all 128 heads
    assert s.kv_cache_bytes_per_token == 61 * (512 + 64) * BF16 == 70272
    assert (s.num_dense_layers, s.num_moe_layers) == (3, 58)
    assert s.num_params == pytest.approx(671e9, rel=PARAMS_TOLERANCE)
    assert s.quantization == "fp8"
    # MLA's latent is replicated, not split, across tensor-parallel ranks
    assert kv_cache_bytes_per_token_per_gpu(s, 8) == s.kv_cache_bytes_per_token


def test_deepseek_v4_flash_hc_mult_and_compressed_kv():
    s = derive_shapes(load("deepseek-v4-flash"))
    assert (s.hidden_size, s.hc_mult) == (4096, 4)
    assert s.spec_hidden_size == 4096 * 4 == 16384
    assert s.attention == "compressed"
    ratios = [0, 0] + [4, 128] * 20 + [4]
    assert s.compress_ratios == tuple(ratios)
    csa, hca = ratios.count(4), ratios.count(128)
    head_dim, index_head_dim, window = 512, 128, 128
    # CSA: one head_dim entry and one indexer key per 4 tokens; HCA: one head_dim entry per 128
    per_token_elements = csa * (head_dim + index_head_dim) // 4 + hca * head_dim // 128
    slot_maps = (1 + 5) * 8  # the engine's per-slot position and row maps (5 pools)
    assert s.kv_cache_bytes_per_token == per_token_elements * BF16 + slot_maps == 6880 + 48
    # Committed recent rows: every layer keeps the last 127 tokens of its one shared K=V head
    # (the next query is the window's 128th); CSA layers the compressor's and the indexer's kv
    # and gate of the last 7 (two overlapping windows of 4), HCA layers kv and gate of the last
    # 127 (the open window). A slot held by a step has a row in each of them and in both entry pools.
    committed = (43 * (window - 1) * head_dim + csa * 7 * (4 * head_dim + 4 * index_head_dim)
                 + hca * 127 * 2 * head_dim)
    assert s.kv_cache_bytes_per_request == committed * BF16
    in_flight = 43 * head_dim + csa * (4 * head_dim + 4 * index_head_dim) + hca * 2 * head_dim
    in_flight += csa * (head_dim + index_head_dim) + hca * head_dim
    assert s.kv_cache_bytes_per_in_flight_token == in_flight * BF16
    assert (s.num_moe_layers, s.num_dense_layers, s.intermediate_size) == (43, 0, 0)
    assert s.num_params == pytest.approx(284e9, rel=PARAMS_TOLERANCE)


def test_deepseek_v4_layer_types_form_matches_compress_ratios():
    config = load("deepseek-v4-flash")
    names = {0: "sliding_attention", 4: "compressed_sparse_attention", 128: "heavily_compressed_attention"}
    config["layer_types"] = [names[r] for r in config.pop("compress_ratios")]
    a, b = derive_shapes(load("deepseek-v4-flash")), derive_shapes(config)
    assert (a.kv_cache_bytes_per_token, a.num_params) == (b.kv_cache_bytes_per_token, b.num_params)


def test_deepseek_v4_both_naming_schemes_give_one_shape():
    """The published config (compress_ratios, num_hash_layers, rope_scaling) and the same config
    as transformers 5.x writes it back (layer_types + compress_rates, mlp_layer_types,
    rope_parameters {main, compress}, partial_rotary_factor; generated by DeepseekV4Config)."""
    original, newer = load("deepseek-v4-flash"), load("deepseek-v4-flash-layer-types")
    assert "compress_ratios" in original and "layer_types" in newer and "compress_ratios" not in newer
    for role in ("target", "MTP"):
        assert derive_shapes(original, role=role) == derive_shapes(newer, role=role)
    a, b = read_v4_config(original), read_v4_config(newer)
    assert a == b
    assert a.mlp_kinds[:4] == ("hash_moe", "hash_moe", "hash_moe", "moe")
    assert a.rope_main == RopeSpec(10000.0)
    assert (a.rope_compress.theta, a.rope_compress.rope_type, a.rope_compress.factor) == (160000.0, "yarn", 16.0)


@pytest.mark.parametrize("edit, field", [
    (lambda c: c.pop("compress_ratios"), "compress_ratios"),
    (lambda c: c.update(compress_ratios=[0, 8] * 22), "compress_ratios"),
    (lambda c: c.pop("sliding_window"), "sliding_window"),
    (lambda c: c.update(sliding_window=0), "sliding_window"),
    (lambda c: c.pop("head_dim"), "head_dim"),
    (lambda c: c.update(o_groups=7), "o_groups"),
    (lambda c: c.update(num_hash_layers=-1), "num_hash_layers"),
    (lambda c: c.update(rope_scaling={"type": "yarn"}), "rope_scaling.factor"),
])
def test_deepseek_v4_config_without_a_kv_size_names_the_field(edit, field):
    config = load("deepseek-v4-flash")
    edit(config)
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        derive_shapes(config)


@pytest.mark.parametrize("edit, field", [
    (lambda c: c.update(layer_types=["sliding_attention", "bogus"] * 22), "layer_types"),
    (lambda c: c.update(compress_rates={"compressed_sparse_attention": 0}), "compress_rates"),
    (lambda c: c.update(mlp_layer_types=["moe"]), "mlp_layer_types"),
    (lambda c: c.update(rope_parameters={"main": {"rope_type": "linear", "factor": 2.0},
                                         "compress": {"rope_type": "default"}}), "rope_parameters.main"),
])
def test_deepseek_v4_layer_types_scheme_errors_name_the_field(edit, field):
    config = load("deepseek-v4-flash-layer-types")
    edit(config)
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        derive_shapes(config)


def test_eagle3_head():
    s = derive_shapes(load("eagle3-llama3.1-instruct-8b"))
    assert s.role == "EAGLE3"  # detected from the architecture
    assert (s.num_layers, s.vocab_size, s.draft_vocab_size) == (1, 128256, 32000)
    h, q, kv, inter = 4096, 32 * 128, 8 * 128, 14336
    # attention reads [embeds; hidden] (2 * h); fc folds three target hidden states into h;
    # lm_head over the draft vocabulary; the embedding is the target's
    layer = 2 * h * q + 2 * 2 * h * kv + q * h + 3 * h * inter + 3 * h
    assert s.num_params == 3 * h * h + layer + h + 32000 * h
    assert s.embedding_params == 0 and s.lm_head_params == 32000 * h
    assert s.kv_cache_bytes_per_token == gqa_kv_bytes(1, 8, 128, dtype_bytes=2)


def test_eagle_head_shares_embedding_and_lm_head():
    config = load("eagle-llama3.1-instruct-8b")
    standalone = derive_shapes(config)
    head = derive_shapes(config, role="EAGLE")
    h, vocab = 4096, 128256
    assert standalone.role == "target"
    assert head.embedding_params == head.lm_head_params == 0
    # the head owns fc (2h -> h) and its decoder layer, nothing of the vocabulary
    assert head.num_params == standalone.num_params - 2 * vocab * h - h + 2 * h * h


def test_tied_embeddings_counted_once():
    config = load("llama-3.1-8b-instruct")
    untied = derive_shapes(config)
    tied = derive_shapes({**config, "tie_word_embeddings": True})
    assert untied.num_params - tied.num_params == 128256 * 4096
    assert tied.lm_head_params == 0


def test_mtp_draft_from_target_config():
    v3 = derive_draft_shapes("MTP", load("deepseek-v3"), None, dtype="bfloat16")
    assert (v3.role, v3.num_layers) == ("MTP", 1)
    assert v3.kv_cache_bytes_per_token == 1 * (512 + 64) * BF16
    assert v3.num_moe_layers == 1  # layer 61 is past first_k_dense_replace
    assert v3.embedding_params == v3.lm_head_params == 0

    v4 = derive_draft_shapes("MTP", load("deepseek-v4-flash"), None, dtype="bfloat16")
    assert v4.spec_hidden_size == 16384
    assert v4.compress_ratios == (0,)  # the published list's entry for the MTP layer
    assert v4.kv_cache_bytes_per_token == 2 * 8  # no compressed entries; position + window-row maps
    assert v4.kv_cache_bytes_per_request == 127 * 512 * BF16  # the window's last 127 tokens
    assert v4.kv_cache_bytes_per_in_flight_token == 512 * BF16


def test_mtp_needs_nextn_layers():
    with pytest.raises(ConfigError, match="num_nextn_predict_layers"):
        derive_draft_shapes("MTP", load("llama-3.1-8b-instruct"), None, dtype="bfloat16")


def test_eagle_needs_a_draft_config():
    with pytest.raises(ConfigError, match="draft"):
        derive_draft_shapes("EAGLE3", load("llama-3.1-8b-instruct"), None, dtype="bfloat16")


def test_draft_runs_in_target_dtype():
    draft = derive_draft_shapes("EAGLE3", load("llama-3.1-8b-instruct"), load("eagle3-llama3.1-instruct-8b"), dtype="bfloat16")
    assert draft.dtype == "bfloat16"  # its config says float16


@pytest.mark.parametrize(
    "algorithm,target,expected",
    [
        ("EAGLE3", "llama-3.1-8b-instruct", 3 * 4096),
        ("EAGLE", "llama-3.1-8b-instruct", 4096),
        ("MTP", "deepseek-v3", 7168),
        ("MTP", "deepseek-v4-flash", 4 * 4096),
        ("EAGLE3", "deepseek-v4-flash", 3 * 4096),
    ],
)
def test_draft_input_hidden_size(algorithm, target, expected):
    assert draft_input_hidden_size(algorithm, derive_shapes(load(target))) == expected


def test_kv_heads_split_by_tp_and_replicated_below_one_per_rank():
    s = derive_shapes(load("qwen2.5-vl-7b-instruct"))  # 4 KV heads
    assert kv_cache_bytes_per_token_per_gpu(s, 2) == gqa_kv_bytes(28, 2, 128)
    assert kv_cache_bytes_per_token_per_gpu(s, 8) == gqa_kv_bytes(28, 1, 128)


def test_unknown_model_type_with_alias_fields():
    config = {"model_type": "never_heard_of_it", "n_embd": 64, "n_layer": 2, "n_head": 4,
              "n_inner": 256, "vocab_size": 100, "torch_dtype": "float32"}
    s = derive_shapes(config)
    assert (s.hidden_size, s.num_layers, s.num_heads, s.num_kv_heads, s.head_dim) == (64, 2, 4, 4, 16)
    assert s.kv_cache_bytes_per_token == gqa_kv_bytes(2, 4, 16, dtype_bytes=4)


def test_shapes_to_dict_is_json():
    d = shapes_to_dict(derive_shapes(load("deepseek-v4-flash")))
    assert json.loads(json.dumps(d))["spec_hidden_size"] == 16384


@pytest.mark.parametrize(
    "change,field",
    [
        (lambda c: c.pop("hidden_size"), "hidden_size"),
        (lambda c: c.pop("num_hidden_layers"), "num_hidden_layers"),
        (lambda c: c.pop("num_attention_heads"), "num_attention_heads"),
        (lambda c: c.pop("vocab_size"), "vocab_size"),
        (lambda c: c.pop("intermediate_size"), "intermediate_size"),
        (lambda c: c.pop("torch_dtype"), "torch_dtype"),
        (lambda c: c.update(torch_dtype="int3"), "torch_dtype"),
        (lambda c: c.update(hidden_size="big"), "hidden_size"),
        (lambda c: c.update(num_key_value_heads=5), "num_key_value_heads"),
        (lambda c: c.update(text_config=[1]), "text_config"),
        (lambda c: c.update(quantization_config="fp8"), "quantization_config"),
    ],
)
def test_bad_configs_name_the_field(change, field):
    config = load("llama-3.1-8b-instruct")
    change(config)
    with pytest.raises(ConfigError, match=field):
        derive_shapes(config)


def test_head_dim_required_when_hidden_does_not_divide():
    config = {**load("llama-3.1-8b-instruct"), "num_attention_heads": 30, "num_key_value_heads": 30}
    with pytest.raises(ConfigError, match="head_dim"):
        derive_shapes(config)
    assert derive_shapes({**config, "head_dim": 128}).head_dim == 128


def test_moe_without_experts_per_token_is_refused():
    config = load("qwen3-30b-a3b")
    del config["num_experts_per_tok"]
    with pytest.raises(ConfigError, match="num_experts_per_tok"):
        derive_shapes(config)
