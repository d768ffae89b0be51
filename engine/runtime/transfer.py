"""Moving one request's state from a prefill server's memory into a decode server's.

What moves, per request (docs/disaggregation.md):
    target KV   K and V of every layer, one slot row per prompt token:  2 x L_t x n x slot_bytes_t
    draft KV    the same for the draft pool (the draft's extend over the prompt wrote it)
    metadata    one row of the plan's metadata buffer (BufferPlan.metadata_hidden_states_shape,
                [max_running_requests, H_s]): the draft's carried hidden state after the first
                sampled token (H_s = spec_hidden_size; EAGLE-3 carries the target's hidden_size,
                which the plan's H_s is for an hc_mult 1 target) and the fixed fields
                (plan.METADATA_FIXED_FIELDS): the first token, how many prompt tokens the
                prefill server's prefix cache held (usage's cached_tokens), the first token's
                log-probability.

Staged (the default, `--transfer-staging auto|on`): each server registers one host staging arena
once, at start-up, sized from the plan (BufferPlan.transfer_staging_bytes). Per request the
prefill side gathers the prompt's target and draft rows of every layer into one contiguous region
of its arena (runner.gather_kv: a torch gather, on a GPU into pinned host memory), writes that
region into the region the decode side took in its own arena with one batched write
(region_copies: a few large entries), and the decode side scatters it into the request's slots on
activation (runner.activate). One write per request instead of one per slot run per layer: a
fragmented pool costs nothing more than a fresh one. On a GPU this is the only path (the pools
are device memory, which this Mooncake build does not register).

Direct (`--transfer-staging off`, host pools only): each side registers its KV pools; the prefill
side writes straight from its slots into the slots the decode side took (one-sided writes, as
SGLang's Mooncake connector does), one write per run of consecutive slots per layer (kv_copies).
A staged side pairs with a direct one: a region is addressed like a pool (StagedKV.pool_layouts).

The bytes go through Mooncake's transfer engine (`mooncake-transfer-engine`, the extra
`specdeploy[disagg]`); the metadata buffer, in host memory on every device, is registered once
on both sides. TCP is the transport on CPU and in CI; RDMA where the NICs are. The peer is named
by its session id (`host:rpc_port`, Mooncake's P2P handshake: no metadata server).

A pool's memory is `k, v [num_layers, num_slots, heads, head_dim]`, contiguous: the row of
(layer l, slot s) starts at `base + (l * num_slots + s) * slot_bytes`. `PoolLayout` is that
description as plain numbers (it travels in the prefill request); `kv_copies` is pure arithmetic.
A staged region of n tokens is, pool after pool, K [L, n + 1, slot_bytes] then V [L, n + 1,
slot_bytes], row j + 1 holding prompt position j (row 0 stands for the pad slot): each half is a
pool of n + 1 slots, the whole region one byte range (StagedKV). DeepSeek-V4's pools (rows
addressed through per-pool maps, engine/memory/compressed_kv.py) stage, pool after pool,
[L_pool, kept + 1, row_bytes]: only the rows the request still holds (a recent pool's last
`keep` positions, an entries pool's window closers: deepseek_v4.v4_kept_positions), and move
only as whole regions.
"""

from __future__ import annotations

import asyncio
import bisect
import os
import time
from dataclasses import asdict, dataclass

import torch

# Mooncake's protocol names: "tcp" works on any host; "rdma" needs RDMA NICs.
TRANSFER_PROTOCOLS = ("tcp", "rdma")
# Entries one batch_transfer_sync_write takes: 2048 pass and 4096 fail with the 0.3.13 build
# (bench/disagg_transfer.py); a fragmented pool needs 2 x layers x prompt tokens entries.
MAX_BATCH_ENTRIES = 2048
# A staged region is written in entries of at most this many bytes (Mooncake's TCP transport
# spreads the entries of one batch over its worker threads): entries of 1-16 MiB moved 3.65-3.82
# GB/s on the device host (bench/disagg_transfer.py, 2026-12-01, the per-slot rows of a fresh
# pool); the bench times the region as one entry beside it.
STAGED_PIECE_BYTES = 4 << 20


class TransferError(RuntimeError):
    """A transfer that did not complete (peer gone, unregistered memory, engine error)."""


@dataclass(frozen=True)
class PoolLayout:
    """Where a KV pool's rows live in one process: base addresses of K and V, and strides."""

    k: int
    v: int
    num_layers: int
    num_slots: int
    slot_bytes: int  # heads x head_dim x element size: one token of one layer

    @classmethod
    def of(cls, pool) -> PoolLayout:
        """Of a KVPool, or of a (k, v) pair of tensors shaped like one."""
        if isinstance(pool, tuple):
            pool = _Pair(*pool)
        k = pool.k
        if not (k.is_contiguous() and pool.v.is_contiguous()):
            raise ValueError("KV pools must be contiguous to be transferred")
        return cls(k.data_ptr(), pool.v.data_ptr(), k.shape[0], k.shape[1], k[0, 0].numel() * k.element_size())

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> PoolLayout:
        return cls(**{f: int(data[f]) for f in ("k", "v", "num_layers", "num_slots", "slot_bytes")})

    def shape(self) -> tuple[int, int]:
        """What must agree between the two sides (addresses and slot counts may differ)."""
        return self.num_layers, self.slot_bytes


@dataclass(frozen=True)
class _Pair:
    k: torch.Tensor
    v: torch.Tensor


def slot_runs(src_slots: list[int], dst_slots: list[int]) -> list[tuple[int, int, int]]:
    """(src_start, dst_start, count) runs covering the pairs src_slots[i] -> dst_slots[i]: pairs
    whose source and destination both advance by one are merged into one run."""
    if len(src_slots) != len(dst_slots):
        raise ValueError(f"{len(src_slots)} source slots for {len(dst_slots)} destination slots")
    runs: list[list[int]] = []
    for s, d in sorted(zip(src_slots, dst_slots)):
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1][2] += 1
        else:
            runs.append([s, d, 1])
    return [tuple(r) for r in runs]


def kv_copies(src: PoolLayout, src_slots: list[int], dst: PoolLayout,
              dst_slots: list[int]) -> tuple[list[int], list[int], list[int]]:
    """(source addresses, destination addresses, lengths) that copy K and V of every layer of
    src_slots in `src` to dst_slots in `dst`: 2 x num_layers x (number of runs) entries."""
    if src.shape() != dst.shape():
        raise ValueError(f"KV layouts differ: {src.num_layers} layers x {src.slot_bytes} bytes per slot "
                         f"here, {dst.num_layers} x {dst.slot_bytes} on the peer")
    for slots, layout, side in ((src_slots, src, "source"), (dst_slots, dst, "destination")):
        if slots and not all(0 < s < layout.num_slots for s in slots):
            raise ValueError(f"{side} slot outside [1, {layout.num_slots})")
    runs = slot_runs(src_slots, dst_slots)
    srcs, dsts, lens = [], [], []
    for base_src, base_dst in ((src.k, dst.k), (src.v, dst.v)):
        for layer in range(src.num_layers):
            for s, d, n in runs:
                srcs.append(base_src + (layer * src.num_slots + s) * src.slot_bytes)
                dsts.append(base_dst + (layer * dst.num_slots + d) * dst.slot_bytes)
                lens.append(n * src.slot_bytes)
    return srcs, dsts, lens


@dataclass(frozen=True)
class StagedKV:
    """Where one request's KV rows lie in a staging region (module docstring): `pieces`, each
    (layers, row_bytes, rows), one after the other, each [layers, rows + 1, row_bytes] with row 0
    unused. Pools with a row per token slot (KVPool) give two pieces per pool, K then V, of n rows
    each (`paired`: each half is addressed like a pool of n + 1 slots, StagedKV.pool_layouts);
    DeepSeek-V4's pools give one piece per pool of the rows it keeps (V4KV.staged_pieces)."""

    pieces: tuple[tuple[int, int, int], ...]
    paired: bool = True

    @classmethod
    def of(cls, pools: list[tuple[torch.Tensor, torch.Tensor]], n: int) -> StagedKV:
        """Of (k, v) pool tensors, each [layers, slots, ...], for n prompt tokens."""
        pieces = []
        for pair in pools:
            layers, slot_bytes = PoolLayout.of(pair).shape()
            pieces += [(layers, slot_bytes, n)] * 2
        return cls(tuple(pieces))

    @classmethod
    def of_pieces(cls, pieces: list[tuple[torch.Tensor, int]]) -> StagedKV:
        """Of (tensor [layers, rows, ...], rows staged) pieces: not addressable like pools."""
        return cls(tuple((t.shape[0], t[0, 0].numel() * t.element_size(), rows) for t, rows in pieces), paired=False)

    @staticmethod
    def _bytes(layers: int, row_bytes: int, rows: int) -> int:
        return layers * (rows + 1) * row_bytes

    @property
    def nbytes(self) -> int:
        return sum(self._bytes(*piece) for piece in self.pieces)

    def pool_layouts(self, address: int) -> list[PoolLayout]:
        """Each pool's K and V halves of a region at `address`, as pools of n + 1 slots (1..n used)."""
        if not self.paired:
            raise ValueError("these KV pools (DeepSeek-V4's) move only as whole staging regions: "
                             "both servers need --transfer-staging auto or on")
        out, offset = [], 0
        for (layers, slot_bytes, n), _ in zip(self.pieces[::2], self.pieces[1::2], strict=True):
            half = self._bytes(layers, slot_bytes, n)
            out.append(PoolLayout(address + offset, address + offset + half, layers, n + 1, slot_bytes))
            offset += 2 * half
        return out

    def views(self, region: torch.Tensor) -> list[torch.Tensor]:
        """uint8 views, each [layers, rows + 1, row_bytes], of a region tensor of >= nbytes."""
        if region.dtype != torch.uint8 or region.dim() != 1 or region.numel() < self.nbytes:
            raise ValueError(f"a staging region must be a 1-d uint8 tensor of >= {self.nbytes} bytes")
        out, offset = [], 0
        for layers, row_bytes, rows in self.pieces:
            size = self._bytes(layers, row_bytes, rows)
            out.append(region[offset:offset + size].view(layers, rows + 1, row_bytes))
            offset += size
        return out


def _word(slot_bytes: int) -> torch.dtype:
    """The widest integer dtype a slot row divides into: row copies by 8-byte words run ~10x
    faster than by bytes on CPU (index_put of uint8 rows is element by element)."""
    return next(dt for dt, size in ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2), (torch.uint8, 1))
                if slot_bytes % size == 0)


def _rows(t: torch.Tensor, word: torch.dtype) -> torch.Tensor:
    """A pool tensor [layers, slots, ...] as [layers, slots, slot_bytes / word size] (any KV dtype)."""
    return t.view(torch.uint8).view(t.shape[0], t.shape[1], -1).view(word)


def pool_pieces(pools: list[tuple[torch.Tensor, torch.Tensor]], index: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(tensor, rows) pieces of (k, v) pools addressed by the slots `index`, in StagedKV.of's order."""
    return [(t, index) for pair in pools for t in pair]


def _piece_rows(pieces: list[tuple[torch.Tensor, torch.Tensor]], region: torch.Tensor):
    """(rows [layers, R, words], staged [layers, k + 1, words], index [k]) of each non-empty
    (tensor, index) piece and its part of the region (StagedKV.of_pieces' layout), as words of
    the widest integer type a row divides into."""
    staged = StagedKV.of_pieces([(t, index.numel()) for t, index in pieces])
    for (t, index), host in zip(pieces, staged.views(region), strict=True):
        if index.numel():
            word = _word(host.shape[-1])
            yield _rows(t, word), host.view(word), index


def gather_pieces(pieces: list[tuple[torch.Tensor, torch.Tensor]], region: torch.Tensor) -> None:
    """Pack the rows `index` (on the tensors' device) of every (tensor [layers, rows, ...], index)
    piece into a host staging region laid out as StagedKV.of_pieces' (row j + 1 of a piece is
    index[j]); returns when the bytes are in host memory. Layer by layer: on a GPU the temporary
    is one layer's rows, copied to pinned memory."""
    device = pieces[0][0].device
    for rows, host, index in _piece_rows(pieces, region):
        for layer in range(rows.shape[0]):
            if device.type == "cpu":
                torch.index_select(rows[layer], 0, index, out=host[layer, 1:])
            else:
                host[layer, 1:].copy_(rows[layer].index_select(0, index), non_blocking=True)
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def scatter_pieces(pieces: list[tuple[torch.Tensor, torch.Tensor]], region: torch.Tensor) -> None:
    """The inverse of gather_pieces: the region's rows into the rows `index` of every piece;
    returns when the region may be reused."""
    device = pieces[0][0].device
    for rows, host, index in _piece_rows(pieces, region):
        for layer in range(rows.shape[0]):
            rows[layer, index] = host[layer, 1:].to(device, non_blocking=True)
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def gather_rows(pools: list[tuple[torch.Tensor, torch.Tensor]], index: torch.Tensor, region: torch.Tensor) -> None:
    """gather_pieces over (k, v) pools addressed by slots (StagedKV.of's layout)."""
    gather_pieces(pool_pieces(pools, index), region)


def scatter_rows(pools: list[tuple[torch.Tensor, torch.Tensor]], index: torch.Tensor, region: torch.Tensor) -> None:
    """scatter_pieces over (k, v) pools addressed by slots."""
    scatter_pieces(pool_pieces(pools, index), region)


def region_copies(src: int, dst: int, nbytes: int,
                  piece_bytes: int = STAGED_PIECE_BYTES) -> tuple[list[int], list[int], list[int]]:
    """One contiguous region to another, in entries of at most piece_bytes."""
    if nbytes <= 0 or piece_bytes <= 0:
        raise ValueError(f"region of {nbytes} bytes in pieces of {piece_bytes}")
    starts = range(0, nbytes, piece_bytes)
    return ([src + o for o in starts], [dst + o for o in starts],
            [min(piece_bytes, nbytes - o) for o in starts])


class StagingFull(Exception):
    """No region of the asked size became free before the deadline."""


class StagingArena:
    """Host memory for staged KV transfers, allocated and registered once (pinned on a GPU):
    requests take aligned regions first fit and give them back. Used from one event loop only:
    `acquire` waits there (until its deadline) for a region to be released."""

    def __init__(self, nbytes: int, pin: bool = False):
        from specdeploy.engine.planner.plan import TRANSFER_STAGING_ALIGN_BYTES

        if nbytes <= 0:
            raise ValueError(f"staging arena of {nbytes} bytes")
        self.align = TRANSFER_STAGING_ALIGN_BYTES
        nbytes = -(-nbytes // self.align) * self.align  # whole regions: one of nbytes always fits
        self.buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
        self.nbytes = nbytes
        self._free: list[tuple[int, int]] = [(0, nbytes)]   # (offset, size), sorted by offset
        self._taken: dict[int, int] = {}                     # offset -> size
        self._released: asyncio.Event | None = None

    @property
    def free_bytes(self) -> int:
        return sum(size for _, size in self._free)

    def alloc(self, nbytes: int) -> torch.Tensor | None:
        """A region of >= nbytes (a view of the arena), or None while none is free."""
        size = -(-max(nbytes, 1) // self.align) * self.align
        if size > self.nbytes:
            raise ValueError(f"a staged request of {nbytes} bytes does not fit the {self.nbytes}-byte arena")
        for i, (offset, free) in enumerate(self._free):
            if free >= size:
                if free == size:
                    del self._free[i]
                else:
                    self._free[i] = (offset + size, free - size)
                self._taken[offset] = size
                return self.buffer[offset:offset + size]
        return None

    def release(self, region: torch.Tensor) -> None:
        offset = region.data_ptr() - self.buffer.data_ptr()
        size = self._taken.pop(offset)
        i = bisect.bisect(self._free, (offset, size))
        self._free.insert(i, (offset, size))
        # Merge with the neighbours.
        if i + 1 < len(self._free) and offset + size == self._free[i + 1][0]:
            size += self._free.pop(i + 1)[1]
            self._free[i] = (offset, size)
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == offset:
            prev = self._free.pop(i - 1)
            self._free[i - 1] = (prev[0], prev[1] + size)
        if self._released is not None:
            self._released.set()

    async def acquire(self, nbytes: int, deadline: float) -> torch.Tensor:
        """alloc, waiting for releases until `deadline` (time.monotonic()); raises StagingFull."""
        while True:
            region = self.alloc(nbytes)
            if region is not None:
                return region
            left = deadline - time.monotonic()
            if left <= 0:
                raise StagingFull(f"no {nbytes}-byte staging region free ({self.free_bytes} of "
                                  f"{self.nbytes} bytes free, fragmented or in use)")
            if self._released is None:
                self._released = asyncio.Event()
            self._released.clear()
            try:
                await asyncio.wait_for(self._released.wait(), left)
            except asyncio.TimeoutError:
                pass


# The metadata buffer's fields: (name, dtype). The hidden state's width and the row count come
# from the plan; these are plan.METADATA_FIXED_FIELDS as tensors (checked in MetadataBuffers).
_FIXED_DTYPES = {"output_token_id": torch.int64, "cached_tokens": torch.int64,
                 "output_token_logprob": torch.float32}


class MetadataBuffers:
    """The plan's disaggregation metadata buffer: per request row r,
    hidden [R, H_s] (the draft's carried state after the first token), output_token_id [R],
    cached_tokens [R] (the prefill's prefix-cache hit), output_token_logprob [R].
    R = max_running_requests; the decode side's row r is its request's slot-table row."""

    def __init__(self, buffers, dtype: torch.dtype, device: torch.device | str, pin: bool = False):
        from specdeploy.engine.planner.plan import METADATA_FIXED_FIELDS

        rows, width = buffers.metadata_hidden_states_shape
        planned = {name: size for name, size, count in METADATA_FIXED_FIELDS}
        if set(planned) != set(_FIXED_DTYPES):
            raise ValueError(f"the plan's metadata fields {sorted(planned)} are not the engine's "
                             f"{sorted(_FIXED_DTYPES)}")
        fixed = sum(torch.tensor([], dtype=dt).element_size() for dt in _FIXED_DTYPES.values())
        if fixed != buffers.metadata_fixed_fields_bytes_per_request:
            raise ValueError(f"metadata fixed fields: {fixed} bytes per request here, the plan says "
                             f"{buffers.metadata_fixed_fields_bytes_per_request}")
        self.hidden = torch.zeros(rows, width, dtype=dtype, device=device, pin_memory=pin)
        if self.hidden[0].numel() * self.hidden.element_size() != buffers.metadata_hidden_states_bytes_per_request:
            raise ValueError(f"metadata hidden row: {width} x {self.hidden.element_size()} bytes here, the plan "
                             f"says {buffers.metadata_hidden_states_bytes_per_request} bytes")
        self.fixed = {name: torch.zeros(rows, dtype=dt, device=device, pin_memory=pin)
                      for name, dt in _FIXED_DTYPES.items()}

    @property
    def tensors(self) -> list[torch.Tensor]:
        return [self.hidden, *self.fixed.values()]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)

    def row_addresses(self, row: int) -> dict[str, int]:
        """Address of each field's row `row` (what the decode side sends the prefill side)."""
        out = {"hidden": self.hidden[row].data_ptr()}
        out.update({name: t[row].data_ptr() for name, t in self.fixed.items()})
        return out

    def row_values(self, row: int) -> dict[str, torch.Tensor]:
        """Row `row` of every field, copied (what rank 0 hands the other tensor-parallel ranks)."""
        return {"hidden": self.hidden[row].clone(), **{name: t[row].clone() for name, t in self.fixed.items()}}

    def set_row_values(self, row: int, values: dict[str, torch.Tensor]) -> None:
        self.hidden[row] = values["hidden"]
        for name, t in self.fixed.items():
            t[row] = values[name]

    def row_copies(self, row: int, dst: dict[str, int]) -> tuple[list[int], list[int], list[int]]:
        """Copies of this side's row `row` to the peer's row addresses `dst`."""
        src = self.row_addresses(row)
        if set(dst) != set(src):
            raise ValueError(f"metadata fields differ: {sorted(src)} here, {sorted(dst)} on the peer")
        lens = {"hidden": self.hidden[row].numel() * self.hidden.element_size()}
        lens.update({name: t.element_size() for name, t in self.fixed.items()})
        names = sorted(src)
        return [src[n] for n in names], [int(dst[n]) for n in names], [lens[n] for n in names]


class MooncakeAgent:
    """One process's Mooncake transfer engine: registered memory and one-sided writes.

    hostname: the address peers reach this process at (the pod IP in a cluster).
    """

    def __init__(self, hostname: str, protocol: str = "tcp", device_name: str = ""):
        if protocol not in TRANSFER_PROTOCOLS:
            raise ValueError(f"transfer protocol {protocol!r}: use one of {', '.join(TRANSFER_PROTOCOLS)}")
        # Mooncake logs through glog; INFO lines per connection would flood the engine's log.
        os.environ.setdefault("GLOG_minloglevel", "1")
        try:
            from mooncake.engine import TransferEngine
        except ImportError as e:
            raise RuntimeError("prefill/decode roles need Mooncake's transfer engine: "
                               "pip install 'specdeploy[disagg]' (and libibverbs1 on Debian)") from e
        self._engine = TransferEngine()
        # P2PHANDSHAKE: peers exchange segment descriptors directly, no etcd/metadata server.
        if self._engine.initialize(hostname, "P2PHANDSHAKE", protocol, device_name) != 0:
            raise RuntimeError(f"Mooncake transfer engine failed to start on {hostname} ({protocol})")
        self.protocol = protocol
        self.session_id = f"{hostname}:{self._engine.get_rpc_port()}"
        self._registered: list[torch.Tensor] = []

    def register(self, tensor: torch.Tensor) -> None:
        """Make a tensor's memory readable/writable by peers (kept alive by this agent)."""
        if tensor.device.type != "cpu":
            raise ValueError("the non-CUDA Mooncake build registers host memory only")
        nbytes = tensor.numel() * tensor.element_size()
        if self._engine.register_memory(tensor.data_ptr(), nbytes) != 0:
            raise RuntimeError(f"Mooncake could not register {nbytes} bytes")
        self._registered.append(tensor)

    def regions(self) -> list[tuple[int, int]]:
        """(address, bytes) of every tensor registered here: all a peer may write into."""
        return [(t.data_ptr(), t.numel() * t.element_size()) for t in self._registered]

    def write(self, session_id: str, srcs: list[int], dsts: list[int], lens: list[int]) -> int:
        """Write local srcs to the peer's dsts (blocking); -> bytes written."""
        for i in range(0, len(srcs), MAX_BATCH_ENTRIES):
            j = i + MAX_BATCH_ENTRIES
            if self._engine.batch_transfer_sync_write(session_id, srcs[i:j], dsts[i:j], lens[i:j]) != 0:
                raise TransferError(f"transfer of {sum(lens[i:j])} bytes to {session_id} failed")
        return sum(lens)

    def unregister(self, tensor: torch.Tensor) -> None:
        self._engine.unregister_memory(tensor.data_ptr())
        self._registered = [t for t in self._registered if t is not tensor]

    def close(self) -> None:
        for tensor in self._registered:
            self._engine.unregister_memory(tensor.data_ptr())
        self._registered.clear()
