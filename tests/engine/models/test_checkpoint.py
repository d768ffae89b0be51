"""engine/models/checkpoint.py: the four published layouts (safetensors single / sharded with
index, pytorch_model.bin single / sharded with index) read back tensor for tensor, cast on the
way in, sliced per rank, and the ways a checkpoint can be wrong, each an error naming what."""

import json
import pickle
import zipfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from specdeploy.engine.models.checkpoint import Checkpoint, CheckpointError, find_layout
from specdeploy.engine.planner.torch_files import PYTORCH_INDEX
from specdeploy.engine.planner.weights import SAFETENSORS_INDEX


def _tensors():
    g = torch.Generator().manual_seed(0)
    return {
        "model.embed_tokens.weight": torch.randn(16, 8, generator=g, dtype=torch.float32),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(8, 8, generator=g).to(torch.float16),
        "model.layers.0.mlp.down_proj.weight": torch.randn(8, 12, generator=g).to(torch.bfloat16),
        "lm_head.weight": torch.randn(16, 8, generator=g, dtype=torch.float32),
        "d2t": torch.arange(10, dtype=torch.int64),
        "t2d": torch.arange(16) % 2 == 0,
    }


def _write(path, tensors, fmt, shards):
    """Write `tensors` as `fmt` ('safetensors' | 'pytorch') in `shards` files, with the index
    file the hub uses when shards > 1 (names as transformers' save_pretrained writes them)."""
    names = sorted(tensors)
    if shards == 1:
        file = "model.safetensors" if fmt == "safetensors" else "pytorch_model.bin"
        parts = {file: names}
    else:
        ext, stem = (".safetensors", "model") if fmt == "safetensors" else (".bin", "pytorch_model")
        parts = {f"{stem}-{i + 1:05d}-of-{shards:05d}{ext}": names[i::shards] for i in range(shards)}
    for file, part in parts.items():
        data = {n: tensors[n].contiguous() for n in part}
        if fmt == "safetensors":
            save_file(data, str(path / file), metadata={"format": "pt"})
        else:
            torch.save(data, path / file)
    if shards > 1:
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        index = {"metadata": {"total_size": total},
                 "weight_map": {n: f for f, part in parts.items() for n in part}}
        (path / (SAFETENSORS_INDEX if fmt == "safetensors" else PYTORCH_INDEX)).write_text(json.dumps(index))
    return parts


LAYOUTS = [("safetensors", 1), ("safetensors", 3), ("pytorch", 1), ("pytorch", 2)]


@pytest.mark.parametrize(("fmt", "shards"), LAYOUTS)
def test_every_layout_reads_back_exactly(tmp_path, fmt, shards):
    tensors = _tensors()
    parts = _write(tmp_path, tensors, fmt, shards)
    ckpt = Checkpoint(tmp_path)
    assert ckpt.format == fmt
    assert [f.name for f in ckpt.files] == list(parts)
    assert sorted(ckpt.names()) == sorted(tensors)
    seen = {}
    for name, t in ckpt.tensors():
        assert name not in seen
        seen[name] = t
    assert seen.keys() == tensors.keys()
    for name, t in tensors.items():
        assert seen[name].dtype == t.dtype and torch.equal(seen[name], t), name
        assert torch.equal(ckpt.get(name), t)


@pytest.mark.parametrize(("fmt", "shards"), LAYOUTS)
def test_float_tensors_cast_to_the_planned_dtype_others_kept(tmp_path, fmt, shards):
    tensors = _tensors()
    _write(tmp_path, tensors, fmt, shards)
    got = dict(Checkpoint(tmp_path).tensors(dtype=torch.bfloat16))
    for name, t in tensors.items():
        if t.is_floating_point():
            assert got[name].dtype == torch.bfloat16
            assert torch.equal(got[name], t.to(torch.bfloat16)), name
        else:  # index maps and masks are data, not weights
            assert got[name].dtype == t.dtype and torch.equal(got[name], t), name


@pytest.mark.parametrize(("fmt", "shards"), LAYOUTS)
def test_slices_per_rank(tmp_path, fmt, shards):
    tensors = _tensors()
    _write(tmp_path, tensors, fmt, shards)
    ckpt = Checkpoint(tmp_path)
    name = "model.layers.0.mlp.down_proj.weight"                      # [8, 12]
    full = tensors[name]
    for rank in range(4):
        rows = ckpt.get_slice(name, 0, 2 * rank, 2 * rank + 2)
        cols = ckpt.get_slice(name, 1, 3 * rank, 3 * rank + 3, dtype=torch.float32)
        assert torch.equal(rows, full[2 * rank:2 * rank + 2])
        assert cols.dtype == torch.float32
        assert torch.equal(cols, full[:, 3 * rank:3 * rank + 3].float())
    assert torch.equal(ckpt.get_slice(name, -1, 0, 6), full[:, :6])


def test_skipped_tensors_are_not_yielded(tmp_path):
    _write(tmp_path, _tensors(), "pytorch", 1)
    names = [n for n, _ in Checkpoint(tmp_path).tensors(skip=lambda n: n.endswith("embed_tokens.weight"))]
    assert "model.embed_tokens.weight" not in names and "lm_head.weight" in names


def test_safetensors_win_over_a_bin_copy(tmp_path):
    tensors = _tensors()
    _write(tmp_path, tensors, "safetensors", 1)
    torch.save({"stale": torch.zeros(1)}, tmp_path / "pytorch_model.bin")
    assert find_layout(tmp_path).format == "safetensors"
    assert "stale" not in Checkpoint(tmp_path).names()


def test_sharded_files_without_index_are_all_read(tmp_path):
    tensors = _tensors()
    _write(tmp_path, tensors, "safetensors", 2)
    (tmp_path / SAFETENSORS_INDEX).unlink()
    assert sorted(n for n, _ in Checkpoint(tmp_path).tensors()) == sorted(tensors)


def test_no_weights_is_an_error_naming_the_expected_files(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "training_args.bin").write_bytes(b"")  # not weights
    with pytest.raises(CheckpointError, match="no weights.*pytorch_model.bin"):
        Checkpoint(tmp_path)


@pytest.mark.parametrize("fmt", ["safetensors", "pytorch"])
def test_index_naming_a_missing_shard(tmp_path, fmt):
    parts = _write(tmp_path, _tensors(), fmt, 2)
    gone = list(parts)[1]
    (tmp_path / gone).unlink()
    with pytest.raises(CheckpointError, match=gone):
        Checkpoint(tmp_path)


@pytest.mark.parametrize("fmt", ["safetensors", "pytorch"])
def test_index_naming_a_tensor_its_shard_lacks(tmp_path, fmt):
    _write(tmp_path, _tensors(), fmt, 2)
    index_path = tmp_path / (SAFETENSORS_INDEX if fmt == "safetensors" else PYTORCH_INDEX)
    index = json.loads(index_path.read_text())
    first = next(iter(index["weight_map"].values()))
    index["weight_map"]["model.layers.0.self_attn.k_proj.weight"] = first
    index_path.write_text(json.dumps(index))
    ckpt = Checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match="k_proj"):
        list(ckpt.tensors())
    with pytest.raises(CheckpointError, match="k_proj"):
        ckpt.get("model.layers.0.self_attn.k_proj.weight")
    with pytest.raises(CheckpointError, match="no tensor 'nope'"):
        ckpt.get("nope")


class _Payload:
    """A pickle that runs code when unpickled without restrictions."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_pickle_with_code_is_refused_not_run(tmp_path):
    marker = tmp_path / "ran"
    # torch.save pickles any object; the restricted loader must refuse to build it.
    torch.save({"fc.weight": torch.zeros(2, 2), "evil": _Payload(marker)}, tmp_path / "pytorch_model.bin",
               pickle_module=pickle)
    assert zipfile.is_zipfile(tmp_path / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="weights_only"):
        list(Checkpoint(tmp_path).tensors())
    assert not marker.exists()


def test_legacy_torch_format_is_read(tmp_path):
    tensors = {"fc.weight": torch.randn(3, 4), "fc.bias": torch.randn(3)}
    torch.save(tensors, tmp_path / "pytorch_model.bin", _use_new_zipfile_serialization=False)
    got = dict(Checkpoint(tmp_path).tensors(dtype=torch.float16))
    assert torch.equal(got["fc.weight"], tensors["fc.weight"].half())


def _mapped_ranges(file):
    """Address ranges of /proc/self/maps that map `file`."""
    out = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split()
        if len(fields) >= 6 and fields[5] == str(file):
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            out.append((lo, hi))
    return out


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs Linux /proc")
def test_pytorch_tensors_stay_on_disk_until_read(tmp_path):
    """mmap: the tensors of a .bin are views of the file's mapped pages, not copies in memory."""
    _write(tmp_path, {"w": torch.randn(256, 256), "v": torch.randn(64)}, "pytorch", 1)
    file = (tmp_path / "pytorch_model.bin").resolve()
    for name, t in Checkpoint(tmp_path).tensors():
        ptr = t.data_ptr()
        assert any(lo <= ptr < hi for lo, hi in _mapped_ranges(file)), name
