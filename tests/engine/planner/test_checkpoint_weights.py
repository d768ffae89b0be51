"""Real weight bytes from safetensors headers: the pure header reader, local directories, and
`specdeploy plan` against a local hub serving DeepSeek-V4-Flash's real-format index and headers
(FP8 e4m3 + E8M0 block scales, FP4 experts) without a byte of weights."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from checkpoint_hub import (
    CheckpointHub,
    Repo,
    VirtualSafetensors,
    deepseek_v4_flash_tensors,
    sharded_checkpoint,
)
from safetensors.torch import save_file

from specdeploy.cli import main
from specdeploy.engine.planner.shapes import ConfigError, derive_shapes
from specdeploy.engine.planner.weights import (
    DirectoryFiles,
    load_model,
    read_checkpoint_weights,
    safetensors_header_summary,
)

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
V4_CONFIG = json.loads((CONFIGS / "deepseek-v4-flash.json").read_text())
GIB = 1024**3


def run_plan(capsys, *argv: str) -> dict:
    assert main(["plan", *argv, "--json"]) == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out)


def test_header_of_a_real_fp8_file(tmp_path):
    """A file safetensors itself wrote, with the dtypes FP8 checkpoints hold."""
    tensors = {
        "w.weight": torch.zeros(256, 384, dtype=torch.float8_e4m3fn),
        "w.weight_scale_inv": torch.ones(2, 3, dtype=torch.float32),
        "e.weight": torch.zeros(64, 192, dtype=torch.int8),  # FP4 pairs
        "e.scale": torch.ones(64, 12, dtype=torch.float8_e8m0fnu),
        "norm.weight": torch.ones(384, dtype=torch.bfloat16),
    }
    save_file(tensors, str(tmp_path / "model.safetensors"))
    blob = (tmp_path / "model.safetensors").read_bytes()
    s = safetensors_header_summary(blob, "model.safetensors")
    assert s.num_tensors == 5
    assert s.bytes_by_dtype == {"BF16": 768, "F32": 24, "F8_E4M3": 256 * 384, "F8_E8M0": 64 * 12, "I8": 64 * 192}
    assert s.total_bytes == len(blob) - 8 - struct.unpack("<Q", blob[:8])[0]


def _header(entries: dict) -> bytes:
    raw = json.dumps(entries).encode()
    return struct.pack("<Q", len(raw)) + raw


@pytest.mark.parametrize("blob,message", [
    (b"\x01\x02", "shorter than its 8-byte header length"),
    (struct.pack("<Q", 1 << 40), "implausible"),
    (_header({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}})[:-3], "truncated"),
    (struct.pack("<Q", 4) + b"nope", "not valid JSON"),
    (_header({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}), "F32 [3] (12 bytes) but its data_offsets span 8"),
    (_header({"a": {"dtype": "F32", "shape": [2]}}), "lacks dtype, shape or data_offsets"),
])
def test_bad_headers_name_the_problem(blob, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        safetensors_header_summary(blob, "x.safetensors")


def test_unknown_dtype_counts_its_span():
    blob = _header({"a": {"dtype": "F8_E3M4", "shape": [4], "data_offsets": [0, 4]}, "__metadata__": {"k": "v"}})
    assert safetensors_header_summary(blob, "x").bytes_by_dtype == {"F8_E3M4": 4}


def test_directory_with_index_and_shards(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(V4_CONFIG))
    save_file({"a": torch.zeros(4, 4, dtype=torch.float8_e4m3fn)}, str(tmp_path / "s1.safetensors"))
    save_file({"b": torch.zeros(8, dtype=torch.bfloat16)}, str(tmp_path / "s2.safetensors"))
    index = {"metadata": {"total_size": 999}, "weight_map": {"a": "s1.safetensors", "b": "s2.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    _, weights = load_model(tmp_path)
    assert (weights.total_bytes, weights.source, weights.num_files) == (16 + 16, "headers", 2)
    (tmp_path / "s2.safetensors").unlink()  # shards out of reach: the index's total, said so
    _, weights = load_model(tmp_path)
    assert (weights.total_bytes, weights.source) == (999, "index")


# --------------------------------------------------------------------------------------------
# the hub


@pytest.fixture(scope="module")
def v4_files():
    # four decoder layers per shard: 12 shards, each header 0.5-0.7 MB (256 experts x 6 tensors
    # per layer), longer than the first range read, so the second read is exercised too
    return sharded_checkpoint(deepseek_v4_flash_tensors(V4_CONFIG), per_shard=4)


@pytest.fixture(scope="module")
def v4_hub(v4_files):
    files = {"config.json": json.dumps(V4_CONFIG).encode(), **v4_files}
    hub = CheckpointHub({"deepseek-ai/DeepSeek-V4-Flash": Repo(files)})
    yield hub
    hub.close()


def test_deepseek_v4_flash_plan_from_hub_headers(v4_hub, v4_files, capsys):
    before = v4_hub.bytes_sent
    d = run_plan(capsys, "--target", "deepseek-ai/DeepSeek-V4-Flash", "--hub-endpoint", v4_hub.url,
                 "--algorithm", "MTP", "--steps", "1", "--gpu", "h200")
    payload = sum(f.payload_bytes for f in v4_files.values() if isinstance(f, VirtualSafetensors))
    assert d["target"]["weight_source"] == "headers"
    assert d["target"]["weight_bytes"] == payload
    assert 150e9 < payload < 165e9  # about 149 GiB published, not the 530 GiB of 284 B params at bf16
    assert d["draft"]["weight_source"] == "target checkpoint"  # mtp.0 is in those shards
    assert d["tensor_parallel_size"] == 2
    assert d["memory_per_gpu"]["weight_bytes"] == -(-payload // 2)
    # nothing but the index (4 MB: 69k tensor names) and 12 headers left the hub
    assert v4_hub.bytes_sent - before < 20 * 1024**2
    shard_reads = [r for p, r in v4_hub.requests if p.endswith(".safetensors")]
    assert shard_reads and all(r and r.startswith("bytes=") for r in shard_reads)


def test_bf16_count_would_have_needed_tp_8(capsys):
    config = {k: v for k, v in V4_CONFIG.items() if k != "quantization_config"}
    shapes = derive_shapes(config)
    assert shapes.weight_bytes / GIB > 520  # the number the plan used to print
    d = run_plan(capsys, "--target", str(CONFIGS / "deepseek-v4-flash.json"), "--algorithm", "MTP", "--steps", "1")
    assert d["target"]["weight_source"] == "quantization_config" and d["tensor_parallel_size"] == 2


def test_quantization_config_estimate_is_close_to_the_headers(v4_files):
    target = derive_shapes(V4_CONFIG)
    mtp = derive_shapes(V4_CONFIG, role="MTP")
    headers = sum(f.payload_bytes for f in v4_files.values() if isinstance(f, VirtualSafetensors))
    estimate = target.quantized_weight_bytes + mtp.quantized_weight_bytes
    assert estimate == pytest.approx(headers, rel=0.01)


def test_index_only_when_shards_are_missing(v4_files, capsys):
    files = {"config.json": json.dumps(V4_CONFIG).encode(),
             "model.safetensors.index.json": v4_files["model.safetensors.index.json"]}
    hub = CheckpointHub({"org/v4": Repo(files)})
    try:
        d = run_plan(capsys, "--target", "org/v4", "--hub-endpoint", hub.url, "--algorithm", "NONE")
    finally:
        hub.close()
    total = json.loads(v4_files["model.safetensors.index.json"])["metadata"]["total_size"]
    assert (d["target"]["weight_source"], d["target"]["weight_bytes"]) == ("index", total)


def _small_repo(tmp_path) -> dict[str, bytes]:
    config = json.loads((CONFIGS / "llama-3.1-8b-instruct.json").read_text())
    save_file({"w": torch.zeros(1000, 1000, dtype=torch.bfloat16)}, str(tmp_path / "model.safetensors"))
    return {"config.json": json.dumps(config).encode(), "model.safetensors": (tmp_path / "model.safetensors").read_bytes()}


@pytest.mark.parametrize("honour_range", [True, False])
def test_single_file_checkpoint_with_and_without_range_support(tmp_path, capsys, honour_range):
    hub = CheckpointHub({"org/small": Repo(_small_repo(tmp_path))}, honour_range=honour_range)
    try:
        d = run_plan(capsys, "--target", "org/small", "--hub-endpoint", hub.url, "--algorithm", "NONE",
                     "--target-revision", "refs/pr/1")
    finally:
        hub.close()
    assert (d["target"]["weight_source"], d["target"]["weight_bytes"]) == ("headers", 2_000_000)
    assert any(p == "/org/small/resolve/refs/pr/1/model.safetensors.index.json" for p, _ in hub.requests)


def test_config_only_repo_falls_back_to_quantization_config(capsys):
    hub = CheckpointHub({"org/v4": Repo({"config.json": json.dumps(V4_CONFIG).encode()})})
    try:
        d = run_plan(capsys, "--target", "org/v4", "--hub-endpoint", hub.url, "--algorithm", "NONE")
    finally:
        hub.close()
    assert d["target"]["weight_source"] == "quantization_config"
    assert d["target"]["weight_bytes"] == derive_shapes(V4_CONFIG).quantized_weight_bytes
    assert any("estimated from quantization_config" in n for n in d["notes"])


@pytest.mark.parametrize("repo,token,message", [
    ("org/missing", None, "no such model 'org/missing'"),
    ("org/gated", None, "401 (no token given; set HF_TOKEN"),
    ("org/gated", "wrong", "401 (token rejected"),
])
def test_hub_errors_are_one_line(capsys, monkeypatch, repo, token, message):
    hub = CheckpointHub({"org/gated": Repo({"config.json": b"{}"}, token="right")})
    if token:
        monkeypatch.setenv("HF_TOKEN", token)
    else:
        monkeypatch.delenv("HF_TOKEN", raising=False)
    try:
        assert main(["plan", "--target", repo, "--hub-endpoint", hub.url, "--algorithm", "NONE"]) == 2
    finally:
        hub.close()
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_unreachable_hub_is_one_line(capsys):
    assert main(["plan", "--target", "org/x", "--hub-endpoint", "http://127.0.0.1:9", "--algorithm", "NONE"]) == 2
    assert "hub unreachable" in capsys.readouterr().err


def test_directory_reader_is_the_same_protocol(tmp_path):
    save_file({"w": torch.zeros(3, dtype=torch.float32)}, str(tmp_path / "a.safetensors"))
    weights = read_checkpoint_weights(DirectoryFiles(tmp_path))
    assert (weights.total_bytes, weights.source, weights.bytes_by_dtype) == (12, "headers", {"F32": 12})
