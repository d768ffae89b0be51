"""The planner sizes pytorch_model.bin checkpoints without torch (engine/planner/torch_files.py):
files written by torch.save, counted by the stdlib reader, checked against torch's own numbers."""

import json
import os
import zipfile
from collections import OrderedDict

import pytest
import torch

from specdeploy.engine.planner import torch_files
from specdeploy.engine.planner.errors import ConfigError
from specdeploy.engine.planner.weights import UNUSED_HEAD_TENSORS, load_model, load_model_path


def _state():
    tied = torch.randn(32, 8)
    return OrderedDict(
        [("embed_tokens.weight", torch.randn(32, 8)),                       # float32, 1 KiB
         ("fc.weight", torch.nn.Parameter(torch.randn(8, 16).half())),    # a Parameter, float16
         ("fc.bias", torch.randn(8).to(torch.bfloat16)),
         ("lm_head.weight", tied), ("tied.weight", tied),                  # one storage, two names
         ("d2t", torch.arange(12)), ("t2d", torch.ones(32, dtype=torch.bool))])


def _stored_bytes(state):
    seen, total = set(), 0
    for t in state.values():
        s = t.untyped_storage()
        if s.data_ptr() not in seen:
            seen.add(s.data_ptr())
            total += s.nbytes()
    return total


def test_storage_records_match_torch(tmp_path):
    state = _state()
    torch.save(state, tmp_path / "pytorch_model.bin")
    records = torch_files.storages(tmp_path / "pytorch_model.bin")
    by_name = {n: s for s, names in records.values() for n in names}
    assert by_name.keys() == state.keys()
    for name, t in state.items():
        assert by_name[name].dtype == str(t.dtype).removeprefix("torch."), name
        assert by_name[name].numel * by_name[name].itemsize == t.untyped_storage().nbytes(), name
    assert by_name["lm_head.weight"] == by_name["tied.weight"]   # one storage, counted once below
    # stored size: what the archive's data entries hold
    with zipfile.ZipFile(tmp_path / "pytorch_model.bin") as z:
        data = sum(i.file_size for i in z.infolist() if "/data/" in i.filename)
    summary = torch_files.summarize([tmp_path / "pytorch_model.bin"])
    assert summary.total_bytes == data == _stored_bytes(state)
    assert summary.num_tensors == len(state)
    assert summary.bytes_by_dtype == {"BF16": 8 * 2, "BOOL": 32, "F16": 8 * 16 * 2, "F32": 2 * 32 * 8 * 4, "I64": 12 * 8}


def test_a_head_s_unused_embedding_copy_is_not_counted(tmp_path):
    state = _state()
    torch.save(state, tmp_path / "pytorch_model.bin")
    summary = torch_files.summarize([tmp_path / "pytorch_model.bin"], UNUSED_HEAD_TENSORS)
    assert summary.total_bytes == _stored_bytes(state) - 32 * 8 * 4
    assert summary.num_tensors == len(state) - 1


def test_a_pickle_with_code_is_refused_without_running_it(tmp_path):
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (os.mkdir, (str(marker),))

    torch.save({"fc.weight": torch.zeros(2), "x": Payload()}, tmp_path / "pytorch_model.bin")
    with pytest.raises(torch_files.TorchFileError, match="posix.mkdir|os.mkdir|never does"):
        torch_files.summarize([tmp_path / "pytorch_model.bin"])
    assert not marker.exists()
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ConfigError):   # the planner's one-line error, not a traceback
        load_model_path(tmp_path)


def test_legacy_format_is_planned_from_the_shapes(tmp_path):
    """The pre-1.6 format, which the engine still loads, is not sized without torch: no bytes
    (the plan counts the shapes), no refusal."""
    torch.save({"w": torch.zeros(2)}, tmp_path / "pytorch_model.bin", _use_new_zipfile_serialization=False)
    (tmp_path / "config.json").write_text("{}")
    assert load_model_path(tmp_path) == ({}, None)
    with pytest.raises(torch_files.TorchFileError, match="not a zip archive"):
        torch_files.storages(tmp_path / "pytorch_model.bin")


def test_model_directories_with_bin_files(tmp_path):
    state = _state()
    single = tmp_path / "single"
    single.mkdir()
    (single / "config.json").write_text(json.dumps({"torch_dtype": "float16"}))
    torch.save(state, single / "pytorch_model.bin")
    (single / "training_args.bin").write_bytes(b"not weights")
    assert load_model_path(single)[1] == _stored_bytes(state)

    sharded = tmp_path / "sharded"
    sharded.mkdir()
    (sharded / "config.json").write_text("{}")
    names = list(state)
    parts = {"pytorch_model-00001-of-00002.bin": names[:3], "pytorch_model-00002-of-00002.bin": names[3:]}
    for file, part in parts.items():
        torch.save({n: state[n] for n in part}, sharded / file)
    index = {"metadata": {"total_size": 1}, "weight_map": {n: f for f, part in parts.items() for n in part}}
    (sharded / "pytorch_model.bin.index.json").write_text(json.dumps(index))
    assert load_model_path(sharded)[1] == _stored_bytes(state)
    (sharded / "pytorch_model-00002-of-00002.bin").unlink()   # shards not at hand: the index's total
    assert load_model_path(sharded)[1] == 1


def test_safetensors_win_and_their_headers_skip_unused_tensors_too(tmp_path):
    from safetensors.torch import save_file

    (tmp_path / "config.json").write_text("{}")
    torch.save({"stale": torch.zeros(1000)}, tmp_path / "pytorch_model.bin")
    save_file({"embed_tokens.weight": torch.zeros(32, 8), "fc.weight": torch.zeros(8, 16)}, str(tmp_path / "model.safetensors"))
    _, weights = load_model(tmp_path)
    assert (weights.source, weights.total_bytes) == ("headers", (32 * 8 + 8 * 16) * 4)
    _, weights = load_model(tmp_path, UNUSED_HEAD_TENSORS)
    assert weights.total_bytes == 8 * 16 * 4
    (tmp_path / "model.safetensors").unlink()
    _, weights = load_model(tmp_path)
    assert (weights.source, weights.total_bytes, weights.bytes_by_dtype) == ("pytorch", 4000, {"F32": 4000})
