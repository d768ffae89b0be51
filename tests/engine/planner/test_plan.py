"""plan(): every term recomputed here from the formula, TP choice, refusals, buffers, JSON round trip."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specdeploy.engine.planner import plan as planmod
from specdeploy.engine.planner.plan import (
    GIB,
    GPUS,
    Limits,
    Plan,
    PlanError,
    SpecSettings,
    cuda_graph_batch_sizes,
    custom_gpu,
    plan,
    plan_from_configs,
)
from specdeploy.engine.planner.shapes import ConfigError, derive_draft_shapes, derive_shapes

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
MIB = 1024**2


def load(name: str) -> dict:
    return json.loads((CONFIGS / f"{name}.json").read_text())


def llama8b_eagle3(gpu="h200", **limits) -> Plan:
    return plan_from_configs(
        load("llama-3.1-8b-instruct"), load("eagle3-llama3.1-instruct-8b"), SpecSettings("EAGLE3", 3, 1, 4),
        GPUS[gpu], Limits(**limits),
    )


def test_gpu_catalog_matches_nvidia_smi_totals():
    assert GPUS["h200"].memory_bytes == 143771 * MIB
    assert GPUS["h100"].memory_bytes == 81559 * MIB
    assert GPUS["a100-80g"].memory_bytes == 81920 * MIB
    assert GPUS["l40s"].memory_bytes == 46068 * MIB
    assert GPUS["h200"].product_label == "NVIDIA-H200"
    assert GPUS["h100"].product_label == "NVIDIA-H100-80GB-HBM3"


def test_llama8b_eagle3_every_term():
    p = llama8b_eagle3()
    target = derive_shapes(load("llama-3.1-8b-instruct"))
    draft = derive_shapes(load("eagle3-llama3.1-instruct-8b"), dtype="bfloat16")
    m = p.memory_per_gpu
    assert p.tensor_parallel_size == 1
    assert p.spec_hidden_size == 4096 and p.draft_input_hidden_size == 3 * 4096
    assert p.target.kv_cache_bytes_per_token == 131072
    assert p.draft.kv_cache_bytes_per_token == 2 * 1 * 8 * 128 * 2
    assert m.weight_bytes == (target.num_params + draft.num_params) * 2
    assert m.kv_cache_bytes_per_token == 131072 + 4096
    assert m.reserve_bytes == planmod.RESERVE_BYTES
    # budget is memory minus every listed term; max_total_tokens is what the budget holds
    assert m.kv_cache_budget_bytes == (
        m.gpu_memory_bytes - m.weight_bytes - m.cuda_graph_pool_bytes - m.activation_workspace_bytes
        - m.static_buffer_bytes - m.per_request_state_bytes - m.reserve_bytes
    )
    assert p.max_total_tokens == m.kv_cache_budget_bytes // m.kv_cache_bytes_per_token
    assert m.kv_cache_bytes == p.max_total_tokens * m.kv_cache_bytes_per_token
    assert p.required_tokens == 8192 * 32 <= p.max_total_tokens
    # CUDA-graph pool: the verify graph, 32 requests x 4 draft tokens through the target
    rows = 32 * 4
    per_row = planmod.LIVE_HIDDEN_WIDTHS * 4096 + planmod.LIVE_MLP_WIDTHS * 14336
    assert m.cuda_graph_pool_bytes == (
        planmod.CUDA_GRAPH_POOL_BASE_BYTES + rows * per_row * 2
        + planmod.SAMPLING_LOGITS_COPIES * rows * 128256 * planmod.LOGITS_DTYPE_BYTES
        # the graphs of one request's short prefill chunk: 256 tokens, their EAGLE-3 features, one row of logits
        + planmod.EXTEND_GRAPH_POOL_BASE_BYTES + 256 * per_row * 2 + 256 * 3 * 4096 * 2
        + 128256 * planmod.LOGITS_DTYPE_BYTES
    )


def test_gemv_split_k_workspaces_are_in_the_workspace_term():
    """One float32 [GEMV_MAX_SPLIT_K, GEMV_MAX_M, N] workspace and N / 4 int32 counters per
    distinct output width the small-M kernel may split (engine/kernels/gemv.py): for
    Llama-3.1-8B + EAGLE-3 at TP 1 the fused qkv (6144), hidden (4096), fused gate/up (28672) and
    the draft's 32000-token vocabulary; the target's 128256 is above GEMV_SPLIT_MAX_N."""
    target = derive_shapes(load("llama-3.1-8b-instruct"))
    draft = derive_shapes(load("eagle3-llama3.1-instruct-8b"), dtype="bfloat16")
    per_width = planmod.GEMV_MAX_SPLIT_K * planmod.GEMV_MAX_M * 4
    widths = (6144, 4096, 28672, 32000)
    want = sum(per_width * n + n // planmod.GEMV_MIN_BLOCK_N * 4 for n in widths)
    assert want == sum(planmod.gemv_width_bytes(n) for n in widths)
    assert planmod.gemv_workspace_bytes([target, draft], 1) == want
    assert want < 64 * MIB
    # at TP 2 each rank's widths halve where the layer is split (qkv, gate/up, vocabularies),
    # which brings the target's lm_head slice (64128) under GEMV_SPLIT_MAX_N
    tp2 = (3072, 4096, 14336, 16000, 64128)
    assert planmod.gemv_workspace_bytes([target, draft], 2) == sum(
        per_width * n + n // planmod.GEMV_MIN_BLOCK_N * 4 for n in tp2)


def test_buffer_shapes_follow_the_seed():
    p = llama8b_eagle3(max_running_requests=48, cuda_graph_max_bs=16)
    b = p.buffers
    hs, hin, bs = 4096, 3 * 4096, 16
    assert b.draft_hidden_states_shape == (bs * 1, hs)
    assert b.draft_extend_hidden_states_shape == (bs * (3 + 1), hin)
    assert b.verify_hidden_states_shape == (bs * 4, hin)
    assert b.cuda_graph_hidden_states_bytes == (bs * hs + bs * 4 * hin + bs * 4 * hin) * 2
    assert b.metadata_hidden_states_shape == (48, hs)
    assert b.metadata_hidden_states_bytes_per_request == hs * 2
    fixed = 8 + 8 + 4  # first token, prompt tokens sent, its log-probability
    assert b.metadata_fixed_fields_bytes_per_request == fixed
    assert b.metadata_bytes == 48 * (hs * 2 + fixed)
    assert p.cuda_graph_batch_sizes == (1, 2, 4, 8, 16)


def test_hc_mult_buffers_use_spec_hidden_size():
    """DeepSeek-V4 (hc_mult 4): every hidden-state buffer is 4 * hidden_size wide.

    With hidden_size in place of spec_hidden_size each of these would be 4x too small."""
    target = derive_shapes(load("deepseek-v4-flash"))
    draft = derive_draft_shapes("MTP", load("deepseek-v4-flash"), None, dtype="bfloat16")
    spec = SpecSettings("MTP", 3, 2, 5)
    b = planmod.buffer_plan(target, spec, Limits(max_running_requests=8, cuda_graph_max_bs=8))
    hidden, hs = 4096, 16384
    assert hs == hidden * 4 and draft.spec_hidden_size == hs
    assert b.draft_hidden_states_shape == (8 * 2, hs)
    assert b.draft_extend_hidden_states_shape == (8 * 4, hs)
    assert b.verify_hidden_states_shape == (8 * 5, hs)
    assert b.metadata_hidden_states_shape == (8, hs)
    assert b.metadata_hidden_states_bytes_per_request == hs * 2 != hidden * 2
    assert b.cuda_graph_hidden_states_bytes == (16 + 32 + 40) * hs * 2


def test_eagle3_on_hc_mult_target_consumes_three_plain_hidden_states():
    target = derive_shapes(load("deepseek-v4-flash"))
    b = planmod.buffer_plan(target, SpecSettings("EAGLE3", 2, 1, 3), Limits(cuda_graph_max_bs=4))
    assert b.draft_hidden_states_shape == (4, 16384)
    assert b.verify_hidden_states_shape == (4 * 3, 3 * 4096)


def test_deepseek_v4_flash_mtp_plan():
    p = plan_from_configs(load("deepseek-v4-flash"), None, SpecSettings("MTP", 1, 1, 2), GPUS["h200"], Limits())
    assert p.spec_hidden_size == p.draft_input_hidden_size == 16384
    assert p.target.hc_mult == 4 and p.draft.spec_hidden_size == 16384
    tp = p.tensor_parallel_size
    # no checkpoint at hand: FP8 linears and FP4 experts as quantization_config says, not bf16
    weights = derive_shapes(load("deepseek-v4-flash")).quantized_weight_bytes + p.draft.weight_bytes
    assert p.target.weight_source == p.draft.weight_source == "quantization_config"
    assert p.memory_per_gpu.weight_bytes == pytest.approx(weights / tp, abs=2)
    assert tp == 2
    # Recent rows per running request: the last 127 committed tokens in every layer's window
    # (43 target + 1 MTP layers, one 512-wide K=V head); the compressor state (kv and gate of
    # 2 x 512 and of the indexer's 2 x 128) of the last 7 tokens in the 21 CSA layers and (kv and
    # gate of 512) of the last 127 in the 20 HCA layers.
    per_request = ((43 + 1) * 127 * 512 + 21 * 7 * (4 * 512 + 4 * 128) + 20 * 127 * 2 * 512) * 2
    # Every slot a step holds has a row in every pool (both models): the windows, both states and
    # both entry pools (CSA 512 + 128, HCA 512). A step holds at most the prefill chunk's 8192
    # slots (32 requests x 2 slots of a one-step chain are fewer).
    in_flight_row = ((43 + 1) * 512 + 21 * (4 * 512 + 4 * 128) + 20 * 2 * 512 + 21 * (512 + 128) + 20 * 512) * 2
    assert p.target.kv_cache_bytes_per_in_flight_token_per_gpu + p.draft.kv_cache_bytes_per_in_flight_token_per_gpu == in_flight_row
    assert p.memory_per_gpu.per_request_state_bytes == 32 * per_request + 8192 * in_flight_row
    # compressed entries (6880 B) + the engine's slot maps: position + one row per pool, 5 pools
    # for the target, 1 for the window-only MTP layer
    assert p.memory_per_gpu.kv_cache_bytes_per_token == 6880 + (6 + 2) * 8
    assert any("replicated" in note for note in p.notes)


def test_smallest_tp_that_fits_is_chosen():
    target = derive_shapes(load("llama-3.3-70b-instruct"))
    chosen = plan(target, None, SpecSettings("NONE", 0, 0, 0), GPUS["h100"], Limits())
    assert chosen.tensor_parallel_size == 4
    assert chosen.target.kv_cache_bytes_per_token_per_gpu == 2 * 80 * (8 // 4) * 128 * 2
    # Every rank holds a quarter of the split matrices and all of the norms (2 per layer + final).
    norms = (2 * 80 + 1) * 8192
    assert chosen.target.weight_bytes_per_gpu == (target.num_params - norms) * 2 // 4 + norms * 2
    with pytest.raises(PlanError) as refused:
        plan(target, None, SpecSettings("NONE", 0, 0, 0), GPUS["h100"], Limits(), gpus_per_node=2)
    assert refused.value.reason == "InsufficientGPUMemory"
    assert "TP 2" in str(refused.value)


def test_requested_tensor_parallel_size_is_the_only_one_tried():
    target = derive_shapes(load("llama-3.3-70b-instruct"))
    none = SpecSettings("NONE", 0, 0, 0)
    assert plan(target, None, none, GPUS["h200"], Limits(), tensor_parallel_size=8).tensor_parallel_size == 8
    with pytest.raises(PlanError) as refused:
        plan(target, None, none, GPUS["h200"], Limits(), tensor_parallel_size=8, gpus_per_node=4)
    assert refused.value.reason == "InvalidTensorParallelSize"
    with pytest.raises(PlanError) as refused:
        plan(target, None, none, GPUS["h200"], Limits(), tensor_parallel_size=3)
    assert refused.value.reason == "InvalidTensorParallelSize"


def test_does_not_fit_names_the_numbers():
    with pytest.raises(PlanError) as err:
        plan_from_configs(load("deepseek-v3"), None, SpecSettings("MTP", 1, 1, 2), GPUS["h100"], Limits())
    message = str(err.value)
    assert err.value.reason == "InsufficientGPUMemory"
    assert "TP 8" in message and "GiB" in message and "262144 tokens" in message
    assert "quantization_config (fp8)" in message  # an estimate: the hint to read the real size


def test_safetensors_weights_replace_counted_ones():
    target = derive_shapes(load("deepseek-v3"))
    fp8_bytes = 688_586_727_753  # the published checkpoint's index total_size
    draft = derive_draft_shapes("MTP", load("deepseek-v3"), None, dtype="bfloat16")
    p = plan(target, draft, SpecSettings("MTP", 1, 1, 2), GPUS["h200"], Limits(), target_weight_bytes=fp8_bytes, draft_weight_bytes=0)
    assert p.tensor_parallel_size == 8
    assert p.target.weight_source == "headers" and p.draft.weight_source == "target checkpoint"
    assert p.memory_per_gpu.weight_bytes == -(-fp8_bytes // 8)


def test_tp_must_divide_the_heads():
    config = {**load("llama-3.1-8b-instruct"), "num_attention_heads": 7, "num_key_value_heads": 7, "head_dim": 128}
    target = derive_shapes(config)
    # needs more than one GPU, but 7 heads cannot be split over 2, 4 or 8: refused at TP 1
    with pytest.raises(PlanError) as err:
        plan(target, None, SpecSettings("NONE", 0, 0, 0), GPUS["l40s"], Limits(context_length=131072))
    message = str(err.value)
    assert err.value.reason == "InsufficientGPUMemory" and "at TP 1" in message
    assert "TP 2: target num_attention_heads 7 is not divisible by 2" in message
    assert "TP 8" in message
    with pytest.raises(PlanError) as err:
        plan(target, None, SpecSettings("NONE", 0, 0, 0), GPUS["l40s"], Limits(), gpus_per_node=0)
    assert err.value.reason == "InvalidGPU"


def test_kv_heads_replicated_when_fewer_than_ranks():
    target = derive_shapes(load("qwen2.5-vl-7b-instruct"))  # 28 heads, 4 KV heads
    assert planmod._tp_refusal(target, 8) is not None  # 28 heads do not split 8 ways
    assert planmod._tp_refusal(target, 4) is None
    kv8 = derive_shapes({**load("llama-3.1-8b-instruct"), "num_key_value_heads": 2})
    assert planmod._tp_refusal(kv8, 8) is None  # 8 % 2 == 0: each KV head on 4 ranks


def test_deepseek_v4_tp_must_divide_the_routed_experts():
    """V4 splits only its routed experts over the ranks (attention is replicated): a TP size that
    does not divide them is refused by the planner, not by the engine while loading."""
    v4 = derive_shapes({**load("deepseek-v4-flash"), "n_routed_experts": 254})
    assert planmod._tp_refusal(v4, 2) is None
    assert planmod._tp_refusal(v4, 4) == "target n_routed_experts 254 is not divisible by 4"
    with pytest.raises(PlanError) as err:
        plan(v4, None, SpecSettings("NONE", 0, 0, 0), GPUS["h200"], Limits(), tensor_parallel_size=4)
    assert err.value.reason == "InvalidTensorParallelSize" and "n_routed_experts 254" in str(err.value)


def test_draft_required():
    target = derive_shapes(load("llama-3.1-8b-instruct"))
    with pytest.raises(PlanError) as err:
        plan(target, None, SpecSettings("EAGLE3"), GPUS["h200"], Limits())
    assert err.value.reason == "DraftRequired"


@pytest.mark.parametrize(
    "args,match",
    [
        (("MEDUSA", 3, 1, 4), "algorithm"),
        (("EAGLE", 0, 1, 1), "num_steps"),
        (("EAGLE", 3, 1, 5), "num_steps \\+ 1"),
        (("EAGLE", 3, 4, 38), "topk \\+ \\(num_steps - 1\\) \\* topk\\^2 \\+ 1 = 37"),
        (("EAGLE", 1, 3, 5), "= 4"),
    ],
)
def test_bad_spec_settings(args, match):
    with pytest.raises(PlanError, match=match):
        SpecSettings(*args)


def test_num_draft_tokens_may_use_the_whole_candidate_pool():
    """3 steps of topk 4 draft 4 + 2 * 16 = 36 candidates: 20 (and up to 37) tokens verify, and
    the verify graph's buffer has a row per verified token."""
    assert planmod.max_draft_tokens(3, 4) == 37
    assert planmod.max_draft_tokens(3, 1) == 4
    assert SpecSettings("EAGLE3", 3, 4, 37).num_draft_tokens == 37
    target = derive_shapes(load("llama-3.1-8b-instruct"))
    b = planmod.buffer_plan(target, SpecSettings("EAGLE3", 3, 4, 20), Limits(cuda_graph_max_bs=8))
    assert b.verify_hidden_states_shape[0] == 8 * 20


def test_bad_limits_and_gpu():
    with pytest.raises(PlanError, match="context_length"):
        Limits(context_length=0)
    with pytest.raises(PlanError, match="positive"):
        custom_gpu(0)
    assert custom_gpu(24).memory_bytes == 24 * GIB


@pytest.mark.parametrize(
    "max_bs,expected",
    [
        (1, (1,)),
        (5, (1, 2, 4, 5)),
        (8, (1, 2, 4, 8)),
        (32, (1, 2, 4, 8, 16, 24, 32)),
        (44, (1, 2, 4, 8, 16, 24, 32, 40, 44)),
    ],
)
def test_cuda_graph_batch_sizes(max_bs, expected):
    assert cuda_graph_batch_sizes(max_bs) == expected


def test_none_has_no_draft_buffers():
    target = derive_shapes(load("qwen3-8b"))
    p = plan(target, None, SpecSettings("NONE", 0, 0, 0), GPUS["h100"], Limits())
    assert p.draft is None and p.draft_input_hidden_size == 0
    assert p.buffers.cuda_graph_hidden_states_bytes == 0
    assert p.memory_per_gpu.kv_cache_bytes_per_token == 147456


def test_to_dict_from_dict_round_trip():
    for p in (llama8b_eagle3(), plan(derive_shapes(load("qwen3-8b")), None, SpecSettings("NONE", 0, 0, 0), GPUS["h100"], Limits())):
        data = json.loads(json.dumps(p.to_dict()))
        assert Plan.from_dict(data) == p
        assert Plan.from_dict(data).to_dict() == data


def test_to_dict_has_the_contract_keys():
    d = llama8b_eagle3().to_dict()
    for key in ("spec_hidden_size", "draft_input_hidden_size", "tensor_parallel_size", "max_total_tokens", "max_running_requests", "cuda_graph_batch_sizes"):
        assert key in d
    for side in ("target", "draft"):
        for key in ("hidden_size", "hc_mult", "num_layers", "kv_cache_bytes_per_token", "weight_bytes"):
            assert key in d[side]
    for key in ("cuda_graph_hidden_states_bytes", "metadata_hidden_states_bytes_per_request", "draft_hidden_states_shape", "verify_hidden_states_shape"):
        assert key in d["buffers"]
    assert d["buffers"]["verify_hidden_states_shape"] == [32 * 4, 12288]


def test_from_dict_refuses_missing_and_unknown_keys():
    d = llama8b_eagle3().to_dict()
    broken = {k: v for k, v in d.items() if k != "max_total_tokens"}
    with pytest.raises(PlanError, match="max_total_tokens"):
        Plan.from_dict(broken)
    with pytest.raises(PlanError, match="surprise"):
        Plan.from_dict({**d, "target": {**d["target"], "surprise": 1}})


def test_replicated_kv_heads_are_noted():
    target = derive_shapes(load("qwen2.5-vl-7b-instruct"))  # 4 KV heads
    p = plan(target, None, SpecSettings("NONE", 0, 0, 0), GPUS["l40s"], Limits(context_length=32768))
    assert p.tensor_parallel_size in (2, 4)
    assert not any("KV heads for TP" in note for note in p.notes)
    kv2 = derive_shapes({**load("llama-3.3-70b-instruct"), "num_key_value_heads": 2})
    p = plan(kv2, None, SpecSettings("NONE", 0, 0, 0), GPUS["h100"], Limits(max_running_requests=64, cuda_graph_max_bs=64))
    assert p.tensor_parallel_size == 4
    assert any("2 KV heads for TP 4" in note for note in p.notes)


def test_prefill_chunk_fits_measured_memory():
    ws = 1024 * MIB
    margin = planmod.PREFILL_FIT_MARGIN_BYTES
    # The plan's workspace fits: the planned chunk.
    assert planmod.prefill_chunk_that_fits(ws + margin, ws, 8192) == 8192
    assert planmod.prefill_chunk_that_fits(10 * ws, ws, 8192) == 8192
    # Half of it left: half the chunk.
    assert planmod.prefill_chunk_that_fits(ws // 2 + margin, ws, 8192) == 4096
    # Not even the smallest useful chunk: refuse (0).
    tiny = ws * (planmod.MIN_PREFILL_CHUNK_TOKENS - 1) // 8192 + margin
    assert planmod.prefill_chunk_that_fits(tiny, ws, 8192) == 0
    assert planmod.prefill_chunk_that_fits(0, ws, 8192) == 0


def test_fp8_kv_cache_is_one_byte_per_element():
    spec = SpecSettings("EAGLE3", 3, 1, 4)
    auto = plan_from_configs(load("llama-3.1-8b-instruct"), load("eagle3-llama3.1-instruct-8b"), spec, GPUS["h200"], Limits())
    fp8 = plan_from_configs(load("llama-3.1-8b-instruct"), load("eagle3-llama3.1-instruct-8b"), spec, GPUS["h200"],
                            Limits(), kv_cache_dtype="fp8_e4m3")
    assert (fp8.target.kv_cache_dtype, fp8.draft.kv_cache_dtype) == ("fp8_e4m3", "fp8_e4m3")
    assert fp8.target.kv_cache_bytes_per_token == 2 * 32 * 8 * 128 * 1
    assert 2 * fp8.memory_per_gpu.kv_cache_bytes_per_token == auto.memory_per_gpu.kv_cache_bytes_per_token
    assert fp8.memory_per_gpu.kv_cache_budget_bytes == auto.memory_per_gpu.kv_cache_budget_bytes
    # the plan JSON carries it, and a plan written before the field existed still reads (as auto)
    assert Plan.from_dict(fp8.to_dict()) == fp8
    old = auto.to_dict()
    for model in ("target", "draft"):
        del old[model]["kv_cache_dtype"]
    assert Plan.from_dict(old) == auto
    with pytest.raises(ConfigError, match="kv_cache_dtype"):
        derive_shapes(load("llama-3.1-8b-instruct"), kv_cache_dtype="int4")


def test_an_fp8_targets_graph_pool_holds_what_deepgemm_adds():
    """The CUDA-graph pool of an FP8 target: the same activations as bf16 plus the e4m3 copy of
    the widest input, and FP8_LIBRARY_GRAPH_POOL_BYTES (what fp8_bench's planner truth measured
    beyond them with DeepGEMM serving the captured linears)."""
    spec, limits = SpecSettings("EAGLE3", 3, 1, 4), Limits(16, 2048, 16)
    config = load("llama-3.1-8b-instruct")
    fp8_config = {**config, "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}
    plain = plan_from_configs(config, load("eagle3-llama3.1-instruct-8b"), spec, GPUS["h100"], limits)
    fp8 = plan_from_configs(fp8_config, load("eagle3-llama3.1-instruct-8b"), spec, GPUS["h100"], limits)
    rows = limits.cuda_graph_max_bs * spec.num_draft_tokens
    copy = 14336 + 4 * 14336 // 128  # down_proj's input in e4m3, a float32 scale per 128
    extend_rows = planmod.EXTEND_GRAPH_TOKENS[-1]
    assert (fp8.memory_per_gpu.cuda_graph_pool_bytes - plain.memory_per_gpu.cuda_graph_pool_bytes
            == planmod.FP8_LIBRARY_GRAPH_POOL_BYTES + (rows + extend_rows) * copy)
    # the figure it is calibrated on: fp8_bench's FP8 EAGLE-3 plan (16 x 2048, buckets 1-16)
    # measured 763363328 B of graph pool on H100 and H200 alike
    assert fp8.memory_per_gpu.cuda_graph_pool_bytes == pytest.approx(763363328, rel=0.01)
