"""API keys on a real engine server (`engine serve --api-key-file`), through the official openai
client: without a key or with a wrong one 401 (openai.AuthenticationError) in OpenAI's error
shape, with any key of the file 200; probes and scrapes stay open; a key file rotated the way a
Kubernetes Secret volume rotates (a symlink swap) takes effect without a restart."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from specdeploy.engine.serving import auth

MODEL_NAME = "tiny-target"
KEY_A = "sk-test-aaaaaaaaaaaaaaaaaaaaaaaa"
KEY_B = "sk-test-bbbbbbbbbbbbbbbbbbbbbbbb"
KEY_C = "sk-test-cccccccccccccccccccccccc"


class SecretVolume:
    """A directory laid out as the kubelet lays out a Secret volume: KEY -> ..data/KEY,
    ..data -> ..<timestamp>; an update writes a new timestamped directory and swaps ..data."""

    def __init__(self, root: Path, key: str = "api-keys"):
        self.root, self.key, self.n = root, key, 0
        root.mkdir(parents=True, exist_ok=True)

    @property
    def path(self) -> Path:
        return self.root / self.key

    def write(self, text: str) -> None:
        self.n += 1
        version = self.root / f"..2026_{self.n:04d}"
        version.mkdir()
        (version / self.key).write_text(text)
        tmp = self.root / "..data_tmp"
        tmp.symlink_to(version.name)
        os.replace(tmp, self.root / "..data")
        if not self.path.is_symlink():
            self.path.symlink_to(f"..data/{self.key}")


def test_keys_are_lines_and_compared_with_each():
    keys = auth.parse_keys(f"# comment\n\n  {KEY_A}  \n{KEY_B}\r\n")
    assert keys == {KEY_A.encode(), KEY_B.encode()}
    assert auth.matches(KEY_B.encode(), keys)
    assert not auth.matches(KEY_A.encode()[:-1], keys)
    assert not auth.matches(None, keys)
    assert auth.bearer_token(b"Bearer " + KEY_A.encode()) == KEY_A.encode()
    assert auth.bearer_token(b"bearer  x") == b"x"
    assert auth.bearer_token(b"Basic abc") is None and auth.bearer_token(b"Bearer ") is None


def test_a_key_file_that_cannot_serve_is_refused(tmp_path):
    with pytest.raises(auth.AuthConfigError, match="No such file"):
        auth.KeyFile(tmp_path / "missing")
    (tmp_path / "empty").write_text("# no keys\n\n")
    with pytest.raises(auth.AuthConfigError, match="holds no key"):
        auth.KeyFile(tmp_path / "empty")
    (tmp_path / "short").write_text("abc\n")
    with pytest.raises(auth.AuthConfigError, match="shorter than 16"):
        auth.KeyFile(tmp_path / "short")


def test_rotation_through_a_secret_volume_and_a_bad_update_keeps_the_old_keys(tmp_path):
    volume = SecretVolume(tmp_path / "secret")
    volume.write(KEY_A + "\n")
    keys = auth.KeyFile(volume.path)
    assert keys.accepts(KEY_A.encode())
    volume.write(f"{KEY_B}\n{KEY_C}\n")
    assert not keys.accepts(KEY_A.encode()) and keys.accepts(KEY_B.encode()) and keys.accepts(KEY_C.encode())
    volume.write("\n")  # emptied by mistake: nobody is locked out, nobody let in
    assert keys.accepts(KEY_B.encode()) and not keys.accepts(b"")
    os.remove(volume.root / "..data")  # the volume gone for a moment
    assert keys.accepts(KEY_B.encode())


@pytest.fixture
def keyed_server(start_server, tmp_path):
    volume = SecretVolume(tmp_path / "api-key")
    volume.write(f"{KEY_A}\n{KEY_B}\n")
    return start_server("--api-key-file", str(volume.path)), volume


def client(url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=60)


def test_requests_need_a_key_of_the_file(keyed_server):
    url, _ = keyed_server
    kw = {"model": MODEL_NAME, "prompt": "def main(", "max_tokens": 4, "temperature": 0}
    for key in (KEY_A, KEY_B):
        assert client(url, key).completions.create(**kw).usage.completion_tokens == 4
        chunks = list(client(url, key).chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True))
        assert chunks and chunks[-1].choices[0].finish_reason is not None
    with pytest.raises(openai.AuthenticationError) as wrong:
        client(url, KEY_C).completions.create(**kw)
    assert wrong.value.status_code == 401
    assert wrong.value.body["code"] == "invalid_api_key" and wrong.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.AuthenticationError):
        client(url, KEY_A[:-1]).models.list()
    # No Authorization header at all, and other schemes.
    for headers in ({}, {"Authorization": f"Basic {KEY_A}"}, {"Authorization": KEY_A}):
        r = httpx.post(f"{url}/v1/completions", json=kw, headers=headers, timeout=30)
        assert r.status_code == 401, headers
        assert r.headers["www-authenticate"].startswith("Bearer")
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    # Every route that is not a probe is guarded, unknown ones included (no 404 oracle).
    assert httpx.get(f"{url}/v1/models/{MODEL_NAME}").status_code == 401
    assert httpx.get(f"{url}/no/such/route").status_code == 401
    assert httpx.get(f"{url}/disagg/status").status_code == 401


def test_probes_and_metrics_stay_open(keyed_server):
    url, _ = keyed_server
    assert httpx.get(f"{url}/health").status_code == 200
    assert httpx.get(f"{url}/ready").status_code == 200
    r = httpx.get(f"{url}/metrics")
    assert r.status_code == 200 and "specdeploy_" in r.text


def test_rotated_keys_apply_without_a_restart(keyed_server):
    url, volume = keyed_server
    kw = {"model": MODEL_NAME, "prompt": "x", "max_tokens": 1}
    client(url, KEY_A).completions.create(**kw)
    volume.write(KEY_C + "\n")
    assert client(url, KEY_C).completions.create(**kw).usage.completion_tokens == 1
    for old in (KEY_A, KEY_B):
        with pytest.raises(openai.AuthenticationError):
            client(url, old).completions.create(**kw)


def test_serve_refuses_a_missing_key_file_in_one_line(model_dirs, tmp_path):
    from engine_server import serve_argv

    argv = [sys.executable, "-P", "-m", "specdeploy.cli",
            *serve_argv(*model_dirs, 1, "--api-key-file", str(tmp_path / "nope"))]
    t0 = time.monotonic()
    out = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "--api-key-file" in lines[0] and "Traceback" not in out.stderr
    assert time.monotonic() - t0 < 60
