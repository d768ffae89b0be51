"""Prefill -> decode transfer through Mooncake's transfer engine, between two processes.

    python3 bench/disagg_transfer.py [--protocol tcp] [--out DIR]

A receiver process registers a KV pool shaped like Llama-3.1-8B's (32 layers, 8 KV heads x 128,
bf16: 2 KiB per layer per token for each of K and V) and the metadata row; the sender writes one
request's prompt KV into it exactly as a prefill server does (engine/runtime/transfer.py:
kv_copies over the slots, then the metadata row), for prompts of 128 to 8192 tokens, with the
destination slots contiguous (a fresh pool) and, for short prompts, scattered (a fragmented one:
every other slot, one write per slot per layer).
Prints, per case, the writes issued, bytes, median time and GB/s; writes disagg_transfer.json.
Host memory on both sides (the non-CUDA Mooncake build), so it runs on any machine.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import bootstrap_specdeploy  # noqa: E402

bootstrap_specdeploy()

import torch  # noqa: E402

LAYERS, SLOT_BYTES, SLOTS = 32, 8 * 128 * 2, 20000   # Llama-3.1-8B target pool, bf16
HIDDEN = 4096                                        # its metadata row (spec_hidden_size)
PROMPTS = (128, 512, 2048, 8192)
SCATTERED_PROMPTS = (128, 512)  # one write per slot per layer: slow over TCP, so only short prompts
REPS = 5


def pool() -> tuple[torch.Tensor, torch.Tensor]:
    k = torch.zeros(LAYERS, SLOTS, SLOT_BYTES, dtype=torch.uint8)
    return k, torch.zeros_like(k)


def receiver(protocol: str, queue, done) -> None:
    from specdeploy.engine.runtime.transfer import MooncakeAgent, PoolLayout

    agent = MooncakeAgent("127.0.0.1", protocol)
    k, v = pool()
    hidden = torch.zeros(HIDDEN, dtype=torch.bfloat16)
    for t in (k, v, hidden):
        agent.register(t)
    layout = PoolLayout(k.data_ptr(), v.data_ptr(), LAYERS, SLOTS, SLOT_BYTES)
    queue.put((agent.session_id, layout.to_dict(), hidden.data_ptr()))
    done.wait()
    agent.close()


def main() -> int:
    from specdeploy.engine.runtime.transfer import MooncakeAgent, PoolLayout, kv_copies

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--protocol", default="tcp", choices=("tcp", "rdma"))
    ap.add_argument("--out", default=".", help="directory for disagg_transfer.json")
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    queue, done = ctx.Queue(), ctx.Event()
    proc = ctx.Process(target=receiver, args=(args.protocol, queue, done), daemon=True)
    proc.start()
    session, dst_dict, dst_hidden = queue.get(timeout=120)
    dst = PoolLayout.from_dict(dst_dict)
    agent = MooncakeAgent("127.0.0.1", args.protocol)
    k, v = pool()
    k.random_(0, 255)
    v.random_(0, 255)
    hidden = torch.randn(HIDDEN).to(torch.bfloat16)
    for t in (k, v, hidden):
        agent.register(t)
    src = PoolLayout(k.data_ptr(), v.data_ptr(), LAYERS, SLOTS, SLOT_BYTES)
    rows = []
    for n in PROMPTS:
        for layout in ("contiguous", "scattered") if n in SCATTERED_PROMPTS else ("contiguous",):
            src_slots = list(range(1, n + 1))
            dst_slots = list(range(1, n + 1)) if layout == "contiguous" else list(range(1, 2 * n + 1, 2))
            srcs, dsts, lens = kv_copies(src, src_slots, dst, dst_slots)
            srcs.append(hidden.data_ptr())
            dsts.append(dst_hidden)
            lens.append(HIDDEN * 2)
            times = []
            for _ in range(REPS):
                t0 = time.perf_counter()
                moved = agent.write(session, srcs, dsts, lens)
                times.append(time.perf_counter() - t0)
            median = statistics.median(times)
            rows.append({"prompt_tokens": n, "slots": layout, "writes": len(srcs), "bytes": moved,
                         "median_s": median, "gb_per_s": moved / median / 1e9})
            print(f"{n:5d} tokens {layout:10s} {len(srcs):7d} writes {moved / 2**20:8.1f} MiB "
                  f"{median * 1e3:8.2f} ms {moved / median / 1e9:6.2f} GB/s", flush=True)
    done.set()
    proc.join(timeout=30)
    agent.close()
    out = Path(args.out) / "disagg_transfer.json"
    out.write_text(json.dumps({"protocol": args.protocol, "layers": LAYERS, "slot_bytes": SLOT_BYTES,
                               "rows": rows}, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
