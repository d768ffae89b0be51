"""Prometheus metrics of one engine server, in a registry of its own (several apps can live in
one process, e.g. in tests, without colliding in the global registry).

Speculative-decoding counters use the `spec_decode_` names that vLLM and SGLang dashboards know:
mean acceptance length = 1 + accepted / (draft-verify steps), acceptance rate = accepted / proposed.
"""

from __future__ import annotations

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

    def request_finished(self, endpoint: str, finish_reason: str) -> None:
        self._requests.labels(endpoint=endpoint, finish_reason=finish_reason, **self._labels).inc()

    def request_rejected(self, reason: str) -> None:
        self._rejected.labels(reason=reason, **self._labels).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
