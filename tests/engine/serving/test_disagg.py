"""Prefill/decode disaggregation end to end on loopback: a prefill server and a decode server
(`engine serve --role prefill|decode`, KV and the metadata row moved by Mooncake over TCP) behind
`specdeploy router`, against one `--role both` server through the official openai client.
Greedy text, token counts and finish reasons are the same (the cached-token count is each
prefill server's own prefix cache's); errors are the same; slots return to their
baseline on both sides after a client abort and after a killed peer."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest
from specdeploy.engine.serving.cli import free_port

MODEL_NAME = "tiny-target"  # the served name of tests/server/conftest.py's models

PROMPTS = ["def main(", "import torch\n", "class Runner:", "x"]


def wait_until(predicate, timeout_s: float = 30.0, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def status(url: str) -> dict:
    return httpx.get(f"{url}/disagg/status", timeout=10).json()


def idle(url: str) -> bool:
    """No request, every slot free and (a staged server) every staging byte free."""
    s = status(url)
    return (s["running"] == 0 and s["waiting"] == 0 and s["free_slots"] == s["capacity_slots"]
            and s.get("staging_free_bytes") == s.get("staging_bytes"))


@pytest.fixture(scope="module")
def disagg(serve_command):
    from specdeploy.engine.serving.cli import ServerThread
    from specdeploy.engine.serving.disagg.router import RouterThread

    prefill = ServerThread(serve_command("--role", "prefill", "--transfer-host", "127.0.0.1")).start(timeout_s=120)
    decode = ServerThread(serve_command("--role", "decode", "--transfer-host", "127.0.0.1")).start(timeout_s=120)
    router = RouterThread([prefill.base_url], [decode.base_url], free_port()).start()
    yield prefill.base_url, decode.base_url, router.base_url
    router.stop()
    decode.stop()
    prefill.stop()


def tokens(usage) -> tuple[int, int, int]:
    return usage.prompt_tokens, usage.completion_tokens, usage.total_tokens


def client_for(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_router_answers_as_one_server(server, disagg):
    prefill, decode, router = disagg
    one, split = client_for(server.url), client_for(router)
    for prompt in PROMPTS:
        kw = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 20, "temperature": 0}
        want, got = one.completions.create(**kw), split.completions.create(**kw)
        assert got.choices[0].text == want.choices[0].text
        assert got.choices[0].finish_reason == want.choices[0].finish_reason
        assert tokens(got.usage) == tokens(want.usage)
    # Streaming, with usage in the last chunk; chat through the template.
    kw = {"model": MODEL_NAME, "prompt": "def f(x):", "max_tokens": 30, "temperature": 0, "stream": True,
          "stream_options": {"include_usage": True}}
    want_chunks, got_chunks = list(one.completions.create(**kw)), list(split.completions.create(**kw))
    def text(chunks):
        return "".join(c.choices[0].text for c in chunks if c.choices)
    assert text(got_chunks) == text(want_chunks) and len(text(want_chunks)) > 0
    assert tokens(got_chunks[-1].usage) == tokens(want_chunks[-1].usage)
    assert len(got_chunks) > 3, "tokens should arrive as they are generated, not in one piece"
    chat = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 16,
            "temperature": 0}
    assert split.chat.completions.create(**chat).choices[0].message.content == \
        one.chat.completions.create(**chat).choices[0].message.content
    # The prefill server's prefix cache serves a repeated prompt; usage says so, as one server's does.
    kw = {"model": MODEL_NAME, "prompt": "def prefix_cached(a, b, c):\n    return", "max_tokens": 4, "temperature": 0}
    split.completions.create(**kw)
    again = split.completions.create(**kw)
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    # Each request's prompt went through the prefill server's transfer engine.
    transfers = httpx.get(f"{router}/status").json()["requests"]
    assert transfers >= len(PROMPTS) + 2
    wait_until(lambda: idle(prefill) and idle(decode), what="both servers idle")


def test_concurrent_requests_through_the_router(server, disagg):
    prefill, decode, router = disagg

    async def run(url):
        c = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        outs = await asyncio.gather(*(c.completions.create(model=MODEL_NAME, prompt=p, max_tokens=24, temperature=0)
                                      for p in PROMPTS))
        await c.close()
        return [o.choices[0].text for o in outs]

    assert asyncio.run(run(router)) == asyncio.run(run(server.url))
    wait_until(lambda: idle(prefill) and idle(decode), what="both servers idle")


def test_errors_reach_the_client_unchanged(server, disagg):
    _, _, router = disagg
    cases = [
        {"model": "no-such-model", "prompt": "x"},
        {"model": MODEL_NAME, "prompt": "x", "max_tokens": "10"},
        {"model": MODEL_NAME, "prompt": "x", "max_tokens": server.context_length + 1},
        {"model": MODEL_NAME, "prompt": "x", "stop": [""]},
    ]
    for body in cases:
        want = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30)
        got = httpx.post(f"{router}/v1/completions", json=body, timeout=30)
        assert want.status_code >= 400, (body, want.text)
        assert (got.status_code, got.json()) == (want.status_code, want.json())


def test_the_router_caps_bodies_as_the_engine_does(server, disagg):
    from specdeploy.engine.serving.limits import DEFAULT_MAX_BODY_BYTES

    _, _, router = disagg
    big = b'{"model": "tiny-target", "prompt": "' + b"x" * DEFAULT_MAX_BODY_BYTES + b'"}'
    chunked = (big[i:i + (1 << 20)] for i in range(0, len(big), 1 << 20))
    for content in (big, chunked):
        r = httpx.post(f"{router}/v1/completions", content=content, timeout=60,
                       headers={"content-type": "application/json"})
        assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large", r.text
    ok = httpx.post(f"{router}/v1/completions", json={"model": MODEL_NAME, "prompt": "x", "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200, ok.text


def test_each_role_refuses_what_it_does_not_serve(disagg):
    prefill, decode, _ = disagg
    body = {"model": MODEL_NAME, "prompt": "x", "max_tokens": 4}
    r = httpx.post(f"{decode}/v1/completions", json=body, timeout=30)
    assert r.status_code == 400 and "decode server" in r.json()["error"]["message"]
    r = httpx.post(f"{prefill}/v1/completions", json=body, timeout=30)
    assert r.status_code == 400 and "prefill server" in r.json()["error"]["message"]
    assert httpx.get(f"{decode}/disagg/info").json()["role"] == "decode"
    info = httpx.get(f"{prefill}/disagg/info").json()
    assert info["role"] == "prefill" and info["metadata_width"] == 32 and info["session_id"].startswith("127.0.0.1:")
    # A room aborted before its prefill request arrives is refused when it does.
    assert httpx.post(f"{prefill}/disagg/abort", json={"room": "late-1"}).json() == {"room": "late-1", "aborted": False}
    late = {"room": "late-1", "peer": httpx.get(f"{decode}/disagg/info").json(), "prompt_ids": [1, 2],
            "slots": [1, 2], "target_kv": {"k": 1, "v": 1, "num_layers": 1, "num_slots": 8, "slot_bytes": 1},
            "metadata": {}}
    r = httpx.post(f"{prefill}/disagg/prefill", json=late, timeout=30)
    assert r.status_code == 409 and "aborted" in r.json()["error"]["message"]


def test_client_abort_frees_slots_on_both_sides(disagg):
    prefill, decode, router = disagg
    wait_until(lambda: idle(prefill) and idle(decode), what="both servers idle")
    baseline = (status(prefill)["free_slots"], status(decode)["free_slots"])
    body = {"model": MODEL_NAME, "prompt": "x", "max_tokens": 200, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{router}/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        assert any(next(lines).startswith("data: ") for _ in range(4))
        assert status(decode)["running"] == 1
    wait_until(lambda: idle(decode) and idle(prefill), what="the aborted request's slots to come back")
    assert (status(prefill)["free_slots"], status(decode)["free_slots"]) == baseline
    # A whole-response client that gives up is aborted too.
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{router}/v1/completions", json={**body, "stream": False},
                   timeout=httpx.Timeout(10, read=0.3))
    wait_until(lambda: idle(decode) and idle(prefill), what="the abandoned request's slots to come back")


def test_killed_prefill_server_fails_requests_cleanly(engine_process, disagg):
    """A prefill server killed (SIGKILL) mid-service: the decode server fails the request with an
    OpenAI error, frees its slots, and the router stops sending to it."""
    from specdeploy.engine.serving.disagg.router import RouterThread

    proc, prefill = engine_process("--role", "prefill", "--transfer-host", "127.0.0.1")
    decode = disagg[1]
    wait_until(lambda: idle(decode), what="an idle decode server")
    router = RouterThread([prefill], [decode], free_port()).start()
    try:
        c = client_for(router.base_url)
        assert c.completions.create(model=MODEL_NAME, prompt="x", max_tokens=8, temperature=0).choices[0].text
        proc.kill()
        proc.wait()
        # Straight to the decode server, naming the dead prefill server.
        r = httpx.post(f"{decode}/v1/completions", json={"model": MODEL_NAME, "prompt": "x", "max_tokens": 8},
                       headers={"X-Specdeploy-Prefill-Url": prefill}, timeout=30)
        assert r.status_code == 500 and "prefill server" in r.json()["error"]["message"]
        wait_until(lambda: idle(decode), what="the decode server's slots back")
        # The router notices and refuses with 503 rather than failing each request.
        with pytest.raises(openai.APIStatusError) as err:
            wait_until(lambda: httpx.get(f"{router.base_url}/ready").status_code != 200, what="router not ready")
            c.completions.create(model=MODEL_NAME, prompt="x", max_tokens=8)
        assert err.value.status_code == 503 and "no prefill server is ready" in str(err.value)
    finally:
        router.stop()


@pytest.mark.parametrize("staged", [True, False])
def test_killed_decode_server_frees_the_prefill_servers_slots(engine_process, disagg, staged):
    """The decode server dies before its prefill is written: the transfer fails (into its staging
    region, or into its slots), the prefill server answers 502, its slots and staging come back."""
    prefill = disagg[0]
    proc, decode = engine_process("--role", "decode", "--transfer-host", "127.0.0.1")
    info = httpx.get(f"{decode}/disagg/info").json()
    proc.kill()
    proc.wait()
    wait_until(lambda: idle(prefill), what="an idle prefill server")
    baseline = status(prefill)["free_slots"]
    body = {"room": "dead-decode", "peer": info, "prompt_ids": list(range(1, 40)), "slots": list(range(1, 40)),
            "target_kv": {"k": 1 << 20, "v": 1 << 21, "num_layers": info["target_kv"][0], "num_slots": 64,
                          "slot_bytes": info["target_kv"][1]},
            "draft_kv": {"k": 1 << 22, "v": 1 << 23, "num_layers": info["draft_kv"][0], "num_slots": 64,
                         "slot_bytes": info["draft_kv"][1]},
            "metadata": {"hidden": 1 << 24, "output_token_id": 1 << 25, "cached_tokens": 1 << 26,
                         "output_token_logprob": 1 << 27}}
    if staged:  # 39 tokens + the pad row, K and V of every layer of both pools
        per_token = sum(2 * layers * slot_bytes for layers, slot_bytes in (info["target_kv"], info["draft_kv"]))
        body["staging"] = {"address": 1 << 28, "bytes": 40 * per_token}
    # As the dead server did at its handshake: its session and the memory it offered.
    registered = httpx.post(f"{prefill}/disagg/register", json={
        "peer": info, "regions": [{"address": 1 << 20, "bytes": (1 << 29) - (1 << 20)}]})
    assert registered.status_code == 200, registered.text
    r = httpx.post(f"{prefill}/disagg/prefill", json=body, timeout=60)
    assert r.status_code == 502 and "transfer to the decode server failed" in r.json()["error"]["message"]
    wait_until(lambda: idle(prefill), what="the prefill server's slots back")
    assert status(prefill)["free_slots"] == baseline


@pytest.mark.parametrize("prefill_staging,decode_staging", [("off", "off"), ("on", "off"), ("off", "on")])
def test_direct_and_mixed_pairs_answer_as_one_server(server, serve_command, prefill_staging, decode_staging):
    """The pair above stages on both sides (the default, a GPU's only path); --transfer-staging
    off writes slot runs between registered host pools, and pairs with a staged peer either way."""
    from specdeploy.engine.serving.cli import ServerThread
    from specdeploy.engine.serving.disagg.router import RouterThread

    host = ("--transfer-host", "127.0.0.1")
    prefill = ServerThread(serve_command("--role", "prefill", *host, "--transfer-staging", prefill_staging)
                           ).start(timeout_s=120)
    decode = ServerThread(serve_command("--role", "decode", *host, "--transfer-staging", decode_staging)
                          ).start(timeout_s=120)
    router = RouterThread([prefill.base_url], [decode.base_url], free_port()).start()
    try:
        one, split = client_for(server.url), client_for(router.base_url)
        for prompt in PROMPTS[:2]:
            kw = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 16, "temperature": 0}
            assert split.completions.create(**kw).choices[0].text == one.completions.create(**kw).choices[0].text
        wait_until(lambda: idle(prefill.base_url) and idle(decode.base_url), what="both servers idle")
    finally:
        router.stop()
        decode.stop()
        prefill.stop()


def test_split_roles_serve_in_a_dtype_other_than_the_checkpoints(serve_command):
    """The test checkpoints say float32; --dtype bfloat16 servers plan in bfloat16 (the metadata
    row is the engine's dtype: planned in the config's, both roles refused to start)."""
    from specdeploy.engine.serving.cli import ServerThread
    from specdeploy.engine.serving.disagg.router import RouterThread

    bf16 = ("--transfer-host", "127.0.0.1", "--dtype", "bfloat16", "--gpu-memory-fraction", "0.25")
    prefill = ServerThread(serve_command("--role", "prefill", *bf16)).start(timeout_s=120)
    decode = ServerThread(serve_command("--role", "decode", *bf16)).start(timeout_s=120)
    router = RouterThread([prefill.base_url], [decode.base_url], free_port()).start()
    try:
        for url in (prefill.base_url, decode.base_url):
            info = httpx.get(f"{url}/disagg/info", timeout=10).json()
            assert info["dtype"] == "bfloat16"
        out = client_for(router.base_url).completions.create(
            model=MODEL_NAME, prompt="def main(", max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
        assert out.usage.completion_tokens == 6 and out.choices[0].text
    finally:
        router.stop()
        decode.stop()
        prefill.stop()


def test_split_role_refuses_a_plan_of_another_dtype(model_dirs, serve_command, tmp_path):
    import json

    from specdeploy.engine.planner.plan import Limits, SpecSettings, custom_gpu, plan_from_configs
    from specdeploy.engine.planner.weights import load_model_path
    from specdeploy.engine.serving.cli import ServerThread

    target_config, _ = load_model_path(model_dirs[0])
    draft_config, _ = load_model_path(model_dirs[1])
    plan = plan_from_configs(target_config, draft_config, SpecSettings("EAGLE", 3, 1, 4), custom_gpu(4.0),
                             Limits(4, 256, 4), gpus_per_node=1, role="prefill")  # float32, the config's
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan.to_dict()))
    server = ServerThread(serve_command("--role", "prefill", "--transfer-host", "127.0.0.1", "--plan", str(path),
                                        "--dtype", "bfloat16"))
    with pytest.raises(RuntimeError, match="the plan is for float32 and this server computes in bfloat16"):
        server.start(timeout_s=120)
    server.stop()


@pytest.mark.parametrize("flags,message", [
    (("--gpu-memory-fraction", "0"), "must be in \\(0, 1\\]"),
    (("--gpu-memory-fraction", "1.5"), "must be in \\(0, 1\\]"),
    (("--gpu-memory-fraction", "0.5", "--plan", "plan.json"), "a --plan was made for its GPU already"),
])
def test_gpu_memory_fraction_is_checked(serve_command, flags, message):
    import argparse

    from specdeploy.engine.serving.cli import add_parser, check_args

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="command"))
    with pytest.raises(ValueError, match=message):
        check_args(parser.parse_args(serve_command(*flags)))


def test_tensor_parallel_split_roles_answer_as_one_server(server, serve_command, tmp_path):
    """A prefill and a decode server at --tensor-parallel-size 2 (gloo: four processes): each rank
    gathers its share of a request's KV heads to rank 0's staging region, one Mooncake write moves
    the region, the decode server's rank 0 scatters each rank its share. Greedy text and usage
    are one TP 1 server's; both end idle."""
    from engine_processes import serving  # tests/support/engine_processes.py

    from specdeploy.engine.serving.disagg.router import RouterThread

    argvs = {role: serve_command("--role", role, "--transfer-host", "127.0.0.1", "--tensor-parallel-size", "2")
             for role in ("prefill", "decode")}
    with serving(argvs, tmp_path) as urls:
        assert httpx.get(f"{urls['decode']}/disagg/info", timeout=10).json()["tensor_parallel_size"] == 2
        router = RouterThread([urls["prefill"]], [urls["decode"]], free_port()).start()
        try:
            one, split = client_for(server.url), client_for(router.base_url)
            for prompt in PROMPTS[:3]:
                kw = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 16, "temperature": 0}
                want, got = one.completions.create(**kw), split.completions.create(**kw)
                assert got.choices[0].text == want.choices[0].text
                assert tokens(got.usage) == tokens(want.usage)
        finally:
            router.stop()
        wait_until(lambda: idle(urls["prefill"]) and idle(urls["decode"]), what="both servers idle")
        sent = status(urls["prefill"])
        assert sent["transfers"] == 3 and sent["bytes_sent"] > 0
    for role in argvs:
        assert "[tp1]" in (tmp_path / f"{role}.log").read_text(errors="replace")  # rank 1 ran its share


@pytest.mark.parametrize("extra,param", [({"logprobs": 2}, "logprobs"), ({"presence_penalty": 0.5}, "presence_penalty"),
                                         ({"guided_choice": ["a", "b"]}, "guided_choice")])
def test_split_roles_refuse_logit_controls_and_serve_many_choices(server, disagg, extra, param):
    _, _, router = disagg
    body = {"model": MODEL_NAME, "prompt": "def main(", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    got = httpx.post(f"{router}/v1/completions", json={**body, **extra}, timeout=30)
    assert got.status_code == 400 and got.json()["error"]["param"] == param, got.text
    many = httpx.post(f"{router}/v1/completions", json={**body, "n": 2, "prompt": ["def main(", "import os"]},
                      timeout=60).json()
    want = httpx.post(f"{server.url}/v1/completions", json={**body, "n": 2, "prompt": ["def main(", "import os"]},
                      timeout=60).json()
    assert [c["text"] for c in many["choices"]] == [c["text"] for c in want["choices"]]
    assert len(many["choices"]) == 4
