"""load_model_path: config.json files, model directories, safetensors headers, sharded indexes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from specdeploy.engine.planner.shapes import ConfigError
from specdeploy.engine.planner.weights import load_model_path, safetensors_weight_bytes

CONFIGS = Path(__file__).resolve().parents[2] / "configs"

# two tensors: float16 [3, 4] and int64 [5] -> 3*4*2 + 5*8 bytes of payload
TENSORS = {"a.weight": np.zeros((3, 4), dtype=np.float16), "b.index": np.arange(5, dtype=np.int64)}
TENSORS_BYTES = 3 * 4 * 2 + 5 * 8


def write_model_dir(root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    shutil.copy(CONFIGS / "llama-3.1-8b-instruct.json", root / "config.json")
    return root


def test_reads_header_it_did_not_write(tmp_path):
    path = tmp_path / "model.safetensors"
    save_file(TENSORS, str(path), metadata={"format": "np"})
    assert safetensors_weight_bytes(path) == TENSORS_BYTES
    header_length = int.from_bytes(path.read_bytes()[:8], "little")
    assert path.stat().st_size == 8 + header_length + TENSORS_BYTES


def test_config_file_has_no_weights():
    config, weights = load_model_path(CONFIGS / "qwen3-8b.json")
    assert config["model_type"] == "qwen3" and weights is None


def test_directory_with_single_file(tmp_path):
    model = write_model_dir(tmp_path / "m")
    save_file(TENSORS, str(model / "model.safetensors"))
    config, weights = load_model_path(model)
    assert config["hidden_size"] == 4096 and weights == TENSORS_BYTES


def test_directory_without_weights(tmp_path):
    assert load_model_path(write_model_dir(tmp_path / "m"))[1] is None


def test_sharded_index_sums_listed_shards(tmp_path):
    model = write_model_dir(tmp_path / "m")
    save_file({"a.weight": TENSORS["a.weight"]}, str(model / "model-00001-of-00002.safetensors"))
    save_file({"b.index": TENSORS["b.index"]}, str(model / "model-00002-of-00002.safetensors"))
    # a stray file not in the index must not be counted
    save_file({"stray": np.zeros(1000, dtype=np.float32)}, str(model / "consolidated.safetensors"))
    index = {
        "metadata": {"total_size": 999},
        "weight_map": {"a.weight": "model-00001-of-00002.safetensors", "b.index": "model-00002-of-00002.safetensors"},
    }
    (model / "model.safetensors.index.json").write_text(json.dumps(index))
    assert load_model_path(model)[1] == TENSORS_BYTES  # the headers, not the declared total


def test_index_total_size_when_shards_are_absent(tmp_path):
    model = write_model_dir(tmp_path / "m")
    index = {"metadata": {"total_size": 16_060_522_496}, "weight_map": {"x": "model-00001-of-00004.safetensors"}}
    (model / "model.safetensors.index.json").write_text(json.dumps(index))
    assert load_model_path(model)[1] == 16_060_522_496


def test_index_without_shards_or_total_is_refused(tmp_path):
    model = write_model_dir(tmp_path / "m")
    (model / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "s1.safetensors"}}))
    with pytest.raises(ConfigError, match="s1.safetensors"):
        load_model_path(model)


@pytest.mark.parametrize(
    "content,message",
    [
        (b"\x01\x02", "shorter than"),
        ((10).to_bytes(8, "little") + b"{}", "truncated"),
        ((4).to_bytes(8, "little") + b"nope", "not valid JSON"),
        ((2**40).to_bytes(8, "little"), "implausible"),
        ((2).to_bytes(8, "little") + b"[]", "not a JSON object"),
        ((13).to_bytes(8, "little") + b'{"t": {"a":1}}'[:13], "not valid JSON"),
    ],
)
def test_corrupt_safetensors_is_a_clear_error(tmp_path, content, message):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(content)
    with pytest.raises(ConfigError, match=message):
        safetensors_weight_bytes(path)


def test_tensor_without_offsets(tmp_path):
    header = json.dumps({"t": {"dtype": "F16", "shape": [1]}}).encode()
    path = tmp_path / "bad.safetensors"
    path.write_bytes(len(header).to_bytes(8, "little") + header)
    with pytest.raises(ConfigError, match="data_offsets"):
        safetensors_weight_bytes(path)


def test_missing_path_and_missing_config(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        load_model_path(tmp_path / "absent")
    with pytest.raises(ConfigError, match="config.json not found"):
        load_model_path(tmp_path)


def test_bad_json_config(tmp_path):
    path = tmp_path / "config.json"
    path.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_model_path(path)
    path.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="JSON object"):
        load_model_path(path)
