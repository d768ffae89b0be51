"""How long the server's boot-time library GEMM warm-up takes on the Llama-3.1-8B FP8 shapes.

    python3 bench/library_warmup.py --out RESULTS_DIR [--cache-dir DIR] [--max-m 8192]

engine/kernels/fp8.warm_library_gemms runs each distinct FP8 block-scaled linear once at every M
its route gives a library GEMM (DeepGEMM: 5 rows up), up to the prefill chunk, so that DeepGEMM's
JIT compiles its kernel configurations before traffic. Two passes in one process: the first
against the compile cache in --cache-dir (DG_JIT_CACHE_DIR; an empty folder: a pod's first
start), the second after it (what every later prefill finds). Each pass's seconds, calls and
compiles (first calls slower than fp8.COMPILE_CALL_S), written to library_warmup.json and
library_warmup.md in RESULTS_DIR.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import bootstrap_specdeploy  # noqa: E402

bootstrap_specdeploy()

import torch  # noqa: E402

from common import environment, log  # noqa: E402

TITLE = "Boot-time library GEMM warm-up: the Llama-3.1-8B FP8 linears at every prefill size"
COMMAND = "python3 bench/library_warmup.py --out OUT --cache-dir EMPTY_DIR"
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--cache-dir", type=Path, help="DG_JIT_CACHE_DIR for the run (default: as set)")
    parser.add_argument("--max-m", type=int, default=8192, help="the prefill chunk (default the plan's 8192)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        log("library_warmup: needs a CUDA device")
        return 2
    if args.cache_dir is not None:
        args.cache_dir.mkdir(parents=True, exist_ok=True)
        os.environ["DG_JIT_CACHE_DIR"] = str(args.cache_dir)  # read when deep_gemm is first imported
    import logging

    from specdeploy.engine.kernels import fp8 as kernels
    from specdeploy.engine.models import fp8

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    dev = torch.device("cuda")
    linears = []
    for n, k in SHAPES.values():
        codes, scale = fp8.quantize_fp8_block(torch.randn(n, k, device=dev) * 0.02, (128, 128))
        linears.append((codes, scale, 128, False))
    libraries = {o: kernels.library_available(o, dev, torch.bfloat16) for o in ("deep_gemm", "torch_block")}
    cached_before = sum(1 for _ in args.cache_dir.rglob("*.cubin")) if args.cache_dir else None
    passes: list = []
    result = {"script": "bench/library_warmup.py", "title": TITLE, "command": COMMAND,
              "environment": environment(), "shapes": SHAPES, "max_m": args.max_m, "libraries": libraries,
              "cache_dir": str(args.cache_dir) if args.cache_dir else os.environ.get("DG_JIT_CACHE_DIR"),
              "cached_kernels_before": cached_before, "passes": passes, "goals": {}}
    args.out.mkdir(parents=True, exist_ok=True)
    for label in ("first", "second"):
        t0 = time.monotonic()
        stats = kernels.warm_library_gemms(linears, args.max_m)
        passes.append({"pass": label, **stats, "wall_s": time.monotonic() - t0})
        log(f"{label} pass: {stats}")
        (args.out / "library_warmup.json").write_text(json.dumps(result, indent=1))  # each pass as it ends
    lines = [TITLE, "",
             f"Libraries here: {', '.join(o for o, ok in libraries.items() if ok) or 'none'}; compile cache "
             f"{result['cache_dir']} ({cached_before if cached_before is not None else '?'} cubins before). M up to "
             f"{args.max_m}, the four shapes {', '.join(f'{a} {n}x{k}' for a, (n, k) in SHAPES.items())}.", "",
             "| pass | seconds | calls | kernel compiles |", "|---|---|---|---|"]
    lines += [f"| {p['pass']} | {p['seconds']:.1f} | {p['calls']} | {p['compiles']} |" for p in passes]
    (args.out / "library_warmup.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
