"""`--target ORG/NAME`: fetched once from an HF-compatible hub into the HF cache, then served.

The hub here is a small HTTP server on loopback speaking the two calls the engine makes:
GET /api/models/{repo}/revision/{rev} and GET /{repo}/resolve/{commit}/{file}. It knows `main` and
one pinned commit of each repo, with the same files.
"""

from __future__ import annotations

import openai
import pytest

from specdeploy.engine.serving import hub
from specdeploy.engine.serving.cli import ServerThread, free_port

from model_hub import COMMIT, PINNED, FakeHub  # tests/support/model_hub.py


@pytest.fixture
def fake_hub(model_dirs, tmp_path, monkeypatch):
    target_dir, draft_dir = model_dirs
    fake = FakeHub({"org/tiny": target_dir, "org/tiny-eagle": draft_dir}, token="secret")
    monkeypatch.setenv("HF_ENDPOINT", fake.url)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_TOKEN", "secret")
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    yield fake
    fake.close()


def serve(*extra):
    return ServerThread(["engine", "serve", "--target", "org/tiny", "--draft", "org/tiny-eagle", "--algorithm", "EAGLE",
                         "--dtype", "float32", "--max-total-tokens", "1024", "--max-running-requests", "2",
                         "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(free_port()), *extra])


def test_models_are_fetched_once_into_the_hf_cache(fake_hub, tmp_path):
    running = serve().start(timeout_s=120)
    try:
        client = openai.OpenAI(base_url=f"{running.base_url}/v1", api_key="unused", max_retries=0)
        assert client.completions.create(model="tiny", prompt="x", max_tokens=3).usage.completion_tokens >= 1
    finally:
        running.stop()
    snapshot = tmp_path / "hf" / "hub" / "models--org--tiny" / "snapshots" / COMMIT
    assert (snapshot / "model.safetensors").is_file() and (snapshot / "tokenizer.json").is_file()
    assert (tmp_path / "hf" / "hub" / "models--org--tiny" / "refs" / "main").read_text() == COMMIT
    assert not any("pytorch_model.bin" in r for r in fake_hub.requests)
    assert not list(snapshot.glob("*.part"))

    fetched = len(fake_hub.requests)
    serve().start(timeout_s=120).stop()  # a restarted pod: everything comes from the cache
    assert len(fake_hub.requests) == fetched


def test_pinned_revisions_are_fetched_and_found_at_that_revision(fake_hub, tmp_path):
    pins = ("--target-revision", PINNED, "--draft-revision", PINNED)
    serve(*pins).start(timeout_s=120).stop()
    for repo in ("org/tiny", "org/tiny-eagle"):
        assert f"/api/models/{repo}/revision/{PINNED}" in fake_hub.requests
        assert f"/{repo}/resolve/{PINNED}/config.json" in fake_hub.requests
    assert not any(COMMIT in r or r.endswith("/revision/main") for r in fake_hub.requests)
    repo_dir = tmp_path / "hf" / "hub" / "models--org--tiny"
    assert (repo_dir / "refs" / PINNED).read_text() == PINNED
    assert (repo_dir / "snapshots" / PINNED / "model.safetensors").is_file()

    fetched = len(fake_hub.requests)
    serve(*pins).start(timeout_s=120).stop()  # a restarted pod finds the pinned snapshot in the cache
    assert len(fake_hub.requests) == fetched


def test_hub_errors_say_what_is_wrong(fake_hub, tmp_path, monkeypatch):
    with pytest.raises(hub.HubError, match="no such model"):
        hub.fetch_model("org/missing")
    monkeypatch.setenv("HF_TOKEN", "wrong")
    with pytest.raises(hub.HubError, match="set HF_TOKEN"):
        hub.fetch_model("org/tiny")
    assert hub.cached_snapshot("org/tiny") is None


# Repository listings as the hub serves them (file names of the published repositories).
LLAMA_31_8B_INSTRUCT = [
    ".gitattributes", "LICENSE", "README.md", "USE_POLICY.md", "config.json", "generation_config.json",
    "model-00001-of-00004.safetensors", "model-00002-of-00004.safetensors", "model-00003-of-00004.safetensors",
    "model-00004-of-00004.safetensors", "model.safetensors.index.json", "original/consolidated.00.pth",
    "original/params.json", "original/tokenizer.model", "special_tokens_map.json", "tokenizer.json",
    "tokenizer_config.json",
]
EAGLE3_HEAD = [".gitattributes", "README.md", "config.json", "pytorch_model.bin"]
BOTH_FORMATS = [
    "config.json", "model.safetensors", "pytorch_model.bin", "pytorch_model.bin.index.json",
    "training_args.bin", "tokenizer.json",
]


def test_wanted_files_take_one_copy_of_the_weights():
    assert hub.wanted_files(LLAMA_31_8B_INSTRUCT) == [
        "config.json", "generation_config.json",
        "model-00001-of-00004.safetensors", "model-00002-of-00004.safetensors",
        "model-00003-of-00004.safetensors", "model-00004-of-00004.safetensors",
        "model.safetensors.index.json", "special_tokens_map.json", "tokenizer.json", "tokenizer_config.json",
    ]
    # A repository without safetensors (the published EAGLE heads): its PyTorch weights.
    assert hub.wanted_files(EAGLE3_HEAD) == ["config.json", "pytorch_model.bin"]
    # Both formats: the safetensors only, and no index of the .bin copy.
    assert hub.wanted_files(BOTH_FORMATS) == ["config.json", "model.safetensors", "tokenizer.json"]
    assert hub.wanted_files(["config.json", "pytorch_model-00001-of-00002.bin", "pytorch_model-00002-of-00002.bin",
                             "pytorch_model.bin.index.json", "training_args.bin", "optimizer.bin"]) == [
        "config.json", "pytorch_model-00001-of-00002.bin", "pytorch_model-00002-of-00002.bin",
        "pytorch_model.bin.index.json"]


def test_a_head_published_as_pytorch_model_bin_is_fetched_and_served(model_dirs, tmp_path, monkeypatch):
    """The published EAGLE heads have no safetensors: the fetch takes their pytorch_model.bin
    (not training_args.bin), and the engine serves from it."""
    import torch
    from safetensors.torch import load_file

    target_dir, draft_dir = model_dirs
    head = tmp_path / "head-repo"
    head.mkdir()
    (head / "config.json").write_text((draft_dir / "config.json").read_text())
    torch.save(load_file(str(draft_dir / "model.safetensors")), head / "pytorch_model.bin")
    (head / "training_args.bin").write_bytes(b"not weights")
    fake = FakeHub({"org/tiny": target_dir, "org/tiny-eagle-bin": head})
    monkeypatch.setenv("HF_ENDPOINT", fake.url)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    try:
        running = ServerThread(["engine", "serve", "--target", "org/tiny", "--draft", "org/tiny-eagle-bin",
                                "--algorithm", "EAGLE", "--dtype", "float32", "--max-total-tokens", "1024",
                                "--max-running-requests", "2", "--served-model-name", "tiny",
                                "--host", "127.0.0.1", "--port", str(free_port())]).start(timeout_s=120)
        try:
            client = openai.OpenAI(base_url=f"{running.base_url}/v1", api_key="unused", max_retries=0)
            assert client.completions.create(model="tiny", prompt="x", max_tokens=3).usage.completion_tokens >= 1
        finally:
            running.stop()
    finally:
        fake.close()
    snapshot = tmp_path / "hf" / "hub" / "models--org--tiny-eagle-bin" / "snapshots" / COMMIT
    assert sorted(p.name for p in snapshot.iterdir()) == ["config.json", "pytorch_model.bin"]
