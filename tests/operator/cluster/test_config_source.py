"""Config resolution against a real local HTTP server playing the hub."""

from __future__ import annotations

import json
import socket
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from specdeploy.operator.cluster import config_source as cs

LLAMA_CONFIG = {"model_type": "llama", "hidden_size": 4096, "torch_dtype": "bfloat16"}
PINNED_CONFIG = {"model_type": "llama", "hidden_size": 2048, "torch_dtype": "bfloat16"}
GATED_TOKEN = "hf_secret_token"


class _Hub(BaseHTTPRequestHandler):
    """Serves {model}/resolve/{revision}/config.json like the Hugging Face hub."""

    requests: list[tuple[str, str | None]] = []

    def do_GET(self) -> None:  # noqa: N802 (http.server naming)
        auth = self.headers.get("Authorization")
        type(self).requests.append((self.path, auth))
        path = urllib.parse.unquote(self.path)
        files = {
            "/org/llama/resolve/main/config.json": (200, json.dumps(LLAMA_CONFIG)),
            "/org/llama/resolve/refs/pr/7/config.json": (200, json.dumps(PINNED_CONFIG)),
            "/org/broken/resolve/main/config.json": (200, "{not json"),
            "/org/list/resolve/main/config.json": (200, "[1, 2]"),
            "/org/flaky/resolve/main/config.json": (503, "busy"),
        }
        if path.startswith("/org/gated/"):
            ok = auth == f"Bearer {GATED_TOKEN}"
            code, body = (200, json.dumps(LLAMA_CONFIG)) if ok else (401, "unauthorized")
        else:
            code, body = files.get(path, (404, "not found"))
        payload = body.encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def hub_url():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Hub)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


class FakeReader:
    """ConfigMaps and Secrets as plain dicts (the cluster side of resolution)."""

    def __init__(self, config_maps=None, secrets=None):
        self.config_maps = config_maps or {}
        self.secrets = secrets or {}

    def config_map_data(self, namespace, name):
        return self.config_maps.get((namespace, name))

    def secret_data(self, namespace, name):
        return self.secrets.get((namespace, name))


def resolve(spec, hub_url, reader=None, token=None):
    return cs.resolve_model_config(
        spec, "spec.target", "ns", reader or FakeReader(), hub_endpoint=hub_url, hub_token=token
    )


def test_hub_default_revision_is_main(hub_url):
    resolved = resolve({"model": "org/llama"}, hub_url)
    assert resolved.config == LLAMA_CONFIG
    assert resolved.origin == f"{hub_url}/org/llama/resolve/main/config.json"


def test_hub_revision_is_pinned_and_quoted(hub_url):
    _Hub.requests.clear()
    resolved = resolve({"model": "org/llama", "revision": "refs/pr/7"}, hub_url)
    assert resolved.config == PINNED_CONFIG
    assert _Hub.requests[-1][0] == "/org/llama/resolve/refs%2Fpr%2F7/config.json"


def test_hub_sends_bearer_token(hub_url):
    _Hub.requests.clear()
    resolved = resolve({"model": "org/gated"}, hub_url, token=GATED_TOKEN)
    assert resolved.config == LLAMA_CONFIG
    assert _Hub.requests[-1][1] == f"Bearer {GATED_TOKEN}"


def test_hub_without_token_on_gated_model_is_unauthorized(hub_url):
    with pytest.raises(cs.ConfigSourceError) as err:
        resolve({"model": "org/gated"}, hub_url)
    assert err.value.reason == "HubUnauthorized"
    assert "no token given" in err.value.message


def test_hub_404_names_the_url_and_is_permanent(hub_url):
    with pytest.raises(cs.ConfigSourceError) as err:
        resolve({"model": "org/missing", "revision": "v1"}, hub_url)
    assert err.value.reason == "ConfigNotFound"
    assert f"{hub_url}/org/missing/resolve/v1/config.json" in err.value.message
    assert err.value.transient is False


def test_hub_5xx_is_transient(hub_url):
    with pytest.raises(cs.ConfigSourceError) as err:
        resolve({"model": "org/flaky"}, hub_url)
    assert err.value.reason == "HubUnreachable"
    assert err.value.transient is True
    assert "503" in err.value.message


@pytest.mark.parametrize("model", ["org/broken", "org/list"])
def test_hub_body_that_is_not_a_json_object_is_invalid(hub_url, model):
    with pytest.raises(cs.ConfigSourceError) as err:
        resolve({"model": model}, hub_url)
    assert err.value.reason == "ConfigInvalid"
    assert model in err.value.message


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_unreachable_hub_is_transient():
    endpoint = f"http://127.0.0.1:{_closed_port()}"
    with pytest.raises(cs.ConfigSourceError) as err:
        resolve({"model": "org/llama"}, endpoint)
    assert err.value.reason == "HubUnreachable"
    assert err.value.transient is True
    assert f"{endpoint}/org/llama/resolve/main/config.json" in err.value.message


def test_inline_config_wins_and_never_touches_the_hub():
    resolved = resolve({"model": "org/llama", "config": LLAMA_CONFIG}, f"http://127.0.0.1:{_closed_port()}")
    assert resolved.config == LLAMA_CONFIG
    assert resolved.origin == "spec.target.config"


def test_config_map_default_key():
    reader = FakeReader(config_maps={("ns", "cfg"): {"config.json": json.dumps(LLAMA_CONFIG)}})
    resolved = resolve({"model": "/models/x", "configMapRef": {"name": "cfg"}}, "", reader)
    assert resolved.config == LLAMA_CONFIG
    assert resolved.origin == "ConfigMap ns/cfg key config.json"


@pytest.mark.parametrize(
    "config_maps, ref, reason, text",
    [
        ({}, {"name": "cfg"}, "ConfigNotFound", "ConfigMap ns/cfg not found"),
        ({("ns", "cfg"): {"other": "{}"}}, {"name": "cfg"}, "ConfigNotFound", "no key 'config.json'"),
        ({("ns", "cfg"): {"k": "nope"}}, {"name": "cfg", "key": "k"}, "ConfigInvalid", "not JSON"),
    ],
)
def test_config_map_problems_name_the_field_and_are_retried(config_maps, ref, reason, text):
    with pytest.raises(cs.ConfigSourceError) as err:
        resolve({"model": "x", "configMapRef": ref}, "", FakeReader(config_maps=config_maps))
    assert err.value.reason == reason
    assert text in err.value.message
    assert err.value.transient is True


def test_token_from_secret():
    reader = FakeReader(secrets={("ns", "hf"): {"token": GATED_TOKEN + "\n"}})
    assert cs.resolve_hub_token({"tokenSecretRef": {"name": "hf"}}, "ns", reader) == GATED_TOKEN
    assert cs.resolve_hub_token({}, "ns", reader) is None


@pytest.mark.parametrize("secrets", [{}, {("ns", "hf"): {"other": "x"}}])
def test_missing_token_secret_is_reported(secrets):
    with pytest.raises(cs.ConfigSourceError) as err:
        cs.resolve_hub_token({"tokenSecretRef": {"name": "hf"}}, "ns", FakeReader(secrets=secrets))
    assert err.value.reason == "HubTokenNotFound"
    assert "spec.hub.tokenSecretRef" in err.value.message
