"""Plans for the two halves of a disaggregated deployment: a prefill server has no CUDA-graph
pool or graph buffers, a decode server a one-small-chunk prefill workspace; each gives what it
saves to its KV pool. The metadata buffer is the same on both sides ([max_running_requests, H_s],
4 x hidden_size for an hc_mult 4 target)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from specdeploy.engine.planner.deepseek_v4 import read_v4_config, v4_pools, v4_staged_bytes
from specdeploy.engine.planner.plan import (
    GPUS,
    MIN_PREFILL_CHUNK_TOKENS,
    PREFILL_CHUNK_TOKENS,
    Limits,
    Plan,
    PlanError,
    TRANSFER_STAGING_ALIGN_BYTES,
    TRANSFER_STAGING_REQUESTS,
    SpecSettings,
    custom_gpu,
    plan_from_configs,
    staging_aligned,
    role_prefill_chunk_tokens,
)

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def load(name: str) -> dict:
    return json.loads((CONFIGS / f"{name}.json").read_text())


def llama8b_eagle3(role: str) -> Plan:
    return plan_from_configs(load("llama-3.1-8b-instruct"), load("eagle3-llama3.1-instruct-8b"),
                             SpecSettings("EAGLE3", 3, 1, 4), GPUS["h200"], Limits(), role=role)


def test_prefill_plan_has_no_graphs_and_a_bigger_kv_pool():
    both, prefill = llama8b_eagle3("both"), llama8b_eagle3("prefill")
    assert prefill.role == "prefill" and both.role == "both"
    assert prefill.memory_per_gpu.cuda_graph_pool_bytes == 0 < both.memory_per_gpu.cuda_graph_pool_bytes
    assert prefill.cuda_graph_batch_sizes == ()
    b = prefill.buffers
    assert b.draft_hidden_states_shape[0] == b.draft_extend_hidden_states_shape[0] == b.verify_hidden_states_shape[0] == 0
    assert b.cuda_graph_hidden_states_bytes == 0
    assert b.metadata_hidden_states_shape == both.buffers.metadata_hidden_states_shape == (32, 4096)
    saved = (both.memory_per_gpu.cuda_graph_pool_bytes + both.buffers.cuda_graph_hidden_states_bytes)
    assert prefill.memory_per_gpu.kv_cache_budget_bytes - both.memory_per_gpu.kv_cache_budget_bytes == saved
    assert prefill.max_total_tokens > both.max_total_tokens


def test_decode_plan_keeps_graphs_and_sizes_a_small_prefill_workspace():
    both, decode = llama8b_eagle3("both"), llama8b_eagle3("decode")
    assert role_prefill_chunk_tokens("decode") == MIN_PREFILL_CHUNK_TOKENS < PREFILL_CHUNK_TOKENS
    assert decode.memory_per_gpu.cuda_graph_pool_bytes == both.memory_per_gpu.cuda_graph_pool_bytes
    assert decode.cuda_graph_batch_sizes == both.cuda_graph_batch_sizes
    assert dataclasses.replace(decode.buffers, transfer_staging_bytes=0) == both.buffers
    ws, ws_both = decode.memory_per_gpu.activation_workspace_bytes, both.memory_per_gpu.activation_workspace_bytes
    assert ws < ws_both
    assert decode.memory_per_gpu.kv_cache_budget_bytes - both.memory_per_gpu.kv_cache_budget_bytes == ws_both - ws
    assert decode.max_total_tokens > both.max_total_tokens


def test_hc_mult_4_metadata_row_is_spec_hidden_size_on_both_sides():
    """DeepSeek-V4-Flash (hc_mult 4) split roles, on one 288 GiB GPU (TP 1). Each role's staging
    arena holds two context-length requests' kept rows of every pool: far less than a row of every
    pool per token (deepseek_v4.v4_staged_bytes)."""
    v4 = load("deepseek-v4-flash")
    limits = Limits(max_running_requests=8, context_length=4096, cuda_graph_max_bs=8)
    for role in ("prefill", "decode"):
        p = plan_from_configs(v4, None, SpecSettings("MTP", 1, 1, 2), custom_gpu(288), limits, role=role)
        assert p.tensor_parallel_size == 1
        assert p.spec_hidden_size == 4 * p.target.hidden_size
        assert p.buffers.metadata_hidden_states_shape == (8, 4 * p.target.hidden_size)
        target, mtp = read_v4_config(v4), read_v4_config(v4)
        want = 2 * staging_aligned(v4_staged_bytes(target, "target", 2, 4096) + v4_staged_bytes(mtp, "MTP", 2, 4096))
        assert p.buffers.transfer_staging_bytes == want
        # A row of every pool per prompt token would be over 20x this.
        every_row = sum(len(q.layers) * q.width * 2 for q in v4_pools(target, "target") + v4_pools(mtp, "MTP"))
        assert want * 20 < 2 * 4097 * every_row


def test_role_round_trips_and_older_plans_read_as_both():
    prefill = llama8b_eagle3("prefill")
    assert Plan.from_dict(json.loads(json.dumps(prefill.to_dict()))) == prefill
    old = prefill.to_dict()
    del old["role"]
    assert Plan.from_dict(old).role == "both"
    with pytest.raises(PlanError, match="role 'router'"):
        plan_from_configs(load("llama-3.1-8b-instruct"), load("eagle3-llama3.1-instruct-8b"),
                          SpecSettings("EAGLE3", 3, 1, 4), GPUS["h200"], Limits(), role="router")


def test_plan_in_the_compute_dtype_sizes_the_metadata_row_in_it():
    """`engine serve --dtype bfloat16` on a float32 checkpoint plans in bfloat16: the metadata row
    and the KV bytes per token are the engine's, not the config's (the servers refuse a row of
    another size at start-up)."""
    config = dict(load("llama-3.1-8b-instruct"), torch_dtype="float32")
    draft = load("eagle3-llama3.1-instruct-8b")
    spec, limits = SpecSettings("EAGLE3", 3, 1, 4), Limits()
    f32 = plan_from_configs(config, draft, spec, GPUS["h200"], limits, role="prefill")
    bf16 = plan_from_configs(config, draft, spec, GPUS["h200"], limits, role="prefill", dtype="bfloat16")
    assert f32.target.dtype == "float32" and bf16.target.dtype == bf16.draft.dtype == "bfloat16"
    assert f32.buffers.metadata_hidden_states_bytes_per_request == 4096 * 4
    assert bf16.buffers.metadata_hidden_states_bytes_per_request == 4096 * 2
    assert bf16.target.kv_cache_bytes_per_token * 2 == f32.target.kv_cache_bytes_per_token


def test_split_roles_plan_a_transfer_staging_arena_of_two_context_length_requests():
    """Each split role's plan carries its host staging arena: TRANSFER_STAGING_REQUESTS regions of
    (context + 1 pad row) x the KV bytes per token of both pools, aligned; one server has none.
    A plan written before the field existed reads as none (the engine then sizes it the same way)."""
    from specdeploy.engine.planner.cli import format_plan

    both, prefill, decode = llama8b_eagle3("both"), llama8b_eagle3("prefill"), llama8b_eagle3("decode")
    per_token = prefill.memory_per_gpu.kv_cache_bytes_per_token   # target 128 KiB + draft 4 KiB
    assert per_token == (32 + 1) * 2 * 8 * 128 * 2
    region = -(-(prefill.context_length + 1) * per_token // TRANSFER_STAGING_ALIGN_BYTES) * TRANSFER_STAGING_ALIGN_BYTES
    assert prefill.buffers.transfer_staging_bytes == decode.buffers.transfer_staging_bytes == \
        TRANSFER_STAGING_REQUESTS * region
    assert both.buffers.transfer_staging_bytes == 0
    assert prefill.memory_per_gpu.static_buffer_bytes == both.memory_per_gpu.static_buffer_bytes - \
        both.buffers.cuda_graph_hidden_states_bytes  # host memory: not in the GPU budget
    assert "transfer staging (host)" in format_plan(prefill) and "transfer staging" not in format_plan(both)
    old = prefill.to_dict()
    del old["buffers"]["transfer_staging_bytes"]
    assert Plan.from_dict(old).buffers.transfer_staging_bytes == 0


def test_split_roles_plan_tensor_parallel_as_one_server_does():
    """A split role is planned at the TP one server needs (the 70B at TP 2); its staging arena
    holds every rank's share of a request, rank after rank: TP x one GPU's KV per token, which for
    DeepSeek-V4 (every rank holds all of its pools) is each rank's copy. A DeepSeek-V4 target drafts
    only with its MTP layer (check_servable: what the engine refuses, the planner refuses first)."""
    llama70b, v4 = load("llama-3.3-70b-instruct"), load("deepseek-v4-flash")
    limits = Limits(max_running_requests=8, context_length=4096, cuda_graph_max_bs=8)
    for role in ("prefill", "decode"):
        p = plan_from_configs(llama70b, None, SpecSettings("NONE", 0, 0, 0), GPUS["h200"], limits, role=role)
        assert p.tensor_parallel_size == 2
        # Both ranks' shares of a request: 2 x one GPU's KV bytes per token.
        assert p.buffers.transfer_staging_bytes == TRANSFER_STAGING_REQUESTS * staging_aligned(
            4097 * 2 * p.memory_per_gpu.kv_cache_bytes_per_token)
        q = plan_from_configs(v4, None, SpecSettings("MTP", 1, 1, 2), GPUS["h200"], limits, role=role)
        assert q.tensor_parallel_size == 2
        one_rank = v4_staged_bytes(read_v4_config(v4), "target", 2, 4096) + v4_staged_bytes(read_v4_config(v4), "MTP", 2, 4096)
        assert q.buffers.transfer_staging_bytes == TRANSFER_STAGING_REQUESTS * staging_aligned(2 * one_rank)
    with pytest.raises(PlanError) as err:
        plan_from_configs(v4, load("eagle3-llama3.1-instruct-8b"), SpecSettings("EAGLE3", 3, 1, 4), GPUS["h200"], Limits())
    assert err.value.reason == "InvalidSpeculativeSettings" and "MTP" in str(err.value)
