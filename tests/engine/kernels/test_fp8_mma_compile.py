"""The FP8 small-M tensor-core kernel (engine/kernels/fp8_mma_gemv.cu) compiles for Hopper on CPU.

NVRTC comes with PyTorch's CUDA wheels and needs no GPU: every launch configuration the engine
can make (its table's "mma" entries and its heuristic at the Llama-3.1-8B and other shapes, each
scale mode, x dtype, bias and PDL setting) is compiled to an sm_90 cubin here, and its machine
code is read with the cuobjdump Triton ships: the codes widened by the hardware e4m3 conversion,
the products on the tensor cores, nothing spilled to local memory. The PTX shows what runs
before programmatic dependent launch's wait: the weight loads and nothing that reads x or
writes anything. The GPU tests (tests/gpu/test_fp8_mma_gpu.py) check the numbers.
"""

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from specdeploy.engine.kernels import fp8_mma, gemv, nvrtc

try:
    nvrtc.nvrtc_version()
except nvrtc.NvrtcError as exc:  # a CPU-only torch build: no NVRTC
    pytest.skip(str(exc), allow_module_level=True)

SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (4096, 12288), (3072, 4096)]


def _cuobjdump() -> str | None:
    try:
        import triton
    except ImportError:
        return shutil.which("cuobjdump")
    found = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    return str(found) if found.exists() else shutil.which("cuobjdump")


def _engine_launches() -> set[tuple]:
    """Every distinct set of macros the engine's mma launches compile to at these shapes."""
    seen = set()
    for n, k in SHAPES:
        for m in range(1, fp8_mma.MAX_M + 1):
            cfg = gemv.config_for("fp8", n, k, m, torch.device("cpu"), mma=True)
            if cfg[0] != "mma":
                continue
            _, block_n, block_k, split, warps, stages = cfg
            for mode in (1, 2):
                for x_f16 in (False, True):
                    for gdc in (False, True):
                        seen.add(fp8_mma.defines(block_n, block_k, min(split, 2), warps, stages, mode, x_f16, mode == 2, gdc))
    return seen


def test_every_engine_launch_compiles_to_tensor_core_code(tmp_path):
    launches = _engine_launches()
    assert len(launches) >= 8
    dump = _cuobjdump()
    for defs in sorted(launches):
        cubin = fp8_mma.cubin("sm_90", defs)
        assert cubin[:4] == b"\x7fELF"
        if dump is None:
            continue
        path = tmp_path / "k.cubin"
        path.write_bytes(cubin)
        sass = subprocess.run([dump, "-sass", str(path)], capture_output=True, text=True, check=True).stdout
        usage = subprocess.run([dump, "-res-usage", str(path)], capture_output=True, text=True, check=True).stdout
        d = dict(defs)
        assert "HMMA.16816.F32" in sass, defs
        assert "F2FP.F16.E4M3.UNPACK_B" in sass, defs  # one hardware conversion per two codes
        assert "LDL" not in sass and "STL" not in sass, defs
        assert re.search(r"STACK:0 SHARED:\d+ LOCAL:0", usage), usage
        regs = int(re.search(r"REG:(\d+)", usage).group(1))
        assert regs * 32 * d["WARPS"] <= 65536, (defs, regs)  # a CTA fits an SM's register file
        # per step: (TILES x 2 rows x CHUNKS) 16-byte weight loads a buffer; a lane's two loads
        # (rows g and g + 8) of a chunk are 4 mmas; two buffers unroll the loop twice
        streams = sass.count("LDG.E.NA.128.CONSTANT")
        loads_per_step = d["TILES"] * 2 * d["CHUNKS"]
        assert streams >= loads_per_step * (1 + d["PIPE"]), (defs, streams)
        assert sass.count("HMMA.16816.F32") >= 2 * loads_per_step * (1 + d["PIPE"]), defs


@pytest.mark.parametrize("early", [True, False])
def test_only_weight_loads_come_before_the_pdl_wait(monkeypatch, early):
    monkeypatch.setattr(fp8_mma, "EARLY_LOADS", early)
    defs = fp8_mma.defines(16, 256, 2, 8, 2, 1, False, True, True)
    ptx = nvrtc.compile_ptx(fp8_mma.source(), fp8_mma.KERNEL, "compute_90", defs)
    wait = ptx.index("griddepcontrol.wait")
    before = ptx[:wait]
    memory = [line.strip() for line in before.splitlines() if re.search(r"\b(ld|st|atom|red|cp)\.", line)
              and not line.strip().startswith("ld.param")]
    weights = [line for line in memory if "ld.global.nc.L1::no_allocate.v4.u32" in line]
    assert memory == weights  # no x, scale, bias, workspace or counter access before the wait
    assert len(weights) == (2 * 256 // 64 if early else 0)
    assert "griddepcontrol.launch_dependents" in ptx[wait:]
    no_pdl = nvrtc.compile_ptx(fp8_mma.source(), fp8_mma.KERNEL, "compute_90",
                               fp8_mma.defines(16, 256, 2, 8, 2, 1, False, True, False))
    assert "griddepcontrol" not in no_pdl


def test_ada_without_pdl_compiles():
    """sm_89 (L40S, RTX 6000 Ada) has the e4m3 conversion but no griddepcontrol: PDL is off there."""
    assert fp8_mma.cubin("sm_89", fp8_mma.defines(16, 256, 1, 8, 2, 1, False, False, False))[:4] == b"\x7fELF"


def test_configurations_and_layouts():
    assert fp8_mma.shared_bytes(1, 16, 256, 8) == 8 * ((264 * 2 + 2 * 4 + 15) // 16 * 16)
    assert fp8_mma.shared_bytes(8, 32, 512, 8) == 8 * ((8 * 520 * 2 + 8 * 4 * 4 + 15) // 16 * 16)
    assert fp8_mma.shared_bytes(1, 32, 128, 8) == 8 * 32 * 8 * 4  # the partial sums outgrow one row of x
    for bad in [(8, 256, 1, 8, 2), (16, 192, 1, 8, 2), (16, 256, 1, 3, 2), (16, 256, 1, 8, 3), (16, 256, 0, 8, 2)]:
        with pytest.raises(ValueError):
            fp8_mma.defines(*bad, 1, False, False, False)
    grid = torch.ones(4, 8)
    assert fp8_mma.scale_mode(grid, 128) == (1, 8, 1)
    assert fp8_mma.scale_mode(grid, 8) is None  # row blocks under one mma's 16 rows
    assert fp8_mma.scale_mode(torch.ones(64), 1) == (2, 1, 0)
    assert fp8_mma.scale_mode(torch.ones(1), 1) == (2, 0, 0)
    assert fp8_mma.scale_mode(grid.half(), 128) is None


def test_the_heuristic_keeps_two_ctas_per_sm():
    for n, k in SHAPES:
        for m in (1, 2, 3, 8):
            variant, block_n, block_k, split, warps, stages = gemv.heuristic_config("fp8", n, k, m, 132, mma=True)
            assert variant == "mma" and (block_n, stages) == ((16, 2) if m <= 2 else (32, 1))
            tiles = -(-n // block_n)
            assert tiles * split >= 2 * 132 or k // split < 2 * block_k * 2, (n, k, split)
    assert gemv.heuristic_config("fp8", 4096, 4096, 9, 132, mma=True)[0] != "mma"
