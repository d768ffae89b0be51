"""Prefill -> decode transfer through Mooncake's transfer engine, between two processes: the
batched (staged) path against the per-slot one.

    python3 bench/disagg_transfer.py [--protocol tcp] [--out DIR]     # ~2 min on a GPU host

A receiver process holds KV pools shaped like Llama-3.1-8B + EAGLE-3's (target 32 layers, draft
1 layer, 8 KV heads x 128, bf16: 2 KiB per layer per token for each of K and V) and the
metadata row; the sender moves one request's prompt KV into it as a prefill server does, for
prompts of 128 to 8192 tokens:

  per-slot   host pools registered on both sides, one write per run of consecutive slots per
             layer (engine/runtime/transfer.py: kv_copies), into contiguous destination slots
             (a fresh pool: 2 x 33 writes) and, for short prompts, scattered ones (a fragmented
             pool: every other slot, one write per slot per layer);
  staged     what the servers do (the default): the sender gathers the prompt's rows of every
             layer of both pools into one region of its registered staging arena (gather_rows),
             one batched write moves the region (STAGED_PIECE_BYTES entries) and the metadata row
             into the receiver's arena, and the receiver scatters the region into its slots
             (scatter_rows; destination slots scattered: it costs the same as contiguous). On a
             GPU the pools are in GPU memory and the arenas pinned: gather and scatter include
             the device copies. Also the write alone with the region as one entry, and as
             WRITERS batches submitted at once from threads.

Each staged case is checked: the receiver's destination rows must equal the sender's source rows.
Prints, per case, writes, bytes, median gather / write / scatter / total ms and GB/s (bytes over
the total); writes disagg_transfer.json.
"""

from __future__ import annotations

import argparse
import concurrent.futures
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

POOL_LAYERS = (32, 1)                             # Llama-3.1-8B target, its EAGLE-3 draft
SLOT_BYTES, SLOTS = 8 * 128 * 2, 20000            # bf16 KV heads x head_dim; slots per pool
HIDDEN = 4096                                     # the metadata row (spec_hidden_size)
PROMPTS = (128, 512, 2048, 8192)
SCATTERED_PROMPTS = (128, 512)  # per-slot with one write per slot per layer: slow, short prompts only
REPS = 5
WRITERS = 4  # concurrent batch writes of one region (a variant the servers do not use: measured)


def pools(device: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [tuple(torch.zeros(layers, SLOTS, SLOT_BYTES, dtype=torch.uint8, device=device) for _ in "kv")
            for layers in POOL_LAYERS]


def checksum(kv: list[tuple[torch.Tensor, torch.Tensor]], slots: list[int]) -> list[int]:
    idx = torch.tensor(slots, device=kv[0][0].device)
    return [int(t[:, idx].sum(dtype=torch.int64)) for pair in kv for t in pair]


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def arena_bytes() -> int:
    from specdeploy.engine.planner.plan import transfer_staging_request_bytes

    return transfer_staging_request_bytes(max(PROMPTS), 2 * sum(POOL_LAYERS) * SLOT_BYTES)


def receiver(protocol: str, device: str, requests, replies) -> None:
    """Registers its host pools, metadata row and staging arena; then scatters on request."""
    from specdeploy.engine.runtime.transfer import MooncakeAgent, PoolLayout, StagingArena, scatter_rows

    agent = MooncakeAgent("127.0.0.1", protocol)
    host = pools("cpu")
    hidden = torch.zeros(HIDDEN, dtype=torch.bfloat16)
    arena = StagingArena(arena_bytes(), pin=device == "cuda")
    region = arena.alloc(arena.nbytes)
    for pair in host:
        for t in pair:
            agent.register(t)
    agent.register(hidden)
    agent.register(arena.buffer)
    dev = pools(device) if device != "cpu" else host
    replies.put((agent.session_id, [PoolLayout.of(p).to_dict() for p in host], hidden.data_ptr(), region.data_ptr()))
    while (msg := requests.get()) is not None:
        kind, slots = msg
        if kind == "scatter":  # the region holds len(slots) tokens' rows: into `slots` of the device pools
            sync(device)
            t0 = time.perf_counter()
            scatter_rows(dev, torch.tensor(slots, device=device), region)
            replies.put(time.perf_counter() - t0)
        else:  # "checksum" of the device pools' (staged) or host pools' (per-slot) rows
            replies.put(checksum(dev if kind == "checksum-staged" else host, slots))
    agent.close()


def main() -> int:
    from specdeploy.engine.runtime.transfer import (
        STAGED_PIECE_BYTES,
        MooncakeAgent,
        PoolLayout,
        StagedKV,
        StagingArena,
        TransferError,
        gather_rows,
        kv_copies,
        region_copies,
    )

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--protocol", default="tcp", choices=("tcp", "rdma"))
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                    help="where the staged path's pools live (auto: a GPU if there is one)")
    ap.add_argument("--out", default=".", help="directory for disagg_transfer.json")
    args = ap.parse_args()
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    ctx = mp.get_context("spawn")
    requests, replies = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=receiver, args=(args.protocol, device, requests, replies), daemon=True)
    proc.start()
    session, dst_dicts, dst_hidden, dst_region = replies.get(timeout=300)
    dst_pools = [PoolLayout.from_dict(d) for d in dst_dicts]
    agent = MooncakeAgent("127.0.0.1", args.protocol)
    host = pools("cpu")
    g = torch.Generator().manual_seed(0)
    for pair in host:
        for t in pair:
            t.copy_(torch.randint(0, 255, t.shape, generator=g, dtype=torch.uint8))
            agent.register(t)
    dev = [tuple(t.to(device) for t in pair) for pair in host] if device != "cpu" else host
    hidden = torch.randn(HIDDEN, generator=g).to(torch.bfloat16)
    agent.register(hidden)
    arena = StagingArena(arena_bytes(), pin=device == "cuda")
    region = arena.alloc(arena.nbytes)
    agent.register(arena.buffer)
    src_pools = [PoolLayout.of(p) for p in host]
    meta = ([hidden.data_ptr()], [dst_hidden], [HIDDEN * 2])
    rows = []
    pool = concurrent.futures.ThreadPoolExecutor(WRITERS)

    def report(row: dict) -> None:
        row["gb_per_s"] = row["bytes"] / (row["total_ms"] / 1e3) / 1e9
        rows.append(row)
        parts = " ".join(f"{k.removesuffix('_ms')} {row[k]:8.2f}" for k in ("gather_ms", "write_ms", "scatter_ms")
                         if row.get(k) is not None)
        print(f"{row['prompt_tokens']:5d} tokens {row['path']:18s} {row['slots']:10s} {row['writes']:6d} writes "
              f"{row['bytes'] / 2**20:7.1f} MiB | {parts} | total {row['total_ms']:8.2f} ms "
              f"{row['gb_per_s']:6.2f} GB/s", flush=True)

    for n in PROMPTS:
        src_slots = list(range(1, n + 1))
        scattered = list(range(1, 2 * n + 1, 2))
        # ---- per-slot: slot runs per layer between the registered host pools
        for layout in ("contiguous", "scattered") if n in SCATTERED_PROMPTS else ("contiguous",):
            dst_slots = src_slots if layout == "contiguous" else scattered
            copies = [kv_copies(s, src_slots, d, dst_slots) for s, d in zip(src_pools, dst_pools)] + [meta]
            srcs, dsts, lens = (sum((c[i] for c in copies), []) for i in range(3))
            times = []
            try:
                for _ in range(REPS if layout == "contiguous" else 3):
                    t0 = time.perf_counter()
                    moved = agent.write(session, srcs, dsts, lens)
                    times.append(time.perf_counter() - t0)
            except TransferError as e:  # recorded, not fatal: the staged rows are what the servers run
                print(f"{n:5d} tokens per-slot {layout}: {len(srcs)} writes FAILED: {e}", flush=True)
                rows.append({"prompt_tokens": n, "path": "per-slot", "slots": layout, "writes": len(srcs),
                             "failed": str(e)})
                continue
            requests.put(("checksum-host", dst_slots))
            if replies.get(timeout=300) != checksum(host, src_slots):
                raise AssertionError(f"per-slot {layout} {n} tokens: the receiver's rows differ")
            write = 1e3 * statistics.median(times)
            report({"prompt_tokens": n, "path": "per-slot", "slots": layout, "device": "cpu", "writes": len(srcs),
                    "bytes": moved, "write_ms": write, "total_ms": write})
        # ---- staged: gather into the arena, one batched write, scatter on the receiver
        staged = StagedKV.of(dev, n)
        index = torch.tensor(src_slots, device=device)
        for pieces in ("pieces", "one entry", "writers") if n >= 2048 else ("pieces",):
            piece = STAGED_PIECE_BYTES if pieces != "one entry" else staged.nbytes
            kv = region_copies(region.data_ptr(), dst_region, staged.nbytes, piece)
            srcs, dsts, lens = (kv[i] + meta[i] for i in range(3))
            # "writers": the same entries as WRITERS batches submitted at once from threads.
            parts = [(srcs[i::WRITERS], dsts[i::WRITERS], lens[i::WRITERS]) for i in range(WRITERS)]
            gathers, writes, scatters = [], [], []
            for _ in range(REPS):
                sync(device)
                t0 = time.perf_counter()
                gather_rows(dev, index, region)
                t1 = time.perf_counter()
                if pieces == "writers":
                    moved = sum(pool.map(lambda p: agent.write(session, *p), parts))
                else:
                    moved = agent.write(session, srcs, dsts, lens)
                t2 = time.perf_counter()
                requests.put(("scatter", scattered))
                scatters.append(replies.get(timeout=300))
                gathers.append(t1 - t0)
                writes.append(t2 - t1)
            requests.put(("checksum-staged", scattered))
            if replies.get(timeout=300) != checksum(dev, src_slots):
                raise AssertionError(f"staged {n} tokens: the receiver's rows differ")
            gather, write, scatter = (1e3 * statistics.median(x) for x in (gathers, writes, scatters))
            if pieces == "pieces":
                report({"prompt_tokens": n, "path": "staged", "slots": "scattered", "device": device,
                        "writes": len(srcs), "bytes": moved, "gather_ms": gather, "write_ms": write,
                        "scatter_ms": scatter, "total_ms": gather + write + scatter, "piece_bytes": piece})
            else:
                report({"prompt_tokens": n, "path": f"staged, {pieces if pieces == 'one entry' else f'{WRITERS} writers'}",
                        "slots": "scattered", "device": device, "writes": len(srcs), "bytes": moved,
                        "write_ms": write, "total_ms": write, "piece_bytes": piece})
    requests.put(None)
    proc.join(timeout=60)
    agent.close()
    out = Path(args.out) / "disagg_transfer.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"protocol": args.protocol, "device": device, "pool_layers": POOL_LAYERS,
                               "slot_bytes": SLOT_BYTES, "staged_piece_bytes": STAGED_PIECE_BYTES,
                               "rows": rows}, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
