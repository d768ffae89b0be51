"""A patch prepended to scripts that run the FP8 kernels under Triton's CPU interpreter (after
tests/engine/conftest.py's bf16 patches): the float32 -> e4m3 cast rounded as the GPU rounds."""

FP8_CAST = r"""
import numpy as np
import torch
import triton.language as tl
from triton.runtime import interpreter

# The interpreter truncates float32 -> e4m3; the GPU (cvt.rn.satfinite) rounds to nearest even,
# as torch does. Patched like the bf16 cast in conftest.py.
_fp_to_fp = interpreter.InterpreterBuilder.create_fp_to_fp
def _create_fp_to_fp(self, src, dst_type, rounding_mode):
    if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.float8e4nv:
        f32 = np.ascontiguousarray(src.data, dtype=np.float32)
        codes = torch.from_numpy(f32.copy()).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
        return interpreter.TensorHandle(codes.reshape(np.shape(src.data)), tl.float8e4nv)
    return _fp_to_fp(self, src, dst_type, rounding_mode)
interpreter.InterpreterBuilder.create_fp_to_fp = _create_fp_to_fp
"""

