"""Checkpoint files as models are published, read one tensor at a time.

Four layouts exist on the hub, and this module is the only reader of any of them:
    model.safetensors                                    one safetensors file
    model.safetensors.index.json + model-0000i-of-N      shards; the index's weight_map names each tensor's file
    pytorch_model.bin                                    one torch.save zip (EAGLE / EAGLE-3 heads ship this)
    pytorch_model.bin.index.json + pytorch_model-0000i-of-N.bin
A directory with both formats is read as safetensors (the .bin files are then an old copy).

PyTorch files are pickles. They are opened with `torch.load(weights_only=True, mmap=True)`: the
restricted unpickler builds tensors, dicts and plain values and refuses every other object (a
file that needs more is refused with its name, never executed), and mmap leaves the payload on
disk until a tensor is touched. Safetensors are memory-mapped by their own library.

Stored dtypes differ from the dtype a deployment runs in (EAGLE heads stored in float32 or
float16, targets in bfloat16). `tensors(dtype=...)` casts every float32/float16/bfloat16 tensor as
it is yielded, so at most one tensor exists in two dtypes at any time; other dtypes (fp8 weights,
their scales, int64 index maps, bool masks) pass unchanged for the caller to interpret.

Tensor parallelism reads a rank's part with `get_slice(name, dim, start, stop)`: safetensors
read only those bytes (`safe_open(...).get_slice`), an mmap'd PyTorch tensor is narrowed before
it is copied. `sources()` hands the loader every tensor as a `TensorSource` (shape known, nothing
read) so that each layer asks for its own rows or columns and a rank never reads a whole matrix.

Loading reports its progress (`LoadProgress`): `load_state` (engine/models/layers.py) adds the
bytes of every parameter it fills to the progress of the loading in hand (`reporting(progress)`,
a context variable, so no loader passes it along), which logs a line every few seconds for
`kubectl logs` and gives /health its figures (the operator's "X GiB of Y GiB of weights loaded").
"""

from __future__ import annotations

import json
import logging
import os
import time
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path

import torch

from specdeploy.engine.planner.torch_files import PYTORCH_FILES, PYTORCH_INDEX
from specdeploy.engine.planner.weights import SAFETENSORS_INDEX

log = logging.getLogger("specdeploy.engine.load")

SAFETENSORS_FILE = "model.safetensors"
PYTORCH_FILE = "pytorch_model.bin"
# Stored float dtypes that are cast to the planned dtype on the way in; anything else (fp8,
# integer maps, masks) is data whose meaning the caller knows.
CASTABLE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# How often a loading engine logs how far it is.
LOAD_LOG_EVERY_S = 5.0


class LoadProgress:
    """Weight bytes loaded of `total_bytes` (the plan's weights for this GPU, target + draft).
    Written by the loading thread, read by the server's event loop (two ints: no lock needed)."""

    def __init__(self, log_every_s: float = LOAD_LOG_EVERY_S, clock: Callable[[], float] = time.monotonic):
        self.log_every_s, self.clock = log_every_s, clock
        self.total_bytes = self.loaded_bytes = 0
        self.loading = False
        self.started_s = self._logged_s = 0.0

    def start(self, total_bytes: int) -> None:
        self.total_bytes, self.loaded_bytes, self.loading = int(total_bytes), 0, True
        self.started_s = self._logged_s = self.clock()

    def add(self, nbytes: int) -> None:
        self.loaded_bytes += int(nbytes)
        now = self.clock()
        if now - self._logged_s >= self.log_every_s:
            self._logged_s = now
            log.info("%s", self.line(now))

    def line(self, now: float | None = None) -> str:
        elapsed_s = (self.clock() if now is None else now) - self.started_s
        share = f" ({100 * self.loaded_bytes / self.total_bytes:.0f}%)" if self.total_bytes else ""
        rate = f", {self.loaded_bytes / 2**20 / elapsed_s:.0f} MiB/s" if elapsed_s > 0 else ""
        return (f"loading weights: {self.loaded_bytes / 2**30:.2f} of {self.total_bytes / 2**30:.2f} GiB"
                f"{share}{rate}")

    def finish(self) -> None:
        self.loading = False

    def figures(self) -> dict[str, int] | None:
        """{"loaded_bytes", "total_bytes"} while loading (what /health reports), else None."""
        if not self.loading:
            return None
        return {"loaded_bytes": self.loaded_bytes, "total_bytes": self.total_bytes}


_REPORTING: ContextVar[LoadProgress | None] = ContextVar("specdeploy_load_progress", default=None)


@contextmanager
def reporting(progress: LoadProgress | None):
    """Within this block, the weights `load_state` fills count towards `progress` (None: nowhere)."""
    token = _REPORTING.set(progress)
    try:
        yield progress
    finally:
        _REPORTING.reset(token)


def count_loaded(nbytes: int) -> None:
    """`nbytes` of parameters were filled: count them towards the loading in hand, if any."""
    progress = _REPORTING.get()
    if progress is not None:
        progress.add(nbytes)


class CheckpointError(ValueError):
    """A checkpoint that cannot be read as published: the message names the file or tensor."""


@dataclass(frozen=True)
class Layout:
    """Which files hold the weights. `weight_map` (tensor name -> file name) comes from an index;
    without one it is None and every tensor of every file counts."""

    format: str                          # "safetensors" | "pytorch"
    files: tuple[Path, ...]
    weight_map: dict[str, str] | None = None


def find_layout(path: str | Path) -> Layout:
    """The weight files of the model directory `path`, as the layouts above define them."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a model directory")
    for fmt, index_name, single, pattern in (
        ("safetensors", SAFETENSORS_INDEX, SAFETENSORS_FILE, "*.safetensors"),
        ("pytorch", PYTORCH_INDEX, PYTORCH_FILE, PYTORCH_FILES),
    ):
        index_path = path / index_name
        if index_path.is_file():
            weight_map = _read_weight_map(index_path)
            files = tuple(path / name for name in sorted(set(weight_map.values())))
            absent = [f.name for f in files if not f.is_file()]
            if absent:
                raise CheckpointError(f"{index_path}: lists shard(s) that are not there: {absent[:4]}")
            return Layout(fmt, files, weight_map)
        if (path / single).is_file():
            return Layout(fmt, (path / single,))
        found = tuple(sorted(path.glob(pattern)))
        if found:
            return Layout(fmt, found)
    raise CheckpointError(f"{path}: no weights ({SAFETENSORS_FILE}, {SAFETENSORS_INDEX}, "
                          f"{PYTORCH_FILE} or {PYTORCH_INDEX})")


def _read_weight_map(index_path: Path) -> dict[str, str]:
    try:
        index = json.loads(index_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{index_path}: unreadable ({err})") from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{index_path}: has no weight_map")
    if not all(isinstance(v, str) and "/" not in v for v in weight_map.values()):
        raise CheckpointError(f"{index_path}: weight_map values must be file names in the same directory")
    return weight_map


def _load_pytorch(file: Path) -> dict[str, torch.Tensor]:
    """A torch.save file's state dict, tensors left on disk (mmap) where the format allows."""
    # torch.save writes a zip archive since torch 1.6; only that format can be memory-mapped.
    # The legacy format is still read with the restricted unpickler, into memory.
    mmap = zipfile.is_zipfile(file)
    if not mmap:
        log.info("weights: %s is in the legacy (pre-zip) torch format; reading it into memory", file.name)
    try:
        state = torch.load(file, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as err:  # noqa: BLE001 - the unpickler raises many types; all mean "unreadable"
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise CheckpointError(f"{file}: not loadable as plain tensors with weights_only=True "
                              f"(nothing in it was executed): {first_line}") from None
    if isinstance(state, dict) and "state_dict" in state and isinstance(state["state_dict"], dict):
        state = state["state_dict"]
    if not isinstance(state, dict):
        raise CheckpointError(f"{file}: holds a {type(state).__name__}, not a dict of tensors")
    bad = [k for k, v in state.items() if not isinstance(k, str) or not isinstance(v, torch.Tensor)]
    if bad:
        raise CheckpointError(f"{file}: entries that are not tensors: {[str(k) for k in bad[:4]]}")
    return state


def cast(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """`tensor` in `dtype` if it is stored in one of the float dtypes models are published in."""
    if dtype is None or tensor.dtype == dtype or tensor.dtype not in CASTABLE_DTYPES:
        return tensor
    return tensor.to(dtype)


class TensorSource:
    """A checkpoint tensor not read yet: `shape`, `narrow(dim, start, length)` (reads only that
    part) and `read()` (the whole tensor). torch tensors answer shape and narrow alike, so a
    layer's `load_param` takes either."""

    def __init__(self, shape: tuple[int, ...], read_part: Callable[[int, int, int], torch.Tensor],
                 read_all: Callable[[], torch.Tensor]):
        self.shape = torch.Size(shape)
        self._read_part, self._read_all = read_part, read_all

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        return self._read_part(dim, start, start + length)

    def read(self) -> torch.Tensor:
        return self._read_all()


class Checkpoint:
    """The weights of one model directory.

        ckpt = Checkpoint(path)
        for name, tensor in ckpt.tensors(dtype=torch.bfloat16, skip=lambda n: n.startswith("mtp.")):
            ...                                    # one tensor at a time, file by file
        ckpt.names()                               # every tensor name, without reading payloads
        ckpt.get("lm_head.weight")                 # one whole tensor
        ckpt.get_slice("lm_head.weight", 0, lo, hi)   # rows lo:hi only (tensor parallelism)
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.layout = find_layout(self.path)
        self._pytorch_cache: tuple[Path, dict[str, torch.Tensor]] | None = None
        self._file_of: dict[str, Path] | None = None

    @property
    def format(self) -> str:
        return self.layout.format

    @property
    def files(self) -> tuple[Path, ...]:
        return self.layout.files

    def total_bytes(self) -> int:
        return sum(f.stat().st_size for f in self.files)

    def describe(self) -> str:
        """`2 safetensors file(s), 1.23 GiB` for the start-up log."""
        return f"{len(self.files)} {self.format} file(s), {self.total_bytes() / 2**30:.2f} GiB"

    # -- names and one tensor --------------------------------------------------------------

    def _file_names(self, file: Path) -> list[str]:
        if self.format == "safetensors":
            from safetensors import safe_open

            with safe_open(str(file), framework="pt") as f:
                return list(f.keys())
        return list(self._pytorch_state(file))

    def _pytorch_state(self, file: Path) -> dict[str, torch.Tensor]:
        # Keep the last opened file: the slices of one layer's tensors usually sit in one shard.
        if self._pytorch_cache is None or self._pytorch_cache[0] != file:
            self._pytorch_cache = (file, _load_pytorch(file))
        return self._pytorch_cache[1]

    def file_of(self) -> dict[str, Path]:
        """Tensor name -> the file holding it (from the index, else from each file's names)."""
        if self._file_of is None:
            if self.layout.weight_map is not None:
                self._file_of = {n: self.path / f for n, f in self.layout.weight_map.items()}
            else:
                self._file_of = {n: f for f in self.files for n in self._file_names(f)}
        return self._file_of

    def names(self) -> list[str]:
        return list(self.file_of())

    def _file_for(self, name: str) -> Path:
        file = self.file_of().get(name)
        if file is None:
            raise CheckpointError(f"{self.path}: checkpoint has no tensor {name!r}")
        return file

    def get(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        file = self._file_for(name)
        if self.format == "safetensors":
            from safetensors import safe_open

            with safe_open(str(file), framework="pt") as f:
                if name not in f.keys():  # noqa: SIM118 - safe_open has no __contains__
                    raise CheckpointError(f"{file}: has no tensor {name!r} (its index says it does)")
                return cast(f.get_tensor(name), dtype)
        state = self._pytorch_state(file)
        if name not in state:
            raise CheckpointError(f"{file}: has no tensor {name!r} (its index says it does)")
        return cast(state[name], dtype)

    def get_slice(self, name: str, dim: int, start: int, stop: int,
                  dtype: torch.dtype | None = None) -> torch.Tensor:
        """tensor.narrow(dim, start, stop - start) of one tensor, reading no more than needed."""
        file = self._file_for(name)
        if self.format == "safetensors":
            from safetensors import safe_open

            with safe_open(str(file), framework="pt") as f:
                if name not in f.keys():  # noqa: SIM118 - safe_open has no __contains__
                    raise CheckpointError(f"{file}: has no tensor {name!r} (its index says it does)")
                view = f.get_slice(name)
                rank = len(view.get_shape())
                if not -rank <= dim < rank:
                    raise CheckpointError(f"{name}: no dimension {dim} in shape {view.get_shape()}")
                index = [slice(None)] * rank
                index[dim % rank] = slice(start, stop)
                return cast(view[tuple(index)], dtype)
        state = self._pytorch_state(file)
        if name not in state:
            raise CheckpointError(f"{file}: has no tensor {name!r} (its index says it does)")
        # narrow is a view of the mmap'd (private, copy-on-write) storage: only the pages of the
        # part are read, when it is cast or copied.
        return cast(state[name].narrow(dim, start, stop - start), dtype)

    # -- everything, lazily ----------------------------------------------------------------

    def tensors(self, dtype: torch.dtype | None = None,
                skip: Callable[[str], bool] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) for every tensor, file by file; names for which `skip` is true are not
        read. With an index, a tensor it lists that its shard lacks is an error naming it."""
        t0 = time.perf_counter()
        wanted_in: dict[Path, set[str]] = {}
        if self.layout.weight_map is not None:
            for n, f in self.layout.weight_map.items():
                wanted_in.setdefault(self.path / f, set()).add(n)
        for i, file in enumerate(self.files, 1):
            if self.format == "safetensors":
                yield from self._safetensors_file(file, dtype, skip, wanted_in.get(file))
            else:
                yield from self._pytorch_file(file, dtype, skip, wanted_in.get(file))
            # Progress for `kubectl logs` while a large checkpoint loads, one line per file.
            log.info("weights: %s read (%d/%d, %.2f GiB, %.1f s)", file.name, i, len(self.files),
                     os.path.getsize(file) / 2**30, time.perf_counter() - t0)

    def sources(self, skip: Callable[[str], bool] | None = None) -> Iterator[tuple[str, TensorSource]]:
        """(name, TensorSource) for every tensor `tensors()` would yield, in the same order,
        reading nothing but headers until a source is asked for its part."""
        for name, file in self.file_of().items():
            if skip is not None and skip(name):
                continue
            yield name, TensorSource(self._shape(name, file),
                                     lambda dim, lo, hi, name=name: self.get_slice(name, dim, lo, hi),
                                     lambda name=name: self.get(name))

    def _shape(self, name: str, file: Path) -> tuple[int, ...]:
        if self.format == "safetensors":
            from safetensors import safe_open

            with safe_open(str(file), framework="pt") as f:
                return tuple(f.get_slice(name).get_shape())
        return tuple(self._pytorch_state(file)[name].shape)

    def _safetensors_file(self, file, dtype, skip, listed):
        from safetensors import safe_open

        with safe_open(str(file), framework="pt") as f:
            keys = list(f.keys())
            _check_listed(file, keys, listed)
            for name in keys:
                if listed is not None and name not in listed:
                    continue  # a stray tensor the index does not list is not part of the model
                if skip is not None and skip(name):
                    continue
                yield name, cast(f.get_tensor(name), dtype)

    def _pytorch_file(self, file, dtype, skip, listed):
        state = _load_pytorch(file)
        _check_listed(file, list(state), listed)
        for name in list(state):
            tensor = state.pop(name)  # the dict lets go of each tensor once it is yielded
            if (listed is not None and name not in listed) or (skip is not None and skip(name)):
                continue
            yield name, cast(tensor, dtype)


def _check_listed(file: Path, keys: list[str], listed: set[str] | None) -> None:
    if listed is None:
        return
    absent = sorted(listed - set(keys))
    if absent:
        raise CheckpointError(f"{file}: lacks tensor(s) its index lists: {absent[:8]}")
