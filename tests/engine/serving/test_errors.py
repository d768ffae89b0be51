"""Bad requests get a 4xx in OpenAI's error format, and the server keeps serving."""

from __future__ import annotations

import httpx
import openai
import pytest
from api_errors import assert_error, assert_still_serving, post


def test_malformed_json(server):
    err = assert_error(post(server, "/v1/completions", '{"model": "x", "prompt": '), 400)
    assert err["type"] == "invalid_request_error" and "JSON" in err["message"]
    assert_still_serving(server)


def test_unknown_model(client, server):
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="no-such-model", prompt="hi", max_tokens=2)
    assert "no-such-model" in info.value.message
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "hi"}])
    assert_still_serving(server)


def test_prompt_longer_than_the_context(client, server):
    long_prompt = list(range(10, 10 + server.context_length + 5))
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=server.model, prompt=long_prompt, max_tokens=1)
    assert "context length" in info.value.message
    with pytest.raises(openai.BadRequestError):  # prompt fits, prompt + max_tokens does not
        client.completions.create(model=server.model, prompt="hi", max_tokens=server.context_length)
    assert_still_serving(server)


@pytest.mark.parametrize("field,value", [
    ("max_tokens", -1),
    ("max_tokens", 0),
    ("max_tokens", "ten"),
    ("max_tokens", 3.5),
    ("temperature", "hot"),
    ("temperature", -0.5),
    ("top_p", 0),
    ("top_k", -5),
    ("prompt", 123),
    ("prompt", None),
    ("stop", 5),
    ("stream", "yes"),
    ("n", 100),
    ("seed", "abc"),
])
def test_bad_completion_fields(server, field, value):
    body = {"model": server.model, "prompt": "hi", "max_tokens": 4, field: value}
    assert_error(post(server, "/v1/completions", body), 400, param=field)


@pytest.mark.parametrize("body", [
    {"messages": []},
    {"messages": "hello"},
    {"messages": [{"role": "wizard", "content": "hi"}]},
    {"messages": [{"content": "hi"}]},
    {"messages": [{"role": "user", "content": 42}]},
])
def test_bad_chat_bodies(server, body):
    assert_error(post(server, "/v1/chat/completions", {"model": server.model, **body}), 400)


def test_token_ids_outside_the_vocabulary(server):
    assert_error(post(server, "/v1/completions", {"model": server.model, "prompt": [1, 10**6], "max_tokens": 2}),
                 400, param="prompt")
    assert_error(post(server, "/v1/completions", {"model": server.model, "prompt": "hi", "max_tokens": 2,
                                                  "stop_token_ids": [-3]}), 400, param="stop_token_ids")


def test_missing_fields_and_empty_prompt(server):
    assert_error(post(server, "/v1/completions", {"prompt": "hi"}), 400, param="model")
    assert_error(post(server, "/v1/completions", {"model": server.model}), 400, param="prompt")
    assert_error(post(server, "/v1/completions", {"model": server.model, "prompt": []}), 400)
    assert_error(post(server, "/v1/completions", {"model": server.model, "prompt": ["a", []]}), 400,
                 param="prompt")


def test_server_survives_all_of_the_above(server):
    assert_still_serving(server)


def test_unsupported_options_are_refused_not_ignored(server):
    body = {"model": server.model, "prompt": "hi", "max_tokens": 2, "suffix": "}"}
    err = assert_error(post(server, "/v1/completions", body), 400, param="suffix")
    assert "not supported" in err["message"]


def test_each_refused_request_is_one_info_line_and_counted(server, caplog):
    """A 4xx leaves one INFO line (method, path, status, code, message) and counts in
    specdeploy_requests_rejected_total by its code."""
    import logging

    def rejected(code: str) -> float:
        for line in httpx.get(f"{server.url}/metrics").text.splitlines():
            if line.startswith("specdeploy_requests_rejected_total{") and f'reason="{code}"' in line:
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    before = rejected("invalid_json")
    with caplog.at_level(logging.INFO, logger="specdeploy.server"):
        assert_error(post(server, "/v1/completions", '{"model": '), 400)
    lines = [r for r in caplog.records if r.name == "specdeploy.server" and "-> 400" in r.getMessage()]
    assert len(lines) == 1 and lines[0].levelno == logging.INFO
    assert "POST /v1/completions -> 400 invalid_json" in lines[0].getMessage()
    assert rejected("invalid_json") == before + 1


def test_failed_requests_are_logged_counted_and_summed_in_the_interval_line(model_dirs, caplog, monkeypatch):
    """A 4xx and a 5xx leave one INFO line each and count in specdeploy_requests_rejected_total;
    the periodic line gives the interval's finished-request rate, those errors and TTFT p50."""
    import logging
    import re
    import time

    from specdeploy.engine.serving.cli import ServerThread

    from engine_server import MODEL_NAME, free_port, metric_samples, serve_argv

    caplog.set_level(logging.INFO, logger="specdeploy")
    running = ServerThread(serve_argv(*model_dirs, free_port())).start(timeout_s=120)  # --log-interval-s 1
    runner = running.state.scheduler.runner
    add = runner.add

    def failing_add(req):
        if req.max_tokens == 7:  # the marked request
            raise RuntimeError("injected admission failure")
        return add(req)

    monkeypatch.setattr(runner, "add", failing_add)
    server = type("S", (), {"url": running.base_url})

    engine_thread = running.state.scheduler._thread.ident  # not another server's of this process

    def interval_lines() -> str:
        return "\n".join(r.getMessage() for r in caplog.records
                         if r.getMessage().startswith("decode: ") and r.thread == engine_thread)

    try:
        for _ in range(3):
            ok = post(server, "/v1/completions", {"model": MODEL_NAME, "prompt": "ok", "max_tokens": 4})
            assert ok.status_code == 200, ok.text
        assert_error(post(server, "/v1/completions", '{"model": '), 400)
        assert_error(post(server, "/v1/completions", {"model": MODEL_NAME, "prompt": "x", "max_tokens": 7}), 500)
        deadline = time.monotonic() + 20
        while sum(map(int, re.findall(r" errors=(\d+) ", interval_lines()))) < 2:  # over one interval or two
            assert time.monotonic() < deadline, "no interval line with the two errors"
            time.sleep(0.1)
        samples = metric_samples(running.base_url)
    finally:
        running.stop()
    refused = [r for r in caplog.records if r.name == "specdeploy.server" and "POST /v1/completions -> " in r.getMessage()]
    assert [r.levelno for r in refused] == [logging.INFO, logging.INFO]
    assert "-> 400 invalid_json" in refused[0].getMessage() and "-> 500 engine_error" in refused[1].getMessage()
    rejected = {k: v for k, v in samples.items() if k.startswith("specdeploy_requests_rejected_total{")}
    assert sorted(rejected.values()) == [1.0, 1.0] and any("engine_error" in k for k in rejected), rejected
    figures = re.findall(r"req/s=([0-9.]+) errors=(\d+) ttft_p50=([0-9.]+s|-) gen_tok/s=", interval_lines())
    assert sum(int(errors) for _, errors, _ in figures) == 2, figures
    assert any(float(rate) > 0 and ttft != "-" and 0 < float(ttft[:-1]) < 20 for rate, _, ttft in figures), figures
