"""Weight bytes of PyTorch checkpoint files (`pytorch_model.bin`), without torch.

The planner is pure Python, yet published EAGLE and EAGLE-3 heads ship only `pytorch_model.bin`.
Since torch 1.6 such a file is a zip archive:
    <name>/data.pkl      the state dict, pickled; each tensor a `torch._utils._rebuild_tensor_v2`
                         call whose first argument is a persistent id
                         ('storage', torch.<Kind>Storage, key, location, numel)
    <name>/data/<key>    each storage's raw bytes
The pickle is walked by a restricted unpickler that knows only those few names and builds
records, never objects (anything else refuses the file); so the bytes are counted per tensor
name and stored dtype, a tensor the engine does not load (an EAGLE-1 head's copy of the target's
embedding) can be left out, and storages shared by several tensors (tied weights) count once.
"""

from __future__ import annotations

import io
import pickle
import zipfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

# torch.<Kind>Storage -> (dtype name, bytes per element)
STORAGE_DTYPES = {
    "DoubleStorage": ("float64", 8), "FloatStorage": ("float32", 4), "HalfStorage": ("float16", 2),
    "BFloat16Storage": ("bfloat16", 2), "LongStorage": ("int64", 8), "IntStorage": ("int32", 4),
    "ShortStorage": ("int16", 2), "CharStorage": ("int8", 1), "ByteStorage": ("uint8", 1),
    "BoolStorage": ("bool", 1), "Float8_e4m3fnStorage": ("float8_e4m3fn", 1),
    "Float8_e5m2Storage": ("float8_e5m2", 1),
}


class TorchFileError(ValueError):
    pass


@dataclass(frozen=True)
class Storage:
    key: str
    dtype: str
    itemsize: int
    numel: int


@dataclass(frozen=True)
class _Tensor:
    storage: Storage


def _rebuild_tensor(storage, *args):
    if not isinstance(storage, Storage):
        raise TorchFileError("a tensor without a storage record")
    return _Tensor(storage)


def _rebuild_parameter(data, *args):
    return data


class _Records(pickle.Unpickler):
    """Unpickles a state dict into {name: _Tensor}: only the globals torch.save writes for one."""

    _ALLOWED = {
        ("collections", "OrderedDict"): dict,
        ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
        ("torch._utils", "_rebuild_tensor"): _rebuild_tensor,
        ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    }

    def find_class(self, module: str, name: str):
        if (module, name) in self._ALLOWED:
            return self._ALLOWED[(module, name)]
        if module == "torch" and name in STORAGE_DTYPES:
            return name
        raise TorchFileError(f"the pickle needs {module}.{name}, which a plain state dict never does")

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and pid[1] in STORAGE_DTYPES):
            raise TorchFileError(f"unknown storage record {str(pid)[:80]}")
        dtype, itemsize = STORAGE_DTYPES[pid[1]]
        return Storage(str(pid[2]), dtype, itemsize, int(pid[4]))


def storages(path: str | Path) -> dict[str, tuple[Storage, set[str]]]:
    """storage key -> (the storage, the names of the tensors that use it) of one .bin file."""
    path = Path(path)
    try:
        with zipfile.ZipFile(path) as archive:
            pickles = [n for n in archive.namelist() if n.endswith("/data.pkl") or n == "data.pkl"]
            if len(pickles) != 1:
                raise TorchFileError(f"{path}: not a torch.save archive (no single data.pkl)")
            state = _Records(io.BytesIO(archive.read(pickles[0]))).load()
    except zipfile.BadZipFile:
        raise TorchFileError(f"{path}: not a zip archive (the pre-1.6 torch format is not sized "
                             f"without torch)") from None
    except OSError as err:
        raise TorchFileError(f"{path}: cannot read ({err.strerror})") from None
    except (pickle.UnpicklingError, EOFError, TypeError, ValueError, AttributeError, IndexError) as err:
        if isinstance(err, TorchFileError):
            raise TorchFileError(f"{path}: {err}") from None
        raise TorchFileError(f"{path}: data.pkl is not a state dict ({err})") from None
    if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
        state = state["state_dict"]
    if not isinstance(state, dict):
        raise TorchFileError(f"{path}: holds no dict of tensors")
    out: dict[str, tuple[Storage, set[str]]] = {}
    for name, tensor in state.items():
        if not isinstance(tensor, _Tensor):
            raise TorchFileError(f"{path}: entry {name!r} is not a tensor")
        out.setdefault(tensor.storage.key, (tensor.storage, set()))[1].add(str(name))
    return out


PYTORCH_INDEX = "pytorch_model.bin.index.json"
# Only these names are weights (training_args.bin, optimizer.bin and the like are not).
PYTORCH_FILES = "pytorch_model*.bin"


@dataclass(frozen=True)
class Summary:
    """The tensors of some .bin files: stored bytes in all and by dtype (safetensors' codes, as
    the header reader reports them), each shared storage once."""

    total_bytes: int
    num_tensors: int
    bytes_by_dtype: dict[str, int]


# dtype names of the storage records -> safetensors dtype codes (weights.SAFETENSORS_DTYPE_BITS)
SAFETENSORS_CODES = {
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16", "int64": "I64",
    "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL",
    "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2",
}


def summarize(files: Iterable[str | Path], unused: tuple[str, ...] = ()) -> Summary:
    """Stored bytes of the tensors of these .bin files; storages used only by tensors named in
    `unused` (with or without a `model.` prefix) are left out."""
    by_dtype: dict[str, int] = {}
    tensors = 0
    for file in files:
        for storage, names in storages(file).values():
            kept = [n for n in names if n.removeprefix("model.") not in unused]
            if not kept:
                continue
            tensors += len(kept)
            code = SAFETENSORS_CODES[storage.dtype]
            by_dtype[code] = by_dtype.get(code, 0) + storage.numel * storage.itemsize
    return Summary(sum(by_dtype.values()), tensors, dict(sorted(by_dtype.items())))
