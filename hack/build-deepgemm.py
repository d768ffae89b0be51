#!/usr/bin/env python3
"""Build DeepGEMM's extension (deep_gemm/_C) against the torch of the Python that runs this, in
place in a DeepGEMM source tree: csrc/, deep_gemm/, and its CUTLASS and fmt headers under
third-party/ (a `git clone --recursive` of github.com/deepseek-ai/DeepGEMM, or the bundle
hack/deepgemm-bundle.sh packs). For a machine whose torch no published wheel was built against.

    python3 hack/build-deepgemm.py SRC_DIR    # then PYTHONPATH=SRC_DIR imports deep_gemm

One translation unit, about 40 s on a 16-core host with nvcc 13.0 and g++ 13. It links libstdc++
dynamically: an extension that carries a static copy of it (as torch.utils.cpp_extension's
default link gave here, 2026-12-02) crashes in its first std::ostringstream (DeepGEMM's kernel
cache keys). DeepGEMM then JIT-compiles each kernel configuration with nvcc at first use (2-5 s
each), kept under DG_JIT_CACHE_DIR.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path


def main() -> int:
    if len(sys.argv) != 2:
        print(__doc__.splitlines()[5].strip(), file=sys.stderr)
        return 2
    import torch
    from torch.utils.cpp_extension import CUDA_HOME

    root = Path(sys.argv[1]).resolve()
    cutlass = root / "third-party" / "cutlass" / "include"
    if not (root / "csrc" / "python_api.cpp").is_file() or not cutlass.is_dir():
        print(f"build-deepgemm: {root} has no csrc/python_api.cpp or third-party/cutlass/include", file=sys.stderr)
        return 2
    if CUDA_HOME is None:
        print("build-deepgemm: no CUDA toolkit found (set CUDA_HOME)", file=sys.stderr)
        return 2
    include = root / "deep_gemm" / "include"
    for part in ("cute", "cutlass"):  # the JIT compiles against the package's own include folder
        if not (include / part).exists():
            shutil.copytree(cutlass / part, include / part)
    torch_dir = Path(torch.__file__).parent
    out = root / "deep_gemm" / ("_C" + sysconfig.get_config_var("EXT_SUFFIX"))
    cmd = ["c++", "-std=c++17", "-O2", "-fPIC", "-shared", "-Wno-psabi", "-Wno-deprecated-declarations",
           f"-D_GLIBCXX_USE_CXX11_ABI={int(torch.compiled_with_cxx11_abi())}", "-DTORCH_EXTENSION_NAME=_C",
           "-DTORCH_API_INCLUDE_EXTENSION_H", f"-I{CUDA_HOME}/include", f"-I{CUDA_HOME}/include/cccl",
           f"-I{torch_dir}/include", f"-I{torch_dir}/include/torch/csrc/api/include",
           f"-I{sysconfig.get_paths()['include']}", f"-I{include}", f"-I{cutlass}",
           f"-I{root}/third-party/fmt/include", str(root / "csrc" / "python_api.cpp"), "-o", str(out),
           f"-L{torch_dir}/lib", "-lc10", "-ltorch", "-ltorch_cpu", "-ltorch_python", "-lc10_cuda", "-ltorch_cuda",
           f"-L{CUDA_HOME}/lib64", "-lcudart", "-lnvrtc"]
    start = time.monotonic()
    print(f"build-deepgemm: building {out.name} against torch {torch.__version__} ({CUDA_HOME})", flush=True)
    if subprocess.run(cmd).returncode != 0:
        print("build-deepgemm: the compile failed (above)", file=sys.stderr)
        return 1
    print(f"build-deepgemm: built {out} in {time.monotonic() - start:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
