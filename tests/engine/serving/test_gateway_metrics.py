"""/metrics speaks the Gateway API Inference Extension's model-server protocol, and the
autoscaling signals (queue, KV use, TTFT, speculation-aware saturation) are there.

The protocol's names are read from a copy of its document (data/gateway-model-server-protocol.md:
docs/proposals/003-model-server-protocol/README.md of kubernetes-sigs/gateway-api-inference-extension
at v1.6.0, commit f9a325ec978f164388bec411297ef6cc03a2bc9a), so a rename there fails here."""

from __future__ import annotations

import asyncio
import re
import time
from pathlib import Path

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

from specdeploy.engine.serving.metrics import EngineMetrics

PROTOCOL = Path(__file__).parent / "data" / "gateway-model-server-protocol.md"


def protocol_names() -> dict[str, tuple[str, tuple[str, ...]]]:
    """{protocol metric: (vLLM's metric name, label names it is read from)} from the document's
    table and its LoRA section."""
    names = {}
    for row in PROTOCOL.read_text().splitlines():
        cells = [c.strip() for c in row.strip().strip("|").split("|")]
        if len(cells) < 4 or not cells[3].startswith(("`vllm:", "name: `vllm:")):
            continue
        metric = cells[0].replace("[Optional]", "").strip()
        name = re.search(r"`(vllm:[a-z_]+)`", cells[3]).group(1)
        names[metric] = (name, tuple(re.findall(r"label name: `([a-z_]+)`", cells[3])))
    lora = PROTOCOL.read_text().split("### LoRA Adapter Serving", 1)[1].split("###", 1)[0]
    names["LoRA"] = (re.search(r"`(vllm:[a-z_]+)`", lora).group(1),
                     tuple(re.findall(r"\* `([a-z_]+)`:", lora)))
    return names


def families(base_url: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(httpx.get(f"{base_url}/metrics").text)}


def test_the_protocol_document_names_what_this_test_expects():
    names = protocol_names()
    assert names["TotalQueuedRequests"] == ("vllm:num_requests_waiting", ())
    assert names["TotalRunningRequests"] == ("vllm:num_requests_running", ())
    assert names["KVCacheUtilization"] == ("vllm:kv_cache_usage_perc", ())
    assert names["BlockSize"] == ("vllm:cache_config_info", ("block_size",))
    assert names["NumGPUBlocks"] == ("vllm:cache_config_info", ("num_gpu_blocks",))
    assert names["LoRA"] == ("vllm:lora_requests_info", ("max_lora", "running_lora_adapters", "waiting_lora_adapters"))


def test_metrics_serve_every_name_of_the_protocol(server):
    served = families(server.url)
    for metric, (name, labels) in protocol_names().items():
        assert name in served, f"{metric}: {name} not in /metrics"
        family = served[name]
        assert family.type == "gauge", (name, family.type)
        (sample,) = family.samples
        assert set(labels) <= set(sample.labels), (name, sample.labels)
    (blocks,) = served["vllm:cache_config_info"].samples
    assert blocks.labels["block_size"] == "1" and int(blocks.labels["num_gpu_blocks"]) > 0
    (lora,) = served["vllm:lora_requests_info"].samples
    assert lora.labels["max_lora"] == "0" and lora.labels["running_lora_adapters"] == ""
    assert abs(lora.value - time.time()) < 24 * 3600  # a timestamp, as the protocol asks


def test_gateway_names_and_saturation_follow_the_engine_under_load(server):
    """While requests run and queue: the protocol's gauges are the engine's own, and saturation is
    (running + queued) / maxRunningRequests (no adaptive speculation here)."""
    client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
    wanted = server.max_queued_requests  # all at once: more would be refused (429) while queued

    async def load() -> list:
        return await asyncio.gather(*(client.completions.create(
            model=server.model, prompt=f"def f{i}(", max_tokens=48, temperature=0.0,
            extra_body={"ignore_eos": True}) for i in range(wanted)))

    async def run() -> tuple[list, list[dict]]:
        task = asyncio.create_task(load())
        seen = []
        async with httpx.AsyncClient() as http:
            while not task.done():
                text = (await http.get(f"{server.url}/metrics")).text
                seen.append({s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples})
                await asyncio.sleep(0.02)
        return await task, seen

    completions, seen = asyncio.run(run())
    assert all(c.usage.completion_tokens == 48 for c in completions)
    busy = [m for m in seen if m["specdeploy_num_requests_running"] > 0]
    assert busy, "no scrape saw a running request"
    for m in busy:
        assert m["vllm:num_requests_running"] == m["specdeploy_num_requests_running"]
        assert m["vllm:num_requests_waiting"] == m["specdeploy_num_requests_waiting"]
        assert m["vllm:kv_cache_usage_perc"] == m["specdeploy_kv_slot_usage_ratio"]
        in_flight = m["specdeploy_num_requests_running"] + m["specdeploy_num_requests_waiting"]
        assert m["specdeploy_saturation"] == in_flight / server.max_running_requests
    assert max(m["specdeploy_saturation"] for m in busy) > 0.5


def test_saturation_counts_the_crossover_of_adaptive_speculation():
    metrics = EngineMetrics("m")
    metrics.serving_capacity(max_running_requests=32, kv_slots=1000)
    metrics.num_requests_running.set(6)
    metrics.num_requests_waiting.set(2)
    assert metrics.saturation() == 8 / 32
    # Adaptive speculation predicts plain decoding wins from 10 requests: 8 of 10.
    metrics.adaptive_estimates({"acceptance_rates": {}, "expected_tokens": {}, "crossover_batch": 10})
    assert metrics.saturation() == 8 / 10
    # No crossover within the batch sizes it knows: the running batch is the limit.
    metrics.adaptive_estimates({"acceptance_rates": {}, "expected_tokens": {}, "crossover_batch": None})
    assert metrics.saturation() == 8 / 32
