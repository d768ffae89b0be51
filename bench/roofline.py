"""Section 1: the ceilings. Copy bandwidth and matrix-product rate measured in this run; the bytes
a decode step must read (weights once, plus each request's KV prefix); the HBM-bound tok/s that
follows, per batch size:

    roofline tok/s(B) = B / ((weight bytes read + B * context * KV bytes per token) / bandwidth)

The compute floor (2 * matmul params * B FLOP over the measured rate) is shown beside it: at
these batch sizes decode stays memory-bound, which is why the bandwidth figure is the goal.
"""

from __future__ import annotations

from common import matmul_flops_per_s, param_bytes
from harness import kv_bytes_per_token, weight_bytes_read_per_step


def roofline_rows(target, bandwidth: float, flops: float | None, batches, context: int) -> list[dict]:
    w_read = weight_bytes_read_per_step(target)
    kvt = kv_bytes_per_token(target)
    elem = target.embed_tokens.weight.element_size()
    matmul_params = w_read // elem  # every weight read feeds a matrix product (norms: negligible)
    rows = []
    for b in batches:
        bytes_step = w_read + b * context * kvt + b * kvt  # + the new token's K/V written
        mem_s = bytes_step / bandwidth
        row = {"batch": b, "context": context, "bytes_per_step": bytes_step,
               "memory_floor_ms": mem_s * 1e3, "roofline_tok_s": b / mem_s}
        if flops:
            flop_s = 2 * matmul_params * b / flops
            row["compute_floor_ms"] = flop_s * 1e3
            row["bound"] = "memory" if mem_s >= flop_s else "compute"
            row["roofline_tok_s"] = b / max(mem_s, flop_s)
        rows.append(row)
    return rows


def run(ctx) -> dict:
    bandwidth = ctx.bandwidth()
    flops = matmul_flops_per_s(ctx["matmul_n"], ctx.device)
    target = ctx.target()
    rows = roofline_rows(target, bandwidth, flops, ctx["batches"], ctx["context"])
    w_all = param_bytes(target)
    w_read = weight_bytes_read_per_step(target)
    b1 = rows[0]
    summary = [f"copy {bandwidth / 1e12:.2f} TB/s", f"bf16 mm {flops / 1e12:.0f} TFLOP/s",
               f"weights {w_all / 1e9:.2f} GB (read/step {w_read / 1e9:.2f} GB)",
               f"roofline bs1 {b1['roofline_tok_s']:.0f} tok/s"]
    return {
        "copy_bandwidth_bytes_per_s": bandwidth,
        "matmul_flops_per_s": flops,
        "matmul_n": ctx["matmul_n"],
        "weight_bytes": w_all,
        "weight_bytes_read_per_step": w_read,
        "kv_bytes_per_token": kv_bytes_per_token(target),
        "num_params": sum(p.numel() for p in target.parameters()),
        "config": {k: v for k, v in target.cfg.raw.items() if not isinstance(v, dict)},
        "rows": rows,
        "summary": summary,
    }
