"""The prefill server's side: run a decode server's prompt, write its state into that server.

POST /disagg/prefill (protocol.PrefillBody), per request:
  1. check the peer pairs with this server (protocol.ServerInfo.mismatch) and the slots fit;
  2. submit the prompt with max_tokens 1 (the runner, role "prefill", prefills target and draft,
     samples the first token and holds the slots);
  3. export the held state into this server's metadata row, gather the prompt's target and draft
     KV rows of every layer into one region of this server's staging arena (runner.gather_held),
     then write that region into the decode server's staging region, and the metadata row into
     its row, with one batched Mooncake write (transfer.region_copies, MetadataBuffers.row_copies)
     in a worker thread. A side without an arena (--transfer-staging off, host pools) is written
     to or read from slot run by slot run (transfer.kv_copies);
  4. release the slots and answer 200 (or an error: 4xx for a request this server refuses,
     409 aborted, 503 busy, 502 transfer failed, 504 past the deadline).
POST /disagg/register {peer, regions}: a decode server's Mooncake session (at the caller's own
address) and the memory it registered (docs/disaggregation.md: the control plane). A prefill
request is refused unless its
peer's session was registered, from the same caller address, and every byte it would write falls
inside those regions: a request body cannot aim the transfer engine at another process or at
memory the decode server did not offer.
POST /disagg/abort {room}: stop that request (waiting for a transfer under way to end) and answer
only then, so the decode server may reuse its slots; a room aborted before its prefill arrived is
remembered and refused. No transfer starts after the request's deadline (received + timeout_s).
"""

from __future__ import annotations

import asyncio
import bisect
import collections
import ipaddress
import logging
import time
from dataclasses import dataclass

from specdeploy.engine.runtime.transfer import (
    MetadataBuffers,
    PoolLayout,
    StagingArena,
    StagingFull,
    TransferError,
    kv_copies,
    region_copies,
)
from specdeploy.engine.serving.disagg.protocol import AbortBody, PrefillBody, RegisterBody, ServerInfo
from specdeploy.engine.serving.scheduler import (
    SamplingParams,
    Scheduler,
    SchedulerError,
)

log = logging.getLogger("specdeploy.disagg.prefill")

# Rooms aborted before (or while) their prefill arrived, remembered so that a late prefill
# request for one is refused instead of writing into slots the decode server has reused.
_TOMBSTONES = 4096
# Decode servers remembered (the oldest registration is forgotten first; it registers again).
_MAX_SESSIONS = 1024


@dataclass(frozen=True)
class Session:
    """A registered decode server: who registered it, and where it may be written."""

    caller: str                       # the HTTP client address that registered it
    ranges: tuple[tuple[int, int], ...]  # [start, end) of each registered region, sorted

    def outside(self, addresses: list[int], lengths: list[int]) -> tuple[int, int] | None:
        """The first (address, length) not inside one registered region, or None."""
        starts = [start for start, _ in self.ranges]
        for address, length in zip(addresses, lengths):
            i = bisect.bisect_right(starts, address) - 1
            if i < 0 or address + length > self.ranges[i][1]:
                return address, length
        return None


class PrefillRefused(Exception):
    def __init__(self, status_code: int, message: str):
        super().__init__(message)
        self.status_code = status_code


class PrefillService:
    def __init__(self, scheduler: Scheduler, agent, info: ServerInfo, arena: StagingArena | None = None):
        self.scheduler, self.runner, self.agent, self.info = scheduler, scheduler.runner, agent, info
        self.arena = arena  # registered staging (transfer.py); None: send from the registered pools
        # Rooms are the decode server's names, kept per caller: one peer cannot abort another's.
        self._jobs: dict[tuple[str, str], asyncio.Task] = {}
        self._aborted: collections.OrderedDict[tuple[str, str], None] = collections.OrderedDict()
        self._sessions: collections.OrderedDict[str, Session] = collections.OrderedDict()
        self.bytes_sent = 0
        self.transfers = 0
        self.transfer_s = 0.0  # summed over transfers: bytes_sent / transfer_s is the bandwidth

    def register(self, body: RegisterBody, caller: str) -> dict:
        """POST /disagg/register; raises PrefillRefused."""
        peer = _peer_info(body.peer)
        if peer.role != "decode":
            raise PrefillRefused(400, f"only a decode server registers with a prefill server, not a {peer.role!r} one")
        why = self.info.mismatch(peer)
        if why is not None:
            raise PrefillRefused(400, f"the decode server does not pair with this prefill server: {why}")
        if not _same_host(peer.session_id.rpartition(":")[0], caller):
            raise PrefillRefused(403, f"Mooncake session {peer.session_id} is not at the caller's address {caller}: "
                                      "a decode server registers its own session (--transfer-host = its address)")
        ranges = tuple(sorted((r.address, r.address + r.bytes) for r in body.regions))
        if any(a[1] > b[0] for a, b in zip(ranges, ranges[1:])):
            raise PrefillRefused(400, "registered regions overlap")
        self._sessions.pop(peer.session_id, None)
        self._sessions[peer.session_id] = Session(caller, ranges)
        while len(self._sessions) > _MAX_SESSIONS:
            self._sessions.popitem(last=False)
        log.info("decode server %s registered Mooncake session %s (%d regions, %d bytes)", caller,
                 peer.session_id, len(ranges), sum(end - start for start, end in ranges))
        return {"session_id": peer.session_id, "regions": len(ranges)}

    async def prefill(self, body: PrefillBody, caller: str = "") -> dict:
        """The whole of one POST /disagg/prefill; raises PrefillRefused."""
        key = (caller, body.room)
        if key in self._aborted or key in self._jobs:
            raise PrefillRefused(409, f"room {body.room}: aborted or already in use")
        job = asyncio.ensure_future(self._run(body, time.monotonic() + body.timeout_s, caller))
        self._jobs[key] = job
        try:
            return await asyncio.shield(job)
        except asyncio.CancelledError:
            if job.cancelled():  # /disagg/abort
                raise PrefillRefused(409, f"room {body.room}: aborted") from None
            raise
        finally:
            if job.done():
                self._jobs.pop(key, None)

    async def abort(self, body: AbortBody, caller: str = "") -> dict:
        key = (caller, body.room)
        job = self._jobs.get(key)
        self._aborted[key] = None
        while len(self._aborted) > _TOMBSTONES:
            self._aborted.popitem(last=False)
        if job is None:
            return {"room": body.room, "aborted": False}
        job.cancel()
        await asyncio.wait({job})  # its cleanup (a transfer under way, the release) is over
        self._jobs.pop(key, None)
        log.info("room %s: aborted by the decode server; slots freed", body.room)
        return {"room": body.room, "aborted": True}

    async def _run(self, body: PrefillBody, deadline: float, caller: str) -> dict:
        peer = _peer_info(body.peer)
        why = self.info.mismatch(peer)
        if why is not None:
            raise PrefillRefused(400, f"the decode server does not pair with this prefill server: {why}")
        session = self._sessions.get(peer.session_id)
        if session is None:
            raise PrefillRefused(412, f"Mooncake session {peer.session_id} is not registered here "
                                      "(POST /disagg/register first)")
        if session.caller != caller:
            raise PrefillRefused(403, f"Mooncake session {peer.session_id} was registered from another address")
        if len(body.slots) != len(body.prompt_ids):
            raise PrefillRefused(400, f"{len(body.slots)} destination slots for {len(body.prompt_ids)} prompt tokens")
        if body.target_kv is None and body.staging is None:
            raise PrefillRefused(400, "the decode server gave neither its pools' layouts nor a staging region")
        if body.target_kv is not None and not self.runner.slot_row_pools:
            raise PrefillRefused(400, "this server's KV pools (DeepSeek-V4's) move only through a staging region")
        dst_target = PoolLayout.from_dict(body.target_kv) if body.target_kv else None
        dst_draft = PoolLayout.from_dict(body.draft_kv) if body.draft_kv else None
        if body.target_kv is not None and (dst_draft is None) != (self.runner.draft_kv is None):
            raise PrefillRefused(400, "the decode server's draft pool does not match this server's")
        vocab = self.runner.target.cfg.vocab_size
        if not all(0 <= t < vocab for t in body.prompt_ids):
            raise PrefillRefused(400, f"prompt token id outside [0, {vocab})")
        params = SamplingParams(max_tokens=1, temperature=body.temperature, top_p=body.top_p,
                                top_k=body.top_k, seed=body.seed, ignore_eos=True)
        try:
            handle = self.scheduler.submit(body.prompt_ids, params, "prefill")
        except SchedulerError as e:
            raise PrefillRefused(503 if e.status_code in (429, 503) else e.status_code, str(e)) from None
        req_id = handle.id
        t0 = time.monotonic()
        try:
            last = None
            async for delta in handle.deltas():
                last = delta
            if last.error is not None:
                raise PrefillRefused(last.error_status, f"prefill failed: {last.error}")
            if last.finish_reason == "abort":
                raise PrefillRefused(503, "the prefill server is shutting down")
            row, src_slots = await self.scheduler.run_in_engine(lambda: self.runner.export_held(req_id))
            if time.monotonic() > deadline:
                raise PrefillRefused(504, f"the prefill took longer than the request's {body.timeout_s:.0f} s")
            n = len(src_slots)
            layout = self.runner.staged_kv(n)
            if body.staging is not None and body.staging.get("bytes") != layout.nbytes:
                raise PrefillRefused(400, f"the decode server's staging region is {body.staging.get('bytes')} "
                                          f"bytes; {n} tokens of these pools take {layout.nbytes}")
            region = None
            try:
                if self.arena is not None:
                    try:
                        region = await self.arena.acquire(layout.nbytes, deadline)
                    except StagingFull as e:
                        raise PrefillRefused(503, f"the prefill server's transfer staging is full: {e}") from None
                    # Gathered between steps (the slots are held), into host memory. An abort waits
                    # for it too: the region is not given back while the engine thread writes it.
                    gather = asyncio.ensure_future(
                        self.scheduler.run_in_engine(lambda: self.runner.gather_held(req_id, region)))
                    try:
                        await asyncio.shield(gather)
                    except asyncio.CancelledError:
                        await asyncio.wait({gather})
                        raise
                copies = self._copies(layout, src_slots, region, body, dst_target, dst_draft, row)
                stray = session.outside(copies[1], copies[2])
                if stray is not None:
                    raise PrefillRefused(400, f"{stray[1]} bytes at {stray[0]:#x} are outside the memory the "
                                              "decode server registered")
                t1 = time.monotonic()
                # A transfer under way is not interrupted: an abort waits for it to end.
                write = asyncio.ensure_future(asyncio.to_thread(self.agent.write, peer.session_id, *copies))
                try:
                    sent = await asyncio.shield(write)
                except asyncio.CancelledError:
                    await asyncio.wait({write})
                    raise
                except (TransferError, ValueError) as e:
                    raise PrefillRefused(502, f"transfer to the decode server failed: {e}") from None
            finally:
                if region is not None:  # the write has ended, one way or the other
                    self.arena.release(region)
            transfer_s = time.monotonic() - t1
            self.bytes_sent += sent
            self.transfers += 1
            self.transfer_s += transfer_s
            return {"room": body.room, "prompt_tokens": len(body.prompt_ids), "bytes": sent,
                    "prefill_s": t1 - t0, "transfer_s": transfer_s}
        except asyncio.CancelledError:
            handle.abort()  # still prefilling: the scheduler frees whatever it took
            raise
        finally:
            await asyncio.shield(self.scheduler.run_in_engine(lambda: self._release(req_id)))

    def _metadata(self) -> MetadataBuffers:
        return self.runner.metadata

    def _copies(self, layout, src_slots, region, body: PrefillBody, dst_target, dst_draft, row: int):
        """(sources, destinations, lengths) of the whole request, for one batched write: the
        staged region whole when both sides stage, else per slot run and layer (kv_copies) from
        and to whichever side has pools or a region; then the metadata row."""
        n = len(src_slots)
        one_to_n = list(range(1, n + 1))
        try:
            if region is not None and body.staging is not None:
                copies = [region_copies(region.data_ptr(), body.staging["address"], layout.nbytes)]
            else:
                if region is not None:
                    sources, src_rows = layout.pool_layouts(region.data_ptr()), one_to_n
                else:
                    sources, src_rows = [PoolLayout.of(p) for p in self.runner.kv_pools()], src_slots
                if body.staging is not None:
                    dests, dst_rows = layout.pool_layouts(body.staging["address"]), one_to_n
                else:
                    dests, dst_rows = [dst_target, dst_draft][:len(sources)], body.slots
                copies = [kv_copies(s, src_rows, d, dst_rows) for s, d in zip(sources, dests, strict=True)]
            copies.append(self._metadata().row_copies(row, body.metadata))
        except (ValueError, KeyError) as e:
            raise PrefillRefused(400, f"the decode server's destination does not fit: {e}") from None
        return tuple(sum((list(c[i]) for c in copies), []) for i in range(3))

    def _release(self, req_id: str) -> None:
        if self.runner.is_held(req_id):
            self.runner.release_held(req_id)


def _same_host(host: str, caller: str) -> bool:
    """Whether a session's host is the caller's address (IPv6 in any spelling, brackets or not)."""
    try:
        return ipaddress.ip_address(host.strip("[]")) == ipaddress.ip_address(caller)
    except ValueError:
        return False


def _peer_info(data: dict) -> ServerInfo:
    try:
        return ServerInfo.from_dict(data)
    except (TypeError, KeyError, ValueError) as e:
        raise PrefillRefused(400, f"peer: not a server description ({type(e).__name__}: {e})") from None
