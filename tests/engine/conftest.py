import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def _one_cpu_thread():
    # The tiny models run many small matmuls; on a shared, loaded machine intra-op threads spin
    # against each other and make them ~50x slower.
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


# Prepended to scripts run under Triton's CPU interpreter. The interpreter differs from the GPU
# in three bfloat16 details that the kernels rely on: tl.dot multiplies bf16 operands as their raw
# uint16 bit patterns (the GPU multiplies the values, exactly, and sums in fp32), so does a bf16
# product (the GPU rounds the values' product to nearest even), and a cast from fp32 to bf16
# truncates (the GPU rounds to nearest even, as torch does). All are patched to the GPU's
# behaviour so that bf16 results can be held to torch's roundings.
_INTERPRETER_BF16 = r"""
import numpy as np
import torch
import triton.language as tl
from triton.runtime import interpreter

def _bf16_values(h):
    data = np.ascontiguousarray(h.data).view(np.int16)
    f32 = torch.from_numpy(data.copy()).view(torch.bfloat16).float().numpy()
    return interpreter.TensorHandle(f32, tl.float32)

_dot = interpreter.InterpreterBuilder.create_dot
def _create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
    if a.dtype.scalar == tl.bfloat16:
        a, b = _bf16_values(a), _bf16_values(b)
    return _dot(self, a, b, d, input_precision, max_num_imprecise_acc)
interpreter.InterpreterBuilder.create_dot = _create_dot

_cast = interpreter.InterpreterBuilder.cast_impl
def _cast_impl(self, src, dst_type):
    if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
        f32 = np.ascontiguousarray(src.data, dtype=np.float32)
        bits = torch.from_numpy(f32.copy()).to(torch.bfloat16).view(torch.int16).numpy()
        return interpreter.TensorHandle(bits.view(np.uint16).reshape(np.shape(src.data)), tl.bfloat16)
    return _cast(self, src, dst_type)
interpreter.InterpreterBuilder.cast_impl = _cast_impl

def _bf16_bits(f32, shape):
    bits = torch.from_numpy(np.ascontiguousarray(f32, dtype=np.float32).copy()).to(torch.bfloat16)
    return interpreter.TensorHandle(bits.view(torch.int16).numpy().view(np.uint16).reshape(shape), tl.bfloat16)

_fmul = interpreter.InterpreterBuilder.create_fmul
def _create_fmul(self, lhs, rhs):
    if lhs.dtype.scalar == tl.bfloat16:
        a, b = _bf16_values(lhs).data, _bf16_values(rhs).data
        return _bf16_bits(a * b, np.shape(a * b))
    return _fmul(self, lhs, rhs)
interpreter.InterpreterBuilder.create_fmul = _create_fmul
"""


@pytest.fixture
def run_interpreted():
    """Run a Python script under Triton's CPU interpreter in a subprocess (the interpreter is
    chosen when Triton is first imported); fails with the script's stderr unless it prints ok."""
    import os
    import subprocess
    import sys

    def run(script: str) -> None:
        env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
        done = subprocess.run([sys.executable, "-P", "-c", _INTERPRETER_BF16 + script], env=env,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-2000:]
    return run
