"""A draft head quantized to FP8 as it loads (`engine serve --draft-quantization fp8`,
spec.speculative.draftQuantization): which linears convert, that speculative decoding over the
quantized head stays lossless (float32, greedy: token for token the target's own output) with
about the same acceptance, that the plan's draft weight terms are the bytes a rank then holds
(TP 1 and a rank of TP 2), and what the planner refuses."""

import pytest
import torch
from specdeploy.engine.demo.toy import copy_draft, predictable_target, random_requests, run_to_completion, tiny_config
from specdeploy.engine.models import fp8
from specdeploy.engine.models.draft import build_draft
from specdeploy.engine.models.llama import ModelConfig, build_target
from specdeploy.engine.planner.plan import GPUS, Limits, PlanError, SpecSettings, plan_from_configs
from specdeploy.engine.runtime.runner import Runner


def held_bytes(module: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in {id(p): p for p in module.parameters()}.values())


@pytest.mark.parametrize("algorithm", ["EAGLE", "EAGLE3"])
def test_the_head_linears_convert_and_embeddings_and_norms_stay(algorithm):
    target, perm = predictable_target(tiny_config(num_layers=2), seed=0)
    head = copy_draft(algorithm, target, perm)
    converted = fp8.quantize_draft(head, "fp8")
    assert sorted(converted) == sorted(["fc", "layers.0.self_attn.qkv_proj", "layers.0.self_attn.o_proj",
                                        "layers.0.mlp.gate_up_proj", "layers.0.mlp.down_proj"]
                                       if algorithm == "EAGLE" else
                                       ["fc", "midlayer.self_attn.qkv_proj", "midlayer.self_attn.o_proj",
                                        "midlayer.mlp.gate_up_proj", "midlayer.mlp.down_proj", "lm_head"])
    for path in converted:
        module = head.get_submodule(path)
        assert module.weight.dtype == torch.float8_e4m3fn and module.fmt == fp8.DRAFT_FP8_FORMAT
    # an EAGLE head's lm_head and embedding are the target's: not the head's to quantize
    assert target.lm_head.weight.dtype == target.embed_tokens.weight.dtype == torch.float32
    assert all(p.dtype == torch.float32 for name, p in head.named_parameters() if "norm" in name)
    with pytest.raises(ValueError, match="fp8 only"):
        fp8.quantize_draft(head, "int4")


def test_an_eagle3_lm_head_in_fp8_gives_the_logits_of_its_dequantized_weights():
    """The quantized lm_head computes with its codes and scales, as a dequantized copy would; its
    padded rows (ceil(V / tp) a rank) quantize too, and it refuses checkpoint tensors."""
    target, perm = predictable_target(tiny_config(num_layers=2), seed=0)
    head = copy_draft("EAGLE3", target, perm)
    stored = head.lm_head.weight.detach().clone()
    fp8.quantize_draft(head, "fp8")
    x = torch.randn(3, stored.shape[1], generator=torch.Generator().manual_seed(0))
    dequantized = head.lm_head.dequantized(torch.float32)
    torch.testing.assert_close(head.lm_head(x), x @ dequantized.T)
    # e4m3 with a scale per 128 x 128 block: each weight within ~1/16 of its block's largest
    assert (dequantized - stored).abs().max() <= stored.abs().max() / 16
    with pytest.raises(ValueError, match="not loaded from a checkpoint"):
        head.lm_head.load_param("weight", stored)


def _acceptance(runner) -> float:
    return runner.num_draft_tokens_accepted / runner.num_draft_tokens_proposed


@pytest.mark.parametrize("algorithm,topk,n", [("EAGLE", 1, 4), ("EAGLE", 2, 5), ("EAGLE3", 1, 4)])
def test_speculation_over_a_quantized_draft_is_lossless(algorithm, topk, n):
    """The target verifies every token: with the head in FP8 the greedy output is token for token
    the target-only output (float32), and the head proposes about as well as unquantized."""
    target, perm = predictable_target(tiny_config(), seed=0)

    def reqs():
        return random_requests((5, 12, 1, 9), 24, 64)

    plain = run_to_completion(Runner(target, max_total_tokens=400, max_running_requests=4), reqs())
    rates = {}
    for quantization in ("none", "fp8"):
        head = copy_draft(algorithm, target, perm)
        if quantization == "fp8":
            assert fp8.quantize_draft(head, quantization)
        runner = Runner(target, head, SpecSettings(algorithm, 3, topk, n), max_total_tokens=400,
                        max_running_requests=4)
        assert run_to_completion(runner, reqs()) == plain, f"draft {quantization}: output differs from the target's"
        rates[quantization] = _acceptance(runner)
    assert 0.1 < rates["fp8"] < 0.95, f"acceptance {rates['fp8']:.2f}: the test would not see both outcomes"
    assert abs(rates["fp8"] - rates["none"]) < 0.1, rates


# Widths that a rank of TP 2 splits into whole 128-blocks: heads of 128, gate/up of 2 x 128 a rank.
TARGET_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
                 "intermediate_size": 512, "num_hidden_layers": 5, "num_attention_heads": 2,
                 "num_key_value_heads": 2, "head_dim": 128, "vocab_size": 64, "max_position_embeddings": 512,
                 "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "torch_dtype": "float32"}
DRAFT_CONFIGS = {
    "EAGLE": {**TARGET_CONFIG, "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 1},
    "EAGLE3": {**TARGET_CONFIG, "architectures": ["LlamaForCausalLMEagle3"], "num_hidden_layers": 1,
               "draft_vocab_size": 64},
}


def _plan(algorithm: str, quantization: str, tp: int, draft_config: dict | None = None):
    return plan_from_configs(TARGET_CONFIG, draft_config or DRAFT_CONFIGS[algorithm],
                             SpecSettings(algorithm, 3, 1, 4, quantization), GPUS["h100"], Limits(4, 512, 4),
                             tensor_parallel_size=tp)


def _rank_draft(algorithm: str, tp: int) -> torch.nn.Module:
    """Rank 0's shard of the head, built as a rank builds it (no process group needed to build)."""
    target = build_target(ModelConfig.from_hf(TARGET_CONFIG), torch.float32, "cpu", feature_kind=algorithm.lower(),
                          tp_rank=0, tp_size=tp)
    kwargs = {"draft_vocab_size": 64} if algorithm == "EAGLE3" else {}
    return build_draft(algorithm, ModelConfig.from_hf(DRAFT_CONFIGS[algorithm], allow_any_type=True), target,
                       torch.float32, "cpu", **kwargs)


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("algorithm", ["EAGLE", "EAGLE3"])
def test_the_plan_counts_the_bytes_a_quantized_draft_holds(algorithm, tp):
    plain, quantized = _plan(algorithm, "none", tp), _plan(algorithm, "fp8", tp)
    assert quantized.draft.quantized_at_load == "fp8" and plain.draft.quantized_at_load == "none"
    draft = _rank_draft(algorithm, tp)
    before = held_bytes(draft)
    fp8.quantize_draft(draft, "fp8")
    after = held_bytes(draft)
    assert after < before
    assert plain.draft.weight_bytes_per_gpu - quantized.draft.weight_bytes_per_gpu == before - after
    if tp == 1:
        assert plain.draft.weight_bytes - quantized.draft.weight_bytes == before - after
    # the plan's total follows its draft term, and the plan survives its own JSON
    assert (plain.memory_per_gpu.weight_bytes - quantized.memory_per_gpu.weight_bytes
            == plain.draft.weight_bytes_per_gpu - quantized.draft.weight_bytes_per_gpu)
    assert type(quantized).from_dict(quantized.to_dict()) == quantized


def test_the_planner_refuses_what_it_cannot_quantize():
    for algorithm, why in (("MTP", "its layers are part of the target checkpoint"), ("NONE", "it has no draft")):
        with pytest.raises(PlanError, match=why) as err:
            SpecSettings(algorithm, 1 if algorithm == "MTP" else 0, 1 if algorithm == "MTP" else 0,
                         2 if algorithm == "MTP" else 0, "fp8")
        assert err.value.reason == "InvalidSpeculativeSettings"
    with pytest.raises(PlanError, match="unknown 'int4'"):
        SpecSettings("EAGLE3", 3, 1, 4, "int4")
    # already quantized: it loads as stored
    stored_fp8 = {**DRAFT_CONFIGS["EAGLE3"],
                  "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}
    with pytest.raises(PlanError, match="already quantized"):
        _plan("EAGLE3", "fp8", 1, stored_fp8)
    # a rank's slice that would cut a 128-wide scale block: that TP size is refused, by name
    narrow = {**DRAFT_CONFIGS["EAGLE3"], "intermediate_size": 384}  # 192 rows of gate/up a rank
    with pytest.raises(PlanError, match="would cut its 128-wide FP8 scale blocks") as err:
        _plan("EAGLE3", "fp8", 2, narrow)
    assert err.value.reason == "InvalidTensorParallelSize"
    assert _plan("EAGLE3", "fp8", 1, narrow).tensor_parallel_size == 1
