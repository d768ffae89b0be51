"""The operator counts a hub model's real weight bytes from its index and safetensors headers
(HTTP range requests, httpx) against a local hub serving DeepSeek-V4-Flash's real-format
checkpoint, plans TP from them and says so in status.plan.weightsSource; FP8 KV from
spec.engine.kvCacheDtype reaches the plan and the engine's arguments."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from checkpoint_hub import CheckpointHub, Repo, VirtualSafetensors, deepseek_v4_flash_tensors, sharded_checkpoint

from specdeploy.operator import api
from specdeploy.operator.cluster import config_source as cs
from specdeploy.operator.desired import render, status
from specdeploy.operator.desired.planning import ModelWeights, plan_engine

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
V4 = json.loads((CONFIGS / "deepseek-v4-flash.json").read_text())
LLAMA = json.loads((CONFIGS / "llama-3.1-8b-instruct.json").read_text())
EAGLE3 = json.loads((CONFIGS / "eagle3-llama3.1-instruct-8b.json").read_text())


@pytest.fixture(scope="module")
def hub():
    files = sharded_checkpoint(deepseek_v4_flash_tensors(V4), per_shard=6)
    repos = {"deepseek-ai/DeepSeek-V4-Flash": Repo({"config.json": json.dumps(V4).encode(), **files}),
             "org/gated": Repo({"config.json": json.dumps(V4).encode(), **files}, token="right"),
             "org/config-only": Repo({"config.json": json.dumps(V4).encode()})}
    server = CheckpointHub(repos)
    server.payload = sum(f.payload_bytes for f in files.values() if isinstance(f, VirtualSafetensors))
    yield server
    server.close()


def v4_spec(**engine):
    return {"target": {"model": "deepseek-ai/DeepSeek-V4-Flash"},
            "speculative": {"algorithm": "MTP", "numSteps": 1, "topk": 1, "numDraftTokens": 2},
            "engine": {"maxRunningRequests": 32, "contextLength": 65536, **engine},
            "gpu": {"product": "h200", "perNode": 8}}


def test_hub_headers_decide_the_plan(hub):
    before = hub.bytes_sent
    weights = cs.resolve_model_weights({"model": "deepseek-ai/DeepSeek-V4-Flash"}, "spec.target",
                                       hub_endpoint=hub.url, hub_token=None)
    assert (weights.source, weights.total_bytes, weights.num_files) == ("headers", hub.payload, 8)
    assert weights.bytes_by_dtype["I8"] > 0.9 * hub.payload / 1.06  # the FP4 experts dominate
    assert hub.bytes_sent - before < 20 * 1024**2  # the index and eight headers, never weights
    planned = plan_engine(v4_spec(), V4, None, ModelWeights(weights))
    assert planned.tensor_parallel_size == 2
    assert planned.plan["target"]["weight_source"] == "headers"
    assert planned.plan["draft"]["weight_source"] == "target checkpoint"
    st = status.status_plan(planned.plan)
    assert st["weightsSource"] == "headers" and st["weightBytes"] == hub.payload


def test_without_headers_the_plan_estimates_and_says_so(hub):
    assert cs.resolve_model_weights({"model": "org/config-only"}, "spec.target", hub_endpoint=hub.url,
                                    hub_token=None) is None
    # an inline config: the operator does not reach the hub for the model
    assert cs.resolve_model_weights({"model": "deepseek-ai/DeepSeek-V4-Flash", "config": V4}, "spec.target",
                                    hub_endpoint=hub.url, hub_token=None) is None
    planned = plan_engine(v4_spec(), V4, None)
    assert status.status_plan(planned.plan)["weightsSource"] == "quantization_config"
    assert planned.tensor_parallel_size == 2


def test_gated_checkpoint_needs_the_token(hub):
    with pytest.raises(cs.ConfigSourceError) as err:
        cs.resolve_model_weights({"model": "org/gated"}, "spec.target", hub_endpoint=hub.url, hub_token="wrong")
    assert err.value.reason == api.REASON_HUB_UNAUTHORIZED and err.value.transient
    assert "token rejected" in err.value.message
    weights = cs.resolve_model_weights({"model": "org/gated"}, "spec.target", hub_endpoint=hub.url, hub_token="right")
    assert weights.total_bytes == hub.payload


def test_unreachable_hub_is_transient():
    with pytest.raises(cs.ConfigSourceError) as err:
        cs.resolve_model_weights({"model": "org/x"}, "spec.target", hub_endpoint="http://127.0.0.1:9", hub_token=None)
    assert err.value.reason == api.REASON_HUB_UNREACHABLE and err.value.transient


def test_a_corrupt_header_is_a_permanent_config_error():
    bad = b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all"
    server = CheckpointHub({"org/bad": Repo({"config.json": b"{}", "model.safetensors": bad})})
    try:
        with pytest.raises(cs.ConfigSourceError) as err:
            cs.resolve_model_weights({"model": "org/bad"}, "spec.target", hub_endpoint=server.url, hub_token=None)
    finally:
        server.close()
    assert err.value.reason == api.REASON_CONFIG_INVALID and not err.value.transient
    assert "not valid JSON" in err.value.message


def test_fp8_kv_cache_halves_kv_bytes_and_reaches_the_engine():
    spec = {"target": {"model": "meta-llama/Llama-3.1-8B-Instruct"}, "draft": {"model": "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B"},
            "speculative": {"algorithm": "EAGLE3", "numSteps": 3, "topk": 1, "numDraftTokens": 4},
            "engine": {"maxRunningRequests": 32, "contextLength": 8192}, "gpu": {"product": "h200"}}
    bf16 = plan_engine(spec, LLAMA, EAGLE3).plan
    spec["engine"]["kvCacheDtype"] = "fp8_e4m3"
    planned = plan_engine(spec, LLAMA, EAGLE3)
    fp8 = planned.plan
    assert fp8["target"]["kv_cache_dtype"] == fp8["draft"]["kv_cache_dtype"] == "fp8_e4m3"
    assert fp8["target"]["kv_cache_bytes_per_token"] * 2 == bf16["target"]["kv_cache_bytes_per_token"] == 131072
    assert fp8["memory_per_gpu"]["kv_cache_bytes_per_token"] * 2 == bf16["memory_per_gpu"]["kv_cache_bytes_per_token"]
    assert fp8["max_total_tokens"] > 1.9 * bf16["max_total_tokens"]
    args = render.engine_args({**render.engine_settings(spec), "dtype": "bfloat16"})
    assert args[args.index("--kv-cache-dtype") + 1] == "fp8_e4m3"


def test_weights_are_read_once_per_revision_for_a_while(hub):
    clock = [1000.0]
    spec = {"model": "deepseek-ai/DeepSeek-V4-Flash", "revision": "refs/pr/3"}

    def read():
        return cs.resolve_model_weights(spec, "spec.target", hub_endpoint=hub.url, hub_token=None, now=lambda: clock[0])

    first = read()
    requests = len(hub.requests)
    assert read() == first and len(hub.requests) == requests  # a retry seconds later: no request
    clock[0] += cs.WEIGHTS_CACHE_TTL_S + 1
    assert read() == first and len(hub.requests) > requests  # later, the revision is read again
