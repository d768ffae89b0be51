"""Engine /metrics -> status.serving figures, scraped from real local HTTP servers that serve the
engine's own Prometheus registry."""

from __future__ import annotations

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from specdeploy.engine.models.checkpoint import LoadProgress
from specdeploy.engine.serving.metrics import EngineMetrics
from specdeploy.operator.cluster import serving_metrics as sm
from specdeploy.operator.desired import status
from specdeploy.operator.desired.pods import blocked as pods_blocked


def serve(metrics: EngineMetrics):
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            body = metrics.render()
            self.send_response(200 if self.path == "/metrics" else 404)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.fixture
def two_engines():
    a, b = EngineMetrics("llama"), EngineMetrics("llama")
    # engine a: 100 verify steps, 180 drafts accepted; engine b: 50 steps, 120 accepted
    a.spec_decode_num_steps.inc(100)
    a.spec_decode_num_accepted_tokens.inc(180)
    a.generation_throughput.set(900.0)
    b.spec_decode_num_steps.inc(50)
    b.spec_decode_num_accepted_tokens.inc(120)
    b.generation_throughput.set(450.5)
    servers = [serve(a), serve(b)]
    yield [f"http://127.0.0.1:{s.server_address[1]}/metrics" for s in servers]
    for s in servers:
        s.shutdown()
        s.server_close()


def closed_port_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}/metrics"


def test_scrape_and_summarize(two_engines):
    samples, errors = sm.scrape(two_engines + [closed_port_url()], timeout_s=1)
    assert len(samples) == 2 and len(errors) == 1 and "ConnectError" in errors[0]
    figures = sm.summarize(samples)
    # 1 + (180 + 120) / (100 + 50)
    assert figures == {"meanAcceptLength": 3.0, "tokensPerSecond": 1350.5, "saturation": 0.0}


def test_adaptive_engines_report_their_shape_and_acceptance():
    from specdeploy.engine.speculative.adaptive import NONE, SpecShape

    def engine(shape, rates):
        m = EngineMetrics("llama")
        m.spec_decode_num_steps.inc(10)
        m.spec_decode_num_accepted_tokens.inc(20)
        m.decode_shape(SpecShape(2, 1, 3))
        m.decode_shape(shape)           # the last decode step's shape is the current one
        m.adaptive_estimates({"acceptance_rates": {"chain": rates}, "expected_tokens": {"none": 1.0},
                              "crossover_batch": 32})
        return sm.parse_engine_metrics(m.render().decode())

    a, b = engine(SpecShape(3, 1, 4), [0.8, 0.7, 0.6]), engine(NONE, [0.6, 0.5, 0.4])
    assert a.shape == "3,1,4" and b.shape == "none" and a.acceptance_rates == (0.8, 0.7, 0.6)
    figures = sm.summarize([a, b])
    assert figures["speculativeShape"] == "3,1,4/none"
    assert figures["acceptanceRates"] == [0.7, 0.6, 0.5]
    assert figures["crossoverBatchSize"] == 32
    assert sm.summarize([a])["speculativeShape"] == "3,1,4"
    # A fixed-shape engine reports neither.
    fixed = sm.summarize([sm.parse_engine_metrics(EngineMetrics("x").render().decode())])
    assert "speculativeShape" not in fixed and "acceptanceRates" not in fixed and "crossoverBatchSize" not in fixed
    st = status.engine_metrics({}, figures)
    assert st["serving"]["speculativeShape"] == "3,1,4/none" and st["serving"]["acceptanceRates"] == [0.7, 0.6, 0.5]
    assert st["serving"]["crossoverBatchSize"] == 32


def test_prefix_cache_hit_rate_over_the_pods():
    a, b = EngineMetrics("llama"), EngineMetrics("llama")
    a.prefix_cache_queries.inc(1000)
    a.prefix_cache_hits.inc(900)
    b.prefix_cache_queries.inc(3000)
    b.prefix_cache_hits.inc(100)
    samples = [sm.parse_engine_metrics(m.render().decode()) for m in (a, b)]
    figures = sm.summarize(samples)
    assert figures["prefixCacheHitRate"] == 0.25                 # (900 + 100) / (1000 + 3000)
    st = status.engine_metrics({}, figures)
    assert st["serving"]["prefixCacheHitRate"] == 0.25
    # An engine with the cache off looks nothing up: no figure rather than a hit rate of 0.
    assert "prefixCacheHitRate" not in sm.summarize([sm.parse_engine_metrics(EngineMetrics("x").render().decode())])


def test_no_steps_yet_gives_throughput_only():
    fresh = sm.parse_engine_metrics(EngineMetrics("x").render().decode())
    assert sm.summarize([fresh]) == {"tokensPerSecond": 0.0, "saturation": 0.0}
    assert sm.summarize([]) == {}


def test_only_ready_pods_with_an_ip_are_scraped():
    def pod(ip, ready, deleting=False):
        meta = {"name": ip or "x", **({"deletionTimestamp": "2026-01-01T00:00:00Z"} if deleting else {})}
        return {"metadata": meta, "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}

    pods = [pod("10.0.0.1", True), pod("10.0.0.2", False), pod(None, True), pod("10.0.0.3", True, deleting=True)]
    assert sm.ready_pod_metrics_urls(pods) == ["http://10.0.0.1:8000/metrics"]


def test_ipv6_pod_ips_are_bracketed_and_a_bad_url_fails_only_its_pod(two_engines):
    pods = [
        {"metadata": {"name": ip}, "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": "True"}]}}
        for ip in ("fd00:10:244::5", "10.0.0.1")
    ]
    assert sm.ready_pod_metrics_urls(pods) == ["http://[fd00:10:244::5]:8000/metrics", "http://10.0.0.1:8000/metrics"]
    # A URL httpx refuses to parse (InvalidURL is not an HTTPError) is one pod's error, not the round's.
    samples, errors = sm.scrape(["http://fd00::5:8000/metrics", *two_engines], timeout_s=1)
    assert len(samples) == 2 and len(errors) == 1 and "fd00::5" in errors[0]


def test_figures_land_in_status_and_survive_replica_updates():
    st = status.engine_metrics({"serving": {"readyReplicas": 2}}, {"meanAcceptLength": 3.0, "tokensPerSecond": 10.0})
    assert st["serving"] == {"readyReplicas": 2, "meanAcceptLength": 3.0, "tokensPerSecond": 10.0}
    dep = {"metadata": {"name": "d", "generation": 1, "annotations": {}}, "spec": {"replicas": 2}, "status": {"readyReplicas": 1}}
    after = status.serving(st, dep, generation=1, now="2026-01-01T00:00:00Z")
    assert after["serving"]["meanAcceptLength"] == 3.0 and after["serving"]["readyReplicas"] == 1


def test_tokens_per_second_is_a_rate_over_the_window():
    """A burst then silence: the rate over the window, not the last interval's 489 then 0."""
    from specdeploy.operator.cluster.serving_metrics import EngineSample, TokenRate

    def sample(tokens, gauge=0.0):
        return EngineSample(0, 0, gauge, generated_tokens=tokens)

    rates = TokenRate(window_s=60)
    assert rates.rate("pod", 0.0, sample(0, gauge=7.0)) == 7.0          # one scrape: the engine's own figure
    assert rates.rate("pod", 10.0, sample(4890)) == 489.0                # the burst
    assert rates.rate("pod", 30.0, sample(4890)) == 4890 / 30            # then silence: still averaged
    assert rates.rate("pod", 75.0, sample(4890)) == 0.0                  # the burst left the window
    assert rates.rate("pod", 80.0, sample(10, gauge=2.0)) == 2.0        # a restart: the counter went back
    assert rates.rate("pod", 85.0, sample(60)) == (60 - 10) / 5
    rates.forget_except([])
    assert rates.rate("pod", 90.0, sample(100, gauge=3.0)) == 3.0


def serve_health(body: dict):
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            data = json.dumps(body).encode()
            self.send_response(200 if self.path == "/health" else 404)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def test_loading_pods_say_how_far_they_are_from_their_health():
    def pod(name, ip, running, ready):
        state = {"running": {"startedAt": "2026-01-01T00:00:00Z"}} if running else {"waiting": {"reason": "x"}}
        return {"metadata": {"name": name},
                "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
                           "containerStatuses": [{"name": "engine", "ready": ready, "state": state}]}}

    pods = [pod("loading", "10.0.0.1", True, False), pod("serving", "10.0.0.2", True, True),
            pod("creating", "10.0.0.3", False, False), pod("no-ip", None, True, False)]
    assert sm.loading_pod_health_urls(pods) == {"loading": "http://10.0.0.1:8000/health"}
    # What the engine's /health says while it loads (engine/serving/server.py), and once loaded.
    progress = LoadProgress()
    progress.start(4 * 2**30)
    progress.add(3 * 2**29)
    loading, loaded = serve_health({"status": "ok", "loading": progress.figures()}), serve_health({"status": "ok"})
    try:
        urls = {name: f"http://127.0.0.1:{s.server_address[1]}/health"
                for name, s in (("loading", loading), ("loaded", loaded))}
        found = sm.loading_progress({**urls, "gone": closed_port_url()}, timeout_s=1)
    finally:
        for s in (loading, loaded):
            s.shutdown()
            s.server_close()
    assert found == {"loading": {"loaded_bytes": 3 * 2**29, "total_bytes": 4 * 2**30}}
    blocked = pods_blocked([pods[0]], progress=found, weight_bytes=5 * 2**30)
    assert blocked.reason == "EngineLoading" and "1.5 GiB of 4.0 GiB of weights loaded" in blocked.message
    assert sm.parse_loading({"loading": {"loaded_bytes": "x", "total_bytes": 1}}) is None
    assert sm.parse_loading({"loading": {"loaded_bytes": 0, "total_bytes": 0}}) is None
    assert sm.parse_loading([]) is None
