"""The split-role control plane authenticated, on loopback against real servers: a prefill and a
decode server given the deployment's shared secret (--disagg-secret-file) behind a router that
checks the clients' API keys. Without the secret every /disagg/* route and the decode server's
OpenAI routes answer 401 (the decode server cannot be used as a proxy to a prefill URL of the
client's choosing); with it, a prefill request is still refused unless its Mooncake session was
registered by the decode server, from the caller's own address, and every byte it would write lies
in the memory that server registered. Nothing is left held after a refusal."""

from __future__ import annotations

import time

import httpx
import openai
import pytest

from specdeploy.engine.serving.auth import DISAGG_TOKEN_HEADER, guard_from_files
from specdeploy.engine.serving.cli import free_port

MODEL_NAME = "tiny-target"
SECRET = "disagg-secret-0123456789abcdef0123456789"
API_KEY = "sk-router-key-0123456789abcdef"


def wait_until(predicate, timeout_s: float = 30.0, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


@pytest.fixture(scope="module")
def secured(serve_command, tmp_path_factory):
    from specdeploy.engine.serving.cli import ServerThread
    from specdeploy.engine.serving.disagg.router import RouterThread

    root = tmp_path_factory.mktemp("secrets")
    (root / "secret").write_text(SECRET + "\n")
    (root / "keys").write_text(API_KEY + "\n")
    secret = ["--disagg-secret-file", str(root / "secret")]
    prefill = ServerThread(serve_command("--role", "prefill", "--transfer-host", "127.0.0.1", *secret)).start(120)
    decode = ServerThread(serve_command("--role", "decode", "--transfer-host", "127.0.0.1", *secret)).start(120)
    router = RouterThread([prefill.base_url], [decode.base_url], free_port(),
                          guard=guard_from_files(str(root / "keys"), str(root / "secret"))).start()
    yield prefill.base_url, decode.base_url, router.base_url
    router.stop()
    decode.stop()
    prefill.stop()


SIGNED = {DISAGG_TOKEN_HEADER: SECRET}


def status(url: str) -> dict:
    return httpx.get(f"{url}/disagg/status", headers=SIGNED, timeout=10).json()


def idle(url: str) -> bool:
    s = status(url)
    return (s["running"] == 0 and s["waiting"] == 0 and s["free_slots"] == s["capacity_slots"]
            and s.get("staging_free_bytes") == s.get("staging_bytes"))


def test_clients_need_the_routers_key_and_the_roles_answer_the_router(secured):
    _, _, router = secured
    kw = {"model": MODEL_NAME, "prompt": "def main(", "max_tokens": 8, "temperature": 0}
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{router}/v1", api_key="sk-wrong-key-000000000000", max_retries=0).completions.create(**kw)
    ok = openai.OpenAI(base_url=f"{router}/v1", api_key=API_KEY, max_retries=0, timeout=120)
    out = ok.completions.create(**kw)
    assert out.usage.completion_tokens == 8 and out.choices[0].text
    assert [m.id for m in ok.models.list()] == [MODEL_NAME]
    assert httpx.get(f"{router}/ready").status_code == 200  # probes stay open
    assert httpx.get(f"{router}/status").status_code == 401


@pytest.mark.parametrize("method,path,body", [
    ("GET", "/disagg/info", None), ("GET", "/disagg/status", None),
    ("POST", "/disagg/register", {"peer": {}, "regions": [{"address": 4096, "bytes": 1}]}),
    ("POST", "/disagg/prefill", {"room": "r"}), ("POST", "/disagg/abort", {"room": "r"}),
])
def test_the_control_plane_refuses_calls_without_the_secret(secured, method, path, body):
    prefill, decode, _ = secured
    for url in (prefill, decode):
        for headers in ({}, {DISAGG_TOKEN_HEADER: SECRET[:-1]}, {"Authorization": f"Bearer {SECRET}"}):
            r = httpx.request(method, f"{url}{path}", json=body, headers=headers, timeout=10)
            assert r.status_code == 401, (url, path, headers, r.text)
            assert r.json()["error"]["code"] == "invalid_disagg_token"
        assert httpx.get(f"{url}/health").status_code == 200


def test_the_decode_server_is_no_proxy_for_clients(secured):
    prefill, decode, _ = secured
    body = {"model": MODEL_NAME, "prompt": "x", "max_tokens": 2}
    r = httpx.post(f"{decode}/v1/completions", json=body, timeout=30,
                   headers={"X-Specdeploy-Prefill-Url": prefill, "Authorization": f"Bearer {API_KEY}"})
    assert r.status_code == 401
    assert httpx.get(f"{decode}/v1/models").status_code == 401


def forged_prefill(decode: str, prefill: str, room: str, **overrides) -> dict:
    """A /disagg/prefill body as an insider holding the secret could write it: the decode server's
    real description, destinations of its choosing."""
    info = httpx.get(f"{decode}/disagg/info", headers=SIGNED).json()
    layers, slot_bytes = info["target_kv"]  # (layers, bytes per slot) of a Llama-family pool
    body = {"room": room, "peer": info, "prompt_ids": [5, 6, 7], "slots": [1, 2, 3],
            "target_kv": {"k": 0x10000, "v": 0x20000, "num_layers": layers, "num_slots": 64, "slot_bytes": slot_bytes},
            "draft_kv": None, "metadata": {"hidden": 0x30000, "output_token_id": 0x30100,
                                           "cached_tokens": 0x30200, "output_token_logprob": 0x30300}}
    if info["draft_kv"]:
        d_layers, d_bytes = info["draft_kv"]
        body["draft_kv"] = {"k": 0x40000, "v": 0x50000, "num_layers": d_layers, "num_slots": 64, "slot_bytes": d_bytes}
    body.update(overrides)
    return body


def test_a_prefill_writes_only_into_memory_its_decode_server_registered(secured):
    prefill, decode, router = secured
    # One request through the router: the decode server has registered its session.
    openai.OpenAI(base_url=f"{router}/v1", api_key=API_KEY, max_retries=0, timeout=120).completions.create(
        model=MODEL_NAME, prompt="hello", max_tokens=2)
    wait_until(lambda: idle(prefill) and idle(decode), what="both servers idle")
    baseline = status(prefill)["free_slots"]
    transfers = status(prefill)["transfers"]

    # Addresses the decode server never registered (what a forged body would aim at).
    r = httpx.post(f"{prefill}/disagg/prefill", json=forged_prefill(decode, prefill, "forged-1"),
                   headers=SIGNED, timeout=60)
    assert r.status_code == 400 and "outside the memory the decode server registered" in r.json()["error"]["message"]

    # A session nobody registered (another process's transfer engine).
    other = forged_prefill(decode, prefill, "forged-2")
    other["peer"] = {**other["peer"], "session_id": "127.0.0.1:1"}
    r = httpx.post(f"{prefill}/disagg/prefill", json=other, headers=SIGNED, timeout=60)
    assert r.status_code == 412 and "not registered" in r.json()["error"]["message"]

    # The decode server's session, named from another address than the one that registered it.
    with httpx.Client(transport=httpx.HTTPTransport(local_address="127.0.0.2")) as elsewhere:
        r = elsewhere.post(f"{prefill}/disagg/prefill", json=forged_prefill(decode, prefill, "forged-3"),
                           headers=SIGNED, timeout=60)
        assert r.status_code == 403 and "another address" in r.json()["error"]["message"]
        # Nor register the decode server's session as its own, with memory of its choosing.
        r = elsewhere.post(f"{prefill}/disagg/register", headers=SIGNED, json={
            "peer": httpx.get(f"{decode}/disagg/info", headers=SIGNED).json(),
            "regions": [{"address": 0x10000, "bytes": 1 << 20}]})
        assert r.status_code == 403 and "not at the caller's address" in r.json()["error"]["message"]
        # Nor can that address abort the decode server's rooms: rooms are kept per caller.
        assert elsewhere.post(f"{prefill}/disagg/abort", json={"room": "forged-1"},
                              headers=SIGNED).json()["aborted"] is False

    # Only a decode server registers, and only with memory that does not overlap.
    info = httpx.get(f"{prefill}/disagg/info", headers=SIGNED).json()
    r = httpx.post(f"{prefill}/disagg/register", headers=SIGNED,
                   json={"peer": info, "regions": [{"address": 4096, "bytes": 4096}]})
    assert r.status_code == 400 and "only a decode server" in r.json()["error"]["message"]
    decode_info = httpx.get(f"{decode}/disagg/info", headers=SIGNED).json()
    r = httpx.post(f"{prefill}/disagg/register", headers=SIGNED,
                   json={"peer": {**decode_info, "session_id": "127.0.0.1:2"},
                         "regions": [{"address": 4096, "bytes": 4096}, {"address": 8000, "bytes": 10}]})
    assert r.status_code == 400 and "overlap" in r.json()["error"]["message"]
    r = httpx.post(f"{prefill}/disagg/register", headers=SIGNED, json={"peer": {"role": "decode"}, "regions": [
        {"address": 4096, "bytes": 1}]})
    assert r.status_code == 400

    # Nothing was written, nothing is held, and the pair still serves.
    wait_until(lambda: idle(prefill), what="the prefill server idle")
    assert status(prefill)["free_slots"] == baseline and status(prefill)["transfers"] == transfers
    out = openai.OpenAI(base_url=f"{router}/v1", api_key=API_KEY, max_retries=0, timeout=120).completions.create(
        model=MODEL_NAME, prompt="hello", max_tokens=2)
    assert out.usage.completion_tokens == 2
