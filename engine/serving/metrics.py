"""Prometheus metrics of one engine server, in a registry of its own (several apps can live in
one process, e.g. in tests, without colliding in the global registry).

Speculative-decoding counters use the `spec_decode_` names that vLLM and SGLang dashboards know:
mean acceptance length = 1 + accepted / (draft-verify steps), acceptance rate = accepted / proposed.

With adaptive speculation the engine also shows what it chose and why: the shape of the last
decode step (`spec_decode_shape_num_steps` / `_topk` / `_num_draft_tokens`, all 0 for NONE, and
`spec_decode_shape{shape="S,K,N"|"none"}` 1 for the current one), decode steps per shape, the
measured per-depth acceptance rate P(accepted >= d | accepted >= d - 1) of chain drafts, the
expected tokens per request-step of every shape, and the smallest batch size at which the policy
would stop speculating (0: at none of its batch sizes).

Saturation, the autoscaling signal that counts speculation (`specdeploy_saturation`): requests
running and queued over the batch this replica serves well, which is the smallest of
maxRunningRequests and, with adaptive speculation, the crossover batch at which the policy stops
speculating. 1.0 means a replica at that batch: a target below 1 adds a replica before
speculation has to be given up, rather than after the queue grows.

The Gateway API Inference Extension's model-server protocol
(gateway-api-inference-extension docs/proposals/003-model-server-protocol) is served under the
names its reference endpoint picker reads by default, vLLM's: `vllm:num_requests_waiting`,
`vllm:num_requests_running`, `vllm:kv_cache_usage_perc` (a 0..1 fraction, as vLLM's),
`vllm:cache_config_info{block_size, num_gpu_blocks}` (the prefix scorer's block geometry: one
token per KV slot, the pool's slots) and `vllm:lora_requests_info` (no adapters: max_lora 0).
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_PREFIX = "specdeploy"

# Latency buckets span a CPU demo (seconds per request) and a GPU server (tens of ms to first token).
_LATENCY_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
# Tokens committed per request per step: 1 (nothing accepted) up to num_draft_tokens + 1.
_ACCEPT_LENGTH_BUCKETS = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16)


class EngineMetrics:
    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        labels = {"model_name": model_name}
        r = self.registry

        def counter(name, doc, extra=()):
            return Counter(f"{_PREFIX}_{name}", doc, ["model_name", *extra], registry=r)

        def gauge(name, doc):
            return Gauge(f"{_PREFIX}_{name}", doc, ["model_name"], registry=r).labels(**labels)

        def histogram(name, doc, buckets):
            return Histogram(f"{_PREFIX}_{name}", doc, ["model_name"], buckets=buckets, registry=r).labels(**labels)

        self._labels = labels
        self._requests = counter("requests", "Finished requests by endpoint and finish reason.",
                                 ("endpoint", "finish_reason"))
        self._rejected = counter("requests_rejected", "Requests refused before admission, by reason.",
                                 ("reason",))
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of admitted requests.").labels(**labels)
        self.generation_tokens = counter("generation_tokens", "Generated tokens.").labels(**labels)
        self.request_latency_s = histogram("request_latency_seconds", "End-to-end request latency.",
                                           _LATENCY_BUCKETS_S)
        self.time_to_first_token_s = histogram("time_to_first_token_seconds",
                                               "Time from arrival to the first generated token.",
                                               _LATENCY_BUCKETS_S)
        self.generation_throughput = gauge("generation_tokens_per_second",
                                           "Generated tokens per second over the last log interval.")
        self.spec_decode_num_draft_tokens = counter(
            "spec_decode_num_draft_tokens", "Draft tokens proposed to the target for verification.").labels(**labels)
        self.spec_decode_num_accepted_tokens = counter(
            "spec_decode_num_accepted_tokens", "Draft tokens the target accepted.").labels(**labels)
        self.spec_decode_num_steps = counter(
            "spec_decode_num_steps", "Per-request decode steps (one verify of one request).").labels(**labels)
        self.spec_decode_acceptance_length = histogram(
            "spec_decode_acceptance_length", "Tokens committed per request per decode step (accepted drafts + 1).",
            _ACCEPT_LENGTH_BUCKETS)
        self.num_requests_waiting = gauge("num_requests_waiting", "Requests queued for admission.")
        self.num_requests_running = gauge("num_requests_running", "Requests admitted into the running batch.")
        self.kv_slot_usage = gauge("kv_slot_usage_ratio", "Fraction of KV cache token slots in use (0..1).")
        self.admission_stalled = gauge("admission_stalled",
                                       "1 while the queue's head has waited past the stall timeout with no engine "
                                       "step run meanwhile (/ready answers 503).")
        self.queue_head_wait_s = gauge("queue_head_wait_seconds",
                                       "How long the queue's head has waited for room (0: nothing is waiting).")
        self.spec_decode_adaptive = gauge("spec_decode_adaptive", "1 when the speculative shape is chosen per step.")
        self.shape_num_steps = gauge("spec_decode_shape_num_steps", "Draft steps of the last decode step's shape (0: NONE).")
        self.shape_topk = gauge("spec_decode_shape_topk", "Branches per draft step of the last decode step's shape (0: NONE).")
        self.shape_num_draft_tokens = gauge("spec_decode_shape_num_draft_tokens",
                                            "Tokens verified per request by the last decode step's shape (0: NONE).")
        self.crossover_batch_size = gauge("spec_decode_crossover_batch_size",
                                          "Smallest batch size at which speculation is predicted to lose (0: none).")
        self._shape = Gauge(f"{_PREFIX}_spec_decode_shape", "1 for the shape of the last decode step.",
                            ["model_name", "shape"], registry=r)
        self._shape_steps = counter("spec_decode_shape_steps", "Decode steps run in each shape.", ("shape",))
        self._acceptance_rate = Gauge(f"{_PREFIX}_spec_decode_acceptance_rate",
                                      "Measured P(accepted >= depth | accepted >= depth - 1), chain drafts.",
                                      ["model_name", "depth"], registry=r)
        self._expected_tokens = Gauge(f"{_PREFIX}_spec_decode_expected_tokens_per_step",
                                      "Predicted tokens per request per decode step of each shape.",
                                      ["model_name", "shape"], registry=r)
        self._last_shape: str | None = None
        # Prefix cache (vLLM's names): hit rate = hits / queries, in prompt tokens.
        self.prefix_cache_queries = counter(
            "prefix_cache_queries", "Prompt tokens of requests looked up in the prefix cache.").labels(**labels)
        self.prefix_cache_hits = counter(
            "prefix_cache_hits", "Prompt tokens found in the prefix cache (not prefilled again).").labels(**labels)
        self.prefix_cache_hit_rate = gauge(
            "prefix_cache_hit_rate", "Prompt tokens found in the prefix cache per prompt token looked up, "
            "over the last log interval (0..1).")
        self.prefix_cache_slots = gauge(
            "prefix_cache_slots", "KV token slots held by the prefix cache (unused ones are evicted when needed).")

        # Saturation and the inference gateway's names are read from the gauges above at scrape time.
        self.max_running_requests = 0
        Gauge(f"{_PREFIX}_saturation", "Requests running and queued per request this replica serves well "
              "(the smaller of max running requests and the adaptive crossover batch); 1.0 is that batch.",
              ["model_name"], registry=r).labels(**labels).set_function(self.saturation)
        for name, doc, source in (
            ("vllm:num_requests_waiting", "Requests queued (inference gateway model-server protocol).",
             self.num_requests_waiting),
            ("vllm:num_requests_running", "Requests running (inference gateway model-server protocol).",
             self.num_requests_running),
            ("vllm:kv_cache_usage_perc", "KV cache usage, 0..1 (inference gateway model-server protocol).",
             self.kv_slot_usage),
        ):
            Gauge(name, doc, ["model_name"], registry=r).labels(**labels).set_function(
                lambda g=source: _gauge_value(g))
        self._cache_config = Gauge("vllm:cache_config_info", "KV cache geometry: tokens per block, blocks.",
                                   ["model_name", "block_size", "num_gpu_blocks"], registry=r)
        Gauge("vllm:lora_requests_info", "LoRA adapters: none are served (max_lora 0).",
              ["model_name", "max_lora", "running_lora_adapters", "waiting_lora_adapters"], registry=r).labels(
            max_lora="0", running_lora_adapters="", waiting_lora_adapters="", **labels).set(time.time())

    def serving_capacity(self, max_running_requests: int, kv_slots: int) -> None:
        """The engine's limits: its running batch and its KV pool's token slots."""
        self.max_running_requests = max_running_requests
        self._cache_config.labels(block_size="1", num_gpu_blocks=str(kv_slots), **self._labels).set(1)

    def saturation(self) -> float:
        load = _gauge_value(self.num_requests_running) + _gauge_value(self.num_requests_waiting)
        capacity = self.max_running_requests
        crossover = _gauge_value(self.crossover_batch_size)
        if crossover > 0 and _gauge_value(self.spec_decode_adaptive):
            capacity = min(capacity, crossover) if capacity else crossover
        return load / capacity if capacity else 0.0

    def request_finished(self, endpoint: str, finish_reason: str) -> None:
        self._requests.labels(endpoint=endpoint, finish_reason=finish_reason, **self._labels).inc()

    def request_rejected(self, reason: str) -> None:
        self._rejected.labels(reason=reason, **self._labels).inc()

    def rejected_total(self) -> int:
        """Refused requests since start, every reason (each 4xx / 5xx answer is one)."""
        return int(sum(sample.value for family in self._rejected.collect() for sample in family.samples
                       if sample.name.endswith("_total")))

    def decode_shape(self, shape) -> None:
        """After a decode step of `shape` (a SpecShape)."""
        label = shape.label
        self._shape_steps.labels(shape=label, **self._labels).inc()
        if label == self._last_shape:
            return
        if self._last_shape is not None:
            self._shape.labels(shape=self._last_shape, **self._labels).set(0)
        self._shape.labels(shape=label, **self._labels).set(1)
        self._last_shape = label
        none = shape.is_none
        self.shape_num_steps.set(shape.num_steps)
        self.shape_topk.set(0 if none else shape.topk)
        self.shape_num_draft_tokens.set(0 if none else shape.num_draft_tokens)

    def adaptive_estimates(self, snapshot: dict) -> None:
        """The policy's estimates (AdaptivePolicy.snapshot())."""
        self.spec_decode_adaptive.set(1)
        for depth, rate in enumerate(snapshot["acceptance_rates"].get("chain", []), 1):
            self._acceptance_rate.labels(depth=str(depth), **self._labels).set(rate)
        for label, tokens in snapshot["expected_tokens"].items():
            self._expected_tokens.labels(shape=label, **self._labels).set(tokens)
        self.crossover_batch_size.set(snapshot["crossover_batch"] or 0)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _gauge_value(gauge) -> float:
    return gauge._value.get()  # noqa: SLF001 - prometheus_client has no public read of a gauge
