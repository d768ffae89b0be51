"""plan() across nodes: the group sizes tried, the fewest nodes that fit, exact per-GPU terms of
Llama-3.1-405B + its EAGLE-3 head at 2 nodes of H100, refusals, the JSON and the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specdeploy.cli import main
from specdeploy.engine.planner import plan as planmod
from specdeploy.engine.planner.plan import (
    GPUS,
    Limits,
    Plan,
    PlanError,
    SpecSettings,
    group_sizes,
    plan_from_configs,
)

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
EAGLE3 = SpecSettings("EAGLE3", 3, 1, 4)


def load(name: str) -> dict:
    return json.loads((CONFIGS / f"{name}.json").read_text())


def plan_405b(gpu: str = "h100", **kwargs) -> Plan:
    return plan_from_configs(load("llama-3.1-405b-instruct"), load("eagle3-llama3.1-instruct-405b"), EAGLE3,
                             GPUS[gpu], Limits(), **kwargs)


@pytest.mark.parametrize(("per_node", "max_nodes", "requested", "expected"), [
    (8, 1, None, ((1, 1), (2, 1), (4, 1), (8, 1))),
    (8, 3, None, ((1, 1), (2, 1), (4, 1), (8, 1), (16, 2), (24, 3))),
    (4, 2, None, ((1, 1), (2, 1), (4, 1), (8, 2))),
    (1, 3, None, ((1, 1), (2, 2), (3, 3))),
    (8, 4, 16, ((16, 2),)),
    (8, 4, 32, ((32, 4),)),
    (8, 1, 4, ((4, 1),)),
    (1, 2, 2, ((2, 2),)),
])
def test_group_sizes(per_node, max_nodes, requested, expected):
    assert group_sizes(per_node, max_nodes, requested) == expected


@pytest.mark.parametrize(("per_node", "max_nodes", "requested", "message"), [
    (8, 1, 16, "tensor_parallel_size 16 needs 2 nodes of 8 GPU(s); max_nodes is 1"),
    (8, 4, 12, "tensor_parallel_size 12 spans nodes but is not a multiple of the 8 GPU(s) of a node"),
    (8, 2, 3, "tensor_parallel_size must be one of 1, 2, 4, 8 within a node, got 3"),
])
def test_group_size_requests_refused(per_node, max_nodes, requested, message):
    with pytest.raises(PlanError) as err:
        group_sizes(per_node, max_nodes, requested)
    assert err.value.reason == "InvalidTensorParallelSize" and str(err.value) == message


# (target, draft, gpu, max_nodes) -> (tensor_parallel_size, nodes) the plan takes: the fewest
# nodes that fit, one node whenever one does.
@pytest.mark.parametrize(("target", "draft", "gpu", "max_nodes", "tp", "nodes"), [
    ("llama-3.1-405b-instruct", "eagle3-llama3.1-instruct-405b", "h100", 2, 16, 2),
    ("llama-3.1-405b-instruct", "eagle3-llama3.1-instruct-405b", "h100", 4, 16, 2),
    ("llama-3.1-405b-instruct", "eagle3-llama3.1-instruct-405b", "h200", 4, 8, 1),
    ("llama-3.1-8b-instruct", "eagle3-llama3.1-instruct-8b", "h100", 4, 1, 1),
    ("llama-3.3-70b-instruct", None, "l40s", 2, 8, 2),
])
def test_fewest_nodes_that_fit(target, draft, gpu, max_nodes, tp, nodes):
    spec = EAGLE3 if draft else SpecSettings("NONE", 0, 0, 0)
    per_node = 4 if gpu == "l40s" else 8
    p = plan_from_configs(load(target), load(draft) if draft else None, spec, GPUS[gpu], Limits(),
                          gpus_per_node=per_node, max_nodes=max_nodes)
    assert (p.tensor_parallel_size, p.nodes, p.gpus_per_node_used) == (tp, nodes, tp // nodes)
    assert p.max_total_tokens >= p.required_tokens


def test_405b_does_not_fit_one_h100_node():
    with pytest.raises(PlanError) as err:
        plan_405b()
    assert err.value.reason == "InsufficientGPUMemory"
    assert str(err.value).startswith("does not fit on 8 x h100: at TP 8")
    assert str(err.value).endswith("tried up to max_nodes 1")
    assert "\n" not in str(err.value)


def test_405b_eagle3_two_h100_nodes_exact_per_gpu_terms():
    p = plan_405b(max_nodes=2)
    tp, h, layers, vocab, inter, hd = 16, 16384, 126, 128256, 53248, 128
    assert (p.tensor_parallel_size, p.nodes, p.gpus_per_node) == (16, 2, 8)
    # Target, one rank: q and o by heads (128 / 16 = 8), k and v one of the 8 KV heads each (8 < 16:
    # replicated), gate/up/down by intermediate (53248 / 16), embedding and lm_head by vocabulary
    # rows (128256 / 16 = 8016), both layer norms and the final norm whole. bf16.
    q_local = 128 // tp * hd
    per_layer = h * (q_local + 2 * hd) + q_local * h + 3 * h * (inter // tp) + 2 * h
    target = 2 * (layers * per_layer + 2 * (vocab // tp) * h + h)
    assert p.target.weight_bytes_per_gpu == target
    # Draft: the whole checkpoint less the other ranks' share of what is split: fc [H, 3H] by
    # input columns, q/k/v over [emb; hidden] (2H wide) and o, the MLP, lm_head over the
    # 32000-token draft vocabulary (2000 rows each).
    whole = 2 * h * (128 * hd + 2 * 8 * hd) + 128 * hd * h + 3 * h * inter + 3 * h * h + 32000 * h
    part = 2 * h * (q_local + 2 * hd) + q_local * h + 3 * h * (inter // tp) + 3 * h * h // tp + 32000 // tp * h
    assert p.draft.weight_bytes_per_gpu == p.draft.weight_bytes - 2 * (whole - part)
    # KV per token per GPU: one KV head of 128 per layer, K and V, bf16.
    assert p.target.kv_cache_bytes_per_token_per_gpu == 2 * layers * 1 * hd * 2
    assert p.draft.kv_cache_bytes_per_token_per_gpu == 2 * 1 * 1 * hd * 2
    m = p.memory_per_gpu
    assert m.weight_bytes == target + p.draft.weight_bytes_per_gpu
    assert m.kv_cache_budget_bytes == (m.gpu_memory_bytes - m.weight_bytes - m.cuda_graph_pool_bytes
                                       - m.activation_workspace_bytes - m.static_buffer_bytes
                                       - m.per_request_state_bytes - m.reserve_bytes)
    assert p.max_total_tokens == m.kv_cache_budget_bytes // m.kv_cache_bytes_per_token >= p.required_tokens
    # The same per-GPU terms at TP 16 however the 16 ranks are spread over nodes.
    four = plan_405b(gpus_per_node=4, max_nodes=4)
    assert (four.tensor_parallel_size, four.nodes) == (16, 4) and four.memory_per_gpu == m


def test_group_size_that_does_not_divide_the_heads_is_skipped_or_refused():
    # Nodes of 4 H100: 2 nodes (TP 8) do not hold it, 3 x 4 = 12 ranks cannot split 128 heads,
    # so the planner goes on to 4 nodes.
    p = plan_405b(gpus_per_node=4, max_nodes=4)
    assert (p.tensor_parallel_size, p.nodes, p.gpus_per_node_used) == (16, 4, 4)
    with pytest.raises(PlanError) as err:
        plan_405b(max_nodes=3, tensor_parallel_size=24)
    assert err.value.reason == "InvalidTensorParallelSize"
    assert str(err.value) == "TP 24: target num_attention_heads 128 is not divisible by 24"


def test_experts_that_do_not_split_refuse_the_group():
    config = load("deepseek-v4-flash")
    experts = config["n_routed_experts"]
    nodes = next(n for n in range(2, 9) if experts % (8 * n))
    with pytest.raises(PlanError) as err:
        plan_from_configs(config, None, SpecSettings("MTP", 1, 1, 2), GPUS["h200"], Limits(),
                          max_nodes=nodes, tensor_parallel_size=8 * nodes)
    assert str(err.value) == f"TP {8 * nodes}: target n_routed_experts {experts} is not divisible by {8 * nodes}"


@pytest.mark.parametrize("max_nodes", [0, planmod.MAX_NODES + 1])
def test_max_nodes_bounds(max_nodes):
    with pytest.raises(PlanError) as err:
        plan_405b(max_nodes=max_nodes)
    assert err.value.reason == "InvalidNodes"


def test_cpu_ranks_one_per_node():
    # CPU mode: one rank per node, the group size asked for.
    p = plan_from_configs(load("llama-3.1-8b-instruct"), None, SpecSettings("NONE", 0, 0, 0),
                          planmod.custom_gpu(64), Limits(4, 1024, 4), gpus_per_node=1,
                          max_nodes=2, tensor_parallel_size=2)
    assert (p.tensor_parallel_size, p.nodes, p.gpus_per_node_used) == (2, 2, 1)


def test_nodes_in_the_json_and_back():
    p = plan_405b(max_nodes=2)
    d = p.to_dict()
    assert d["nodes"] == 2 and d["tensor_parallel_size"] == 16
    assert Plan.from_dict(d) == p
    del d["nodes"]  # a plan written before nodes existed: one node
    assert Plan.from_dict(d).nodes == 1


def test_cli_plans_405b_at_two_nodes(capsys):
    models = Path(__file__).resolve().parents[3] / "manifests" / "models"
    argv = ["plan", "--target", str(models / "llama-3.1-405b-instruct" / "config.json"),
            "--draft", str(models / "eagle3-llama3.1-instruct-405b" / "config.json"),
            "--algorithm", "EAGLE3", "--gpu", "h100", "--max-nodes", "2"]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "nodes                             2 x 8 GPUs, one tensor-parallel group across them" in text
    assert main(argv + ["--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert (d["nodes"], d["tensor_parallel_size"]) == (2, 16)
    assert main(argv[:-2]) == 2
    err = capsys.readouterr().err
    assert err.startswith("specdeploy plan: does not fit on 8 x h100") and err.count("\n") == 1
