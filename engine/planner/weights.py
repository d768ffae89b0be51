"""A checkpoint's real weight bytes, read from its safetensors headers before any weight is fetched.

A quantized checkpoint is far smaller than its parameter count times the config's `torch_dtype`:
DeepSeek-V4-Flash (284 B parameters, "bfloat16" in config.json) ships FP8 e4m3 linears with one
E8M0 scale per 128 x 128 block and FP4 routed experts (two e2m1 values per byte, one E8M0 scale
per 32), about 156 GB instead of 569 GB. The truth is in the files: every safetensors file opens
with an 8-byte little-endian length N and N bytes of JSON naming each tensor's dtype, shape and
byte span. Reading those few hundred kilobytes per shard (an HTTP range request on a hub) gives
the exact bytes of a checkpoint of any size and any format mix.

One pure function turns the leading bytes of a file into its tensor bytes
(`safetensors_header_summary`); `read_checkpoint_weights` applies it to a model's files through a
`CheckpointFiles` reader, which is the only I/O: a local directory here (`DirectoryFiles`), the
hub over urllib in `planner/remote.py` (for `specdeploy plan`), the hub over httpx in the
operator. Where the bytes came from is part of the answer (`CheckpointWeights.source`):

    headers   every shard's header was read: exact
    index     model.safetensors.index.json's (or pytorch_model.bin.index.json's)
              metadata.total_size (shards out of reach): exact as published, no breakdown by dtype
    pytorch   a directory with no safetensors: its pytorch_model*.bin archives' storage records
              (planner/torch_files.py; the published EAGLE and EAGLE-3 heads): exact

Tensors a published draft head ships but the engine never loads (`UNUSED_HEAD_TENSORS`, the copy
of the target's embedding in EAGLE-1/2 heads) are left out when the caller names them.

and, when no checkpoint file can be read at all, the plan falls back to an estimate from
config.json's `quantization_config` ("quantization_config", shapes.py) or to the parameter
count at `torch_dtype` ("shapes").
"""

from __future__ import annotations

import json
import math
import struct
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from specdeploy.engine.planner import torch_files
from specdeploy.engine.planner.errors import ConfigError

SAFETENSORS_INDEX = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

# A safetensors header larger than this is not a header: refuse it rather than read (and parse)
# it. The format allows 100 MB; published shards have a few kilobytes to ~1 MB (a DeepSeek-V4
# shard of 256 experts x 6 tensors is about 200 KB), and the operator runs in 512 Mi.
MAX_SAFETENSORS_HEADER_BYTES = 16 * 1024 * 1024
# Shards one index may list: published checkpoints have up to a few hundred (DeepSeek-V3: 163).
MAX_CHECKPOINT_SHARDS = 4096
# The first read of a file asks for this many bytes: most headers fit (a DeepSeek-V4 shard of 256
# experts x 6 tensors is about 200 KB), the rest take one more read of exactly what is missing.
HEADER_PROBE_BYTES = 512 * 1024

# Bits per element of every dtype the safetensors format defines. Sub-byte dtypes pack along
# the last dimension; U8/I8 also carry packed FP4 (DeepSeek-V4's experts: shape [out, in / 2]).
SAFETENSORS_DTYPE_BITS = {
    "BOOL": 8, "U8": 8, "I8": 8, "F8_E4M3": 8, "F8_E5M2": 8, "F8_E8M0": 8,
    "I16": 16, "U16": 16, "F16": 16, "BF16": 16,
    "I32": 32, "U32": 32, "F32": 32,
    "I64": 64, "U64": 64, "F64": 64, "C64": 64,
    "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6,
}

SOURCES = ("headers", "index", "pytorch", "quantization_config", "shapes")
# Tensors a published draft head ships but the engine does not load (engine/models/draft.py):
# EAGLE-1/2 heads carry a copy of the target's embedding.
UNUSED_HEAD_TENSORS = ("embed_tokens.weight",)


@dataclass(frozen=True)
class HeaderSummary:
    """The tensors of one safetensors file, from its header."""

    total_bytes: int
    num_tensors: int
    bytes_by_dtype: dict[str, int]


@dataclass(frozen=True)
class CheckpointWeights:
    """A checkpoint's weight bytes and where they came from (`source`: "headers" or "index")."""

    total_bytes: int
    source: str
    num_files: int
    num_tensors: int = 0  # 0 when only the index total was read
    bytes_by_dtype: dict[str, int] = field(default_factory=dict)


def header_length(prefix: bytes, origin: str) -> int:
    """N of the file's leading 8 bytes (little-endian u64): the JSON header's length."""
    if len(prefix) < 8:
        raise ConfigError(f"{origin}: not a safetensors file (shorter than its 8-byte header length)")
    (length,) = struct.unpack("<Q", prefix[:8])
    if length > MAX_SAFETENSORS_HEADER_BYTES or length < 2:
        raise ConfigError(f"{origin}: safetensors header length {length} is implausible")
    return length


def _tensor_bytes(name: str, entry: Any, origin: str) -> tuple[str, int]:
    """(dtype, bytes) of one header entry; its dtype x shape must match its byte span."""
    try:
        dtype, shape, (begin, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
        begin, end = int(begin), int(end)
        shape = [int(d) for d in shape]
    except (TypeError, KeyError, ValueError):
        raise ConfigError(f"{origin}: tensor {name!r} lacks dtype, shape or data_offsets") from None
    span = end - begin
    if begin < 0 or span < 0 or any(d < 0 for d in shape):
        raise ConfigError(f"{origin}: tensor {name!r} has a negative shape or byte span")
    bits = SAFETENSORS_DTYPE_BITS.get(str(dtype))
    # A dtype newer than this table is counted by its span alone: the span is what is stored.
    if bits is not None and math.ceil(math.prod(shape) * bits / 8) != span:
        raise ConfigError(
            f"{origin}: tensor {name!r} is {dtype} {shape} ({math.ceil(math.prod(shape) * bits / 8)} bytes) "
            f"but its data_offsets span {span} bytes"
        )
    return str(dtype), span


def safetensors_header_summary(blob: bytes, origin: str, unused: tuple[str, ...] = ()) -> HeaderSummary:
    """The tensors of a safetensors file from its leading bytes (at least 8 + N of them).

    Format: 8-byte little-endian header length N, then N bytes of JSON mapping each tensor name
    to {dtype, shape, data_offsets: [begin, end]} (plus an optional "__metadata__" entry).
    Tensors named in `unused` (with or without a `model.` prefix) are not counted.
    Raises ConfigError naming `origin` for anything that is not such a header.
    """
    length = header_length(blob, origin)
    raw = blob[8:8 + length]
    if len(raw) < length:
        raise ConfigError(f"{origin}: safetensors header is truncated ({len(raw)} of {length} bytes)")
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise ConfigError(f"{origin}: safetensors header is not valid JSON") from None
    if not isinstance(header, dict):
        raise ConfigError(f"{origin}: safetensors header is not a JSON object")
    by_dtype: dict[str, int] = {}
    tensors = 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        dtype, size = _tensor_bytes(name, entry, origin)
        if name.removeprefix("model.") in unused:
            continue
        by_dtype[dtype] = by_dtype.get(dtype, 0) + size
        tensors += 1
    return HeaderSummary(sum(by_dtype.values()), tensors, dict(sorted(by_dtype.items())))


class CheckpointFiles(Protocol):
    """Read access to a model's files: a directory, or a hub repository at one revision."""

    origin: str  # for messages: a path or a URL prefix

    def read_json(self, name: str) -> Any | None:
        """The parsed JSON file `name`, or None when there is no such file."""
        ...

    def read_range(self, name: str, start: int, length: int) -> bytes | None:
        """Up to `length` bytes of `name` from offset `start` (fewer at its end), or None when
        there is no such file."""
        ...

    def safetensors_names(self) -> list[str]:
        """The safetensors files to read when there is no index."""
        ...


def read_header(files: CheckpointFiles, name: str, unused: tuple[str, ...] = ()) -> HeaderSummary | None:
    """One file's header summary through at most two reads; None when the file does not exist."""
    head = files.read_range(name, 0, HEADER_PROBE_BYTES)
    if head is None:
        return None
    origin = f"{files.origin}/{name}"
    needed = 8 + header_length(head, origin)
    if len(head) < needed:
        rest = files.read_range(name, len(head), needed - len(head))
        head += rest or b""
    return safetensors_header_summary(head[:needed], origin, unused)


def read_checkpoint_weights(files: CheckpointFiles, unused: tuple[str, ...] = ()) -> CheckpointWeights | None:
    """The checkpoint's weight bytes: every shard header the index lists (or, with no index, every
    safetensors file); the index's metadata.total_size when its shards are out of reach; None when
    there is no safetensors checkpoint at all."""
    index = files.read_json(SAFETENSORS_INDEX)
    if index is not None:
        origin = f"{files.origin}/{SAFETENSORS_INDEX}"
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not weight_map or not all(isinstance(v, str) for v in weight_map.values()):
            raise ConfigError(f"{origin}: has no weight_map of tensor names to shard files")
        shards = sorted(set(weight_map.values()))
        if len(shards) > MAX_CHECKPOINT_SHARDS:
            raise ConfigError(f"{origin}: lists {len(shards)} shard files, more than {MAX_CHECKPOINT_SHARDS}; refused")
        bad = next((s for s in shards if not _plain_file_name(s)), None)
        if bad is not None:
            raise ConfigError(f"{origin}: shard {bad!r} is not a plain .safetensors file name")
        summaries = []
        for shard in shards:
            summary = read_header(files, shard, unused)
            if summary is None:
                break
            summaries.append(summary)
        else:
            return _combine(summaries, "headers")
        total = (index.get("metadata") or {}).get("total_size")
        if isinstance(total, int) and not isinstance(total, bool) and total > 0:
            return CheckpointWeights(total, "index", len(shards))
        raise ConfigError(f"{files.origin}/{shards[len(summaries)]}: shard listed in {SAFETENSORS_INDEX} is missing")
    summaries = [s for s in (read_header(files, n, unused) for n in files.safetensors_names()) if s is not None]
    return _combine(summaries, "headers") if summaries else None


def _plain_file_name(name: str) -> bool:
    """A shard name an index may give: a file beside it, never a path out of the repository."""
    return (name.endswith(".safetensors") and not name.startswith((".", "-")) and "/" not in name
            and "\\" not in name and all(0x20 < ord(c) < 0x7F for c in name))


def read_pytorch_weights(root: Path, unused: tuple[str, ...] = ()) -> CheckpointWeights | None:
    """A local directory's pytorch_model*.bin weights (the shards pytorch_model.bin.index.json
    lists, its total_size when they are not all there, else every pytorch_model*.bin); None when
    there are none."""
    index_path = root / torch_files.PYTORCH_INDEX
    if index_path.is_file():
        index = _read_json(index_path, torch_files.PYTORCH_INDEX)
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not weight_map or not all(isinstance(v, str) for v in weight_map.values()):
            raise ConfigError(f"{index_path}: has no weight_map of tensor names to shard files")
        shards = [root / n for n in sorted(set(weight_map.values()))]
        absent = [s for s in shards if not s.is_file()]
        if absent:
            total = (index.get("metadata") or {}).get("total_size")
            if isinstance(total, int) and not isinstance(total, bool) and total > 0:
                return CheckpointWeights(total, "index", len(shards))
            raise ConfigError(f"{absent[0]}: shard listed in {torch_files.PYTORCH_INDEX} is missing")
    else:
        shards = sorted(root.glob(torch_files.PYTORCH_FILES))
        if not shards:
            return None
    if not all(zipfile.is_zipfile(s) for s in shards):
        # The pre-1.6 torch format (the engine still reads it, into memory) cannot be sized
        # without torch: the plan counts the parameters from the shapes instead.
        return None
    try:
        summary = torch_files.summarize(shards, unused)
    except torch_files.TorchFileError as err:
        raise ConfigError(str(err)) from None
    return CheckpointWeights(summary.total_bytes, "pytorch", len(shards), summary.num_tensors,
                             summary.bytes_by_dtype)


def _combine(summaries: list[HeaderSummary], source: str) -> CheckpointWeights:
    by_dtype: dict[str, int] = {}
    for s in summaries:
        for dtype, size in s.bytes_by_dtype.items():
            by_dtype[dtype] = by_dtype.get(dtype, 0) + size
    return CheckpointWeights(
        total_bytes=sum(s.total_bytes for s in summaries),
        source=source,
        num_files=len(summaries),
        num_tensors=sum(s.num_tensors for s in summaries),
        bytes_by_dtype=dict(sorted(by_dtype.items())),
    )


# --------------------------------------------------------------------------------------------
# local model paths


def _read_json(path: Path, what: str) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{path}: {what} not found") from None
    except IsADirectoryError:
        raise ConfigError(f"{path}: is a directory, expected {what}") from None
    except OSError as err:
        raise ConfigError(f"{path}: cannot read {what} ({err.strerror})") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ConfigError(f"{path}: {what} is not valid JSON ({err})") from None


class DirectoryFiles:
    """CheckpointFiles over a local model directory."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.origin = str(self.root)

    def read_json(self, name: str) -> Any | None:
        path = self.root / name
        return _read_json(path, name) if path.is_file() else None

    def read_range(self, name: str, start: int, length: int) -> bytes | None:
        path = self.root / name
        if not path.is_file():
            return None
        try:
            with path.open("rb") as f:
                f.seek(start)
                return f.read(length)
        except OSError as err:
            raise ConfigError(f"{path}: cannot read ({err.strerror})") from None

    def safetensors_names(self) -> list[str]:
        return sorted(p.name for p in self.root.glob("*.safetensors"))


def safetensors_weight_bytes(path: str | Path) -> int:
    """Tensor payload bytes of one .safetensors file, from its header alone."""
    path = Path(path)
    summary = read_header(DirectoryFiles(path.parent), path.name)
    if summary is None:
        raise ConfigError(f"{path}: cannot read (no such file)")
    return summary.total_bytes


def load_model(path: str | Path, unused: tuple[str, ...] = ()) -> tuple[dict[str, Any], CheckpointWeights | None]:
    """(config dict, checkpoint weights or None) for a config.json file or a model directory:
    its safetensors, else its pytorch_model*.bin files (the engine reads them in that order,
    engine/models/checkpoint.py). Tensors named in `unused` are not counted (a draft head's
    UNUSED_HEAD_TENSORS)."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"{path}: no such file or directory")
    config_path = path if path.is_file() else path / "config.json"
    config = _read_json(config_path, "config.json")
    if not isinstance(config, dict):
        raise ConfigError(f"{config_path}: expected a JSON object")
    if path.is_file():
        return config, None
    return config, read_checkpoint_weights(DirectoryFiles(path), unused) or read_pytorch_weights(path, unused)


def load_model_path(path: str | Path, unused: tuple[str, ...] = ()) -> tuple[dict[str, Any], int | None]:
    """(config dict, weight bytes or None): `load_model` without the source."""
    config, weights = load_model(path, unused)
    return config, None if weights is None else weights.total_bytes
