"""Back-pressure, client disconnects, metrics and SIGTERM draining."""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families


def wait_until(predicate, timeout_s: float = 20.0, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def idle(server) -> bool:
    m = server.metrics()
    return (m["specdeploy_num_requests_running{}"] == 0 and m["specdeploy_num_requests_waiting{}"] == 0
            and m["specdeploy_kv_slot_usage_ratio{}"] == 0)


def test_client_disconnect_aborts_and_frees_slots(server):
    wait_until(lambda: idle(server), what="an idle server")
    aborted_before = server.metrics().get("specdeploy_requests_total{endpoint=completions,finish_reason=abort}", 0)
    body = {"model": server.model, "prompt": "x", "max_tokens": server.context_length - 16, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
        events = r.iter_lines()
        data = [line for line in (next(events) for _ in range(6)) if line.startswith("data: ")]
        assert data, "the stream should have started"
        running = server.metrics()
        assert running["specdeploy_num_requests_running{}"] == 1
        assert running["specdeploy_kv_slot_usage_ratio{}"] > 0
    # The client hung up: the server must notice, abort the request and give its KV slots back.
    wait_until(lambda: idle(server), what="the aborted request's slots to be freed")
    after = server.metrics()["specdeploy_requests_total{endpoint=completions,finish_reason=abort}"]
    assert after == aborted_before + 1


def test_client_giving_up_on_a_whole_response_aborts_it(server):
    wait_until(lambda: idle(server), what="an idle server")
    key = "specdeploy_requests_total{endpoint=chat_completions,finish_reason=abort}"
    aborted_before = server.metrics().get(key, 0)
    body = {"model": server.model, "messages": [{"role": "user", "content": "go on"}],
            "max_tokens": server.context_length - 32, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):  # the client hangs up before the answer is complete
        httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=httpx.Timeout(5, read=0.15))
    wait_until(lambda: idle(server), what="the abandoned request's slots to be freed")
    assert server.metrics()[key] == aborted_before + 1


async def test_overload_gets_429_and_the_rest_complete(server, async_client):
    wait_until(lambda: idle(server), what="an idle server")
    n = 4 * (server.max_running_requests + server.max_queued_requests)

    async def one(i):
        try:
            out = await async_client.completions.create(
                model=server.model, prompt=f"item {i}", max_tokens=server.context_length - 16,
                temperature=0, extra_body={"ignore_eos": True})
            return out.choices[0].finish_reason
        except openai.RateLimitError as e:
            assert e.status_code == 429
            assert e.body["code"] == "queue_full" and "capacity" in e.body["message"]
            return 429

    results = await asyncio.gather(*(one(i) for i in range(n)))
    assert results.count(429) >= n - (server.max_running_requests + server.max_queued_requests) - 2
    assert results.count("length") >= server.max_running_requests, results
    assert set(results) <= {429, "length"}
    wait_until(lambda: idle(server), what="all slots to be free again")
    assert server.metrics()["specdeploy_requests_rejected_total{reason=queue_full}"] >= results.count(429)
    ok = await async_client.completions.create(model=server.model, prompt="still here", max_tokens=3)
    assert ok.usage.completion_tokens >= 1


def test_metrics_parse_and_count_speculation(server, client):
    before = server.metrics()
    out = client.completions.create(model=server.model, prompt="def speculate(", max_tokens=40, temperature=0,
                                    extra_body={"ignore_eos": True})
    text = httpx.get(f"{server.url}/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in ["specdeploy_requests", "specdeploy_request_latency_seconds",
                 "specdeploy_time_to_first_token_seconds", "specdeploy_generation_tokens",
                 "specdeploy_prompt_tokens", "specdeploy_generation_tokens_per_second",
                 "specdeploy_spec_decode_num_draft_tokens", "specdeploy_spec_decode_num_accepted_tokens",
                 "specdeploy_spec_decode_acceptance_length", "specdeploy_num_requests_waiting",
                 "specdeploy_num_requests_running", "specdeploy_kv_slot_usage_ratio"]:
        assert name in families, f"{name} missing from /metrics"
    after = server.metrics()

    def grew(key):
        return after[key] - before.get(key, 0)

    assert grew("specdeploy_generation_tokens_total{}") == out.usage.completion_tokens == 40
    assert grew("specdeploy_prompt_tokens_total{}") == out.usage.prompt_tokens
    assert grew("specdeploy_requests_total{endpoint=completions,finish_reason=length}") == 1
    assert grew("specdeploy_time_to_first_token_seconds_count{}") == 1
    proposed = grew("specdeploy_spec_decode_num_draft_tokens_total{}")
    accepted = grew("specdeploy_spec_decode_num_accepted_tokens_total{}")
    steps = grew("specdeploy_spec_decode_acceptance_length_count{}")
    assert proposed > 0 and 0 < accepted <= proposed, "the toy draft is built to be accepted often"
    # 40 tokens = 1 from prefill + the decode steps' accepted drafts + one bonus token per step,
    # less what the last step committed past max_tokens (at most its 3 drafts)
    assert 40 <= 1 + accepted + steps <= 40 + 3
    assert grew("specdeploy_spec_decode_acceptance_length_sum{}") == accepted + steps


def test_sigterm_drains_in_flight_requests_then_exits_zero(engine_process):
    proc, url = engine_process("--context-length", "1024", "--max-total-tokens", "4096")
    body = {"model": "tiny-target", "prompt": "drain me", "max_tokens": 900, "stream": True, "ignore_eos": True}
    events: list[str] = []
    started = threading.Event()

    def stream():
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line:
                    events.append(line)
                    started.set()

    reader = threading.Thread(target=stream)
    reader.start()
    assert started.wait(60), "the long request never started streaming"
    proc.send_signal(signal.SIGTERM)
    # While draining: not ready, new work refused with 503, the old request still streaming.
    ready = wait_until(lambda: (r := httpx.get(f"{url}/ready")).status_code == 503 and r, what="/ready 503")
    assert ready.json()["reason"] == "draining"
    refused = httpx.post(f"{url}/v1/completions", json={"model": "tiny-target", "prompt": "late", "max_tokens": 2})
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "draining"
    assert reader.is_alive(), "the in-flight request should still be running during the drain"
    reader.join(timeout=120)
    assert events[-1] == "data: [DONE]"
    final = json.loads(events[-2].removeprefix("data: "))
    assert final["choices"][0]["finish_reason"] == "length"
    assert proc.wait(timeout=60) == 0
    logs = proc.stdout.read()
    assert "draining" in logs and "drained in" in logs


def test_a_model_that_cannot_load_stops_the_server_with_the_reason(tmp_path):
    from specdeploy.engine.serving.cli import ServerThread, free_port

    broken = ServerThread(["engine", "serve", "--target", str(tmp_path), "--algorithm", "NONE",
                           "--host", "127.0.0.1", "--port", str(free_port())])
    with pytest.raises(RuntimeError, match="config.json"):
        broken.start(timeout_s=60)
    broken.stop()
    assert broken.server.exit_code == 2  # a directory without config.json: the user's to fix


def test_health_answers_while_loading_and_ready_waits_for_the_engine(model_dirs):
    """Kubernetes must not kill a pod that is still loading: /health is 200 from the first second,
    /ready (and the API) 503 until the engine can serve."""
    import argparse

    import uvicorn

    from specdeploy.engine.serving import boot
    from specdeploy.engine.serving import cli as serve_cli
    from specdeploy.engine.serving.metrics import EngineMetrics
    from specdeploy.engine.serving.server import DrainingServer, EngineState, create_app

    parser = argparse.ArgumentParser()
    serve_cli.add_parser(parser.add_subparsers())
    args = parser.parse_args(["engine", "serve", "--target", str(model_dirs[0]), "--dtype", "float32",
                              "--max-total-tokens", "512", "--max-running-requests", "2"])
    release = threading.Event()

    def slow_loader(metrics):  # weights that take a while to arrive
        release.wait(60)
        return boot.load_engine(args, metrics)

    state = EngineState(model_name="slow", metrics=EngineMetrics("slow"))
    port = serve_cli.free_port()
    server = DrainingServer(uvicorn.Config(None, host="127.0.0.1", port=port, log_config=None), state)
    server.config.app = create_app(state, loader=slow_loader, on_load_failure=server.fail)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    base_url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: _get(base_url, "/health") == 200, what="/health")
        ready = httpx.get(f"{base_url}/ready")
        assert ready.status_code == 503 and ready.json()["reason"] == "loading weights"
        resp = httpx.post(f"{base_url}/v1/completions", json={"model": "slow", "prompt": "x"})
        assert resp.status_code == 503 and resp.json()["error"]["code"] == "not_ready"
        release.set()
        wait_until(lambda: _get(base_url, "/ready") == 200, what="/ready after loading")
        ok = httpx.post(f"{base_url}/v1/completions", json={"model": "slow", "prompt": "x", "max_tokens": 2})
        assert ok.status_code == 200
    finally:
        release.set()
        server.should_exit = True
        thread.join(timeout=30)


def _get(base_url: str, path: str) -> int | None:
    try:
        return httpx.get(f"{base_url}{path}", timeout=2).status_code
    except httpx.TransportError:
        return None


@pytest.mark.parametrize("how", ["second SIGTERM", "drain timeout"])
def test_a_drain_is_bounded(engine_process, how):
    """A second SIGTERM, or the drain timeout (the operator renders it inside the pod's grace
    period), stops the server at once: an open stream is cut, not waited for."""
    extra = ("--drain-timeout-s", "1") if how == "drain timeout" else ()
    proc, url = engine_process("--context-length", "4096", "--max-total-tokens", "8192", *extra)
    body = {"model": "tiny-target", "prompt": "never done", "max_tokens": 4000, "stream": True, "ignore_eos": True}
    events: list[str] = []
    started = threading.Event()

    def stream():
        try:
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
                for line in r.iter_lines():
                    if line:
                        events.append(line)
                        started.set()
        except httpx.HTTPError:
            pass  # cut: what this test wants

    reader = threading.Thread(target=stream)
    reader.start()
    assert started.wait(60), "the long request never started streaming"
    proc.send_signal(signal.SIGTERM)
    wait_until(lambda: httpx.get(f"{url}/ready").status_code == 503, what="/ready 503")
    t0 = time.monotonic()
    if how == "second SIGTERM":
        proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=30)
    stopped_s = time.monotonic() - t0
    reader.join(30)
    assert not reader.is_alive()
    assert events and events[-1] != "data: [DONE]", "the stream should have been cut"
    assert stopped_s < 10, stopped_s
    logs = proc.stdout.read()
    assert ("stopping now" if how == "second SIGTERM" else "drain timeout") in logs
