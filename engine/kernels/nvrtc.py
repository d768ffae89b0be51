"""CUDA C++ kernels compiled at run time with NVRTC and launched through the driver API (ctypes).

For the few kernels Triton cannot express (engine/kernels/fp8_mma.py: a warp's mma.sync
fragments laid out by hand). NVRTC ships with PyTorch's CUDA wheels (nvidia-cuda-nvrtc) and the
driver is the machine's, so neither an nvcc nor a build step is needed, on the device or in the
engine image. `compile_cubin` is pure (source and macros in, a cubin out) and runs on a machine
without a GPU as well, which is how CPU tests check every configuration compiles and look at
its machine code. `Kernel` loads a cubin into a device's primary context (the one PyTorch uses)
and launches it on PyTorch's current stream with cuLaunchKernelEx, optionally with programmatic
dependent launch (engine/kernels/launch.py), so a launch is captured into CUDA graphs like any
other.

Nothing here runs at import: the libraries are opened on first use.
"""

from __future__ import annotations

import ctypes
import functools
import glob
import os
import sys

import torch

CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6
CU_FUNC_ATTRIBUTE_NUM_REGS = 4
CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES = 3
CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
DEFAULT_SHARED_BYTES = 48 << 10  # dynamic shared memory a launch gets without raising the limit


class NvrtcError(RuntimeError):
    """NVRTC or the driver is missing, or a compile, load or launch failed; says which in one line."""


def _candidates(stem: str, major: str) -> list[str]:
    names = [f"{stem}.so.{major}", f"{stem}.so"]
    # PyTorch's wheels put the NVIDIA libraries under site-packages/nvidia/<component>/lib (CUDA
    # 12: cuda_nvrtc/lib; CUDA 13: cu13/lib); the soname alone finds one already loaded.
    for base in sys.path:
        names += sorted(glob.glob(os.path.join(base, "nvidia", "*", "lib", f"{stem}.so.{major}*")))
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    names += sorted(glob.glob(os.path.join(cuda_home, "lib64", f"{stem}.so*")))
    return names


@functools.cache
def _nvrtc() -> ctypes.CDLL:
    major = (torch.version.cuda or "12").split(".")[0]
    for name in _candidates("libnvrtc", major):
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        return lib
    raise NvrtcError(f"NVRTC (libnvrtc.so.{major}) is not installed: pip install nvidia-cuda-nvrtc, or use a CUDA build of torch")


@functools.cache
def _driver() -> ctypes.CDLL:
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        raise NvrtcError(f"the CUDA driver (libcuda.so.1) is not loadable: {exc}") from None
    return lib


def _check_nvrtc(lib: ctypes.CDLL, result: int, what: str) -> None:
    if result != 0:
        raise NvrtcError(f"NVRTC {what}: {lib.nvrtcGetErrorString(result).decode()}")


def _check_cu(result: int, what: str) -> None:
    if result != 0:
        msg = ctypes.c_char_p()
        _driver().cuGetErrorString(result, ctypes.byref(msg))
        raise NvrtcError(f"CUDA driver {what}: {msg.value.decode() if msg.value else f'error {result}'}")


def nvrtc_version() -> tuple[int, int]:
    lib = _nvrtc()
    major, minor = ctypes.c_int(), ctypes.c_int()
    _check_nvrtc(lib, lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "version")
    return major.value, minor.value


@functools.lru_cache(maxsize=256)
def compile_cubin(source: str, name: str, arch: str, defines: tuple[tuple[str, int], ...] = ()) -> bytes:
    """The cubin of `source` for `arch` ("sm_90"), with `-D NAME=VALUE` for each define; compile
    errors raise NvrtcError with NVRTC's log."""
    return _compile(source, name, arch, defines, "CUBIN")


def compile_ptx(source: str, name: str, arch: str, defines: tuple[tuple[str, int], ...] = ()) -> str:
    """The PTX of `source` for a virtual `arch` ("compute_90"): what the kernel asks of the
    machine, in order (tests read it)."""
    return _compile(source, name, arch, defines, "PTX").rstrip(b"\0").decode()


def _compile(source: str, name: str, arch: str, defines: tuple[tuple[str, int], ...], output: str) -> bytes:
    lib = _nvrtc()
    prog = ctypes.c_void_p()
    _check_nvrtc(lib, lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), f"{name}.cu".encode(), 0, None, None),
                 "create program")
    try:
        opts = [f"--gpu-architecture={arch}", "--std=c++17"] + [f"-D{k}={int(v)}" for k, v in defines]
        c_opts = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
        result = lib.nvrtcCompileProgram(prog, len(opts), c_opts)
        if result != 0:
            size = ctypes.c_size_t()
            lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value)
            lib.nvrtcGetProgramLog(prog, log)
            raise NvrtcError(f"NVRTC compile of {name} {dict(defines)} for {arch} failed: "
                             + log.value.decode(errors="replace").strip())
        size = ctypes.c_size_t()
        _check_nvrtc(lib, getattr(lib, f"nvrtcGet{output}Size")(prog, ctypes.byref(size)), f"{output} size")
        image = ctypes.create_string_buffer(size.value)
        _check_nvrtc(lib, getattr(lib, f"nvrtcGet{output}")(prog, image), output)
        return image.raw
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def device_arch(device: torch.device) -> str:
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}"


class _LaunchAttribute(ctypes.Structure):
    # CUlaunchAttribute: the id, padding to 8 bytes, a 64-byte value union (its first int here)
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int), ("rest", ctypes.c_char * 60)]


class _LaunchConfig(ctypes.Structure):
    _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint), ("gridDimZ", ctypes.c_uint),
                ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_LaunchAttribute)), ("numAttrs", ctypes.c_uint)]


class Kernel:
    """One `extern "C"` kernel of a cubin, loaded into `device`'s primary context."""

    def __init__(self, cubin: bytes, name: str, device: torch.device):
        self.name = name
        self.device = device
        drv = _driver()
        with torch.cuda.device(device):
            torch.cuda.current_stream(device)  # the runtime has made the device's primary context current
            ctx = ctypes.c_void_p()
            _check_cu(drv.cuCtxGetCurrent(ctypes.byref(ctx)), "cuCtxGetCurrent")
            if not ctx.value:
                raise NvrtcError(f"no CUDA context is current for {device}")
            self._module = ctypes.c_void_p()
            self._image = ctypes.create_string_buffer(cubin, len(cubin))  # kept alive with the module
            _check_cu(drv.cuModuleLoadData(ctypes.byref(self._module), self._image), f"load {name}")
            self._func = ctypes.c_void_p()
            _check_cu(drv.cuModuleGetFunction(ctypes.byref(self._func), self._module, name.encode()), f"find {name}")
        self._shared_limit = DEFAULT_SHARED_BYTES

    def attribute(self, attribute: int) -> int:
        value = ctypes.c_int()
        _check_cu(_driver().cuFuncGetAttribute(ctypes.byref(value), attribute, self._func), "cuFuncGetAttribute")
        return value.value

    def launch(self, grid: tuple[int, int, int], block: int, shared_bytes: int, args: list, pdl: bool) -> None:
        """Launch on the device's current PyTorch stream. args: ctypes values in the kernel's
        parameter order. pdl: allow programmatic dependent launch (the kernel then begins with
        griddepcontrol.wait)."""
        if shared_bytes > self._shared_limit:
            _check_cu(_driver().cuFuncSetAttribute(self._func, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                                   shared_bytes), "raise the shared-memory limit")
            self._shared_limit = shared_bytes
        attr = _LaunchAttribute(id=CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION, value=1)
        config = _LaunchConfig(grid[0], grid[1], grid[2], block, 1, 1, shared_bytes,
                               ctypes.c_void_p(torch.cuda.current_stream(self.device).cuda_stream),
                               ctypes.pointer(attr) if pdl else None, 1 if pdl else 0)
        params = (ctypes.c_void_p * len(args))(*[ctypes.cast(ctypes.byref(a), ctypes.c_void_p) for a in args])
        _check_cu(_driver().cuLaunchKernelEx(ctypes.byref(config), self._func, params, None), f"launch {self.name}")
