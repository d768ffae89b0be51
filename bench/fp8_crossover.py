"""Where the FP8 linear should switch from the weight-only kernel to W8A8: both paths timed at
the Llama-3.1-8B layer shapes for M from 8 to 8192 rows (decode, verify and prefill chunks),
beside cuBLAS on the same weights in bf16.

    python3 bench/fp8_crossover.py --out DIR      # CUDA (compute capability >= 8.9), ~1 min

Weight-only (`w8a16`, the launch parameters `_decode_tiles` picks) streams e4m3 weights and
widens them to bf16; W8A8 quantizes the activations (`act_quant`, its own launch, counted) and
multiplies e4m3 by e4m3 on the tensor cores. engine/kernels/fp8.py's DECODE_MAX_M is the
switch; this prints, per shape, the smallest M where W8A8 wins, and W8A8's speed against bf16
at prefill sizes (goal: no slower than bf16 there). Writes fp8_crossover.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import bootstrap_specdeploy, cuda_time_ms, environment, log  # noqa: E402

bootstrap_specdeploy()

import torch  # noqa: E402

from specdeploy.engine.kernels import fp8 as kernels  # noqa: E402
from specdeploy.engine.models import fp8  # noqa: E402

LLAMA_8B_LINEARS = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
ROWS = (8, 16, 32, 48, 64, 96, 128, 256, 512, 2048, 8192)


def w8a8(x, codes, scale):
    """The prefill path of kernels.fp8_linear, whatever M is."""
    m, k = x.shape
    n = codes.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    a, a_s = kernels.act_quant(x)
    grid = (kernels.triton.cdiv(m, 128) * kernels.triton.cdiv(n, 128),)
    stride_sn, stride_sk = kernels._scale_strides(scale, 128)
    kernels._w8a8_kernel[grid](
        a, a_s, codes, scale, out, out, m, n, k, a.stride(0), a_s.stride(0), codes.stride(0), out.stride(0),
        stride_sn, stride_sk, SCALE_N=128, HAS_BIAS=False, BLOCK_M=128, BLOCK_N=128, BLOCK_K=kernels.GROUP_K,
        GROUP_M=8, num_warps=8, num_stages=3)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--reps", type=int, default=50)
    args = parser.parse_args()
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        log("fp8_crossover: needs a CUDA device of compute capability 8.9 or later")
        return 2
    dev = torch.device("cuda")
    result = {"environment": environment(), "decode_max_m": kernels.DECODE_MAX_M, "shapes": {}}
    for name, (n, k) in LLAMA_8B_LINEARS.items():
        w = torch.randn(n, k, device=dev) * 0.02
        codes, scale = fp8.quantize_fp8_block(w, (128, 128))
        w = w.to(torch.bfloat16)
        rows = []
        for m in ROWS:
            x = torch.randn(m, k, device=dev).to(torch.bfloat16)
            y = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
            tiles = kernels._decode_tiles(min(m, 64), n)
            weight_only = cuda_time_ms(lambda: kernels.w8a16(x, codes, scale, 128, None, y, *tiles),  # noqa: B023
                                       warmup=3, reps=args.reps)
            both = cuda_time_ms(lambda: w8a8(x, codes, scale), warmup=3, reps=args.reps)  # noqa: B023
            bf16 = cuda_time_ms(lambda: torch.nn.functional.linear(x, w), warmup=3, reps=args.reps)  # noqa: B023
            rows.append({"m": m, "w8a16_ms": weight_only, "w8a8_ms": both, "bf16_cublas_ms": bf16,
                         "w8a16_tiles": list(tiles)})
            log(f"{name:<8} M={m:<4} w8a16 {weight_only * 1e3:8.1f} us  w8a8 {both * 1e3:8.1f} us  "
                f"bf16 cuBLAS {bf16 * 1e3:8.1f} us")
        wins = [r["m"] for r in rows if r["w8a8_ms"] < r["w8a16_ms"]]
        result["shapes"][name] = {"n": n, "k": k, "rows": rows, "w8a8_wins_from_m": min(wins) if wins else None}
        log(f"{name:<8} W8A8 faster from M = {min(wins) if wins else 'never (<= 256)'}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "fp8_crossover.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
