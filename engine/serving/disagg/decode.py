"""The decode server's side: have a prefill server fill a received request's slots, then run it.

The scheduler admits a request that names a prefill server with `runner.receive` (its prompt's
KV slots and its metadata row taken) and calls `start` on the event loop. The exchange:
  1. handshake, once per prefill server: GET /disagg/info, refused unless the two pair
     (protocol.ServerInfo.mismatch), then POST /disagg/register with this server's Mooncake
     session and the memory its transfer engine registered (the only memory the prefill server
     will write into; a 412 later says it forgot, and the handshake runs again); every call
     carries the split roles' shared secret (serving/auth.py);
  2. take a region of this server's staging arena for the request's KV (waiting, until the
     deadline, while the arena is full), then POST /disagg/prefill with the prompt, the sampling
     parameters (the prefill server samples the first token), a deadline, and where to write:
     the staging region (or, without an arena, the slots and both pools' layouts), the metadata
     row's addresses;
  3. on 200 the KV and the metadata row are here: `scheduler.activate_remote` scatters the
     region into the request's slots and starts decoding; the region is given back.
Failures: an error answer fails the request with the prefill server's message. When the
prefill server's state is unknown (timeout, connection lost, the client aborted) the slots
may still be written: POST /disagg/abort and free them once it is acknowledged (or refused as
connection refused: nothing runs there to write), else only after the request's deadline plus
TRANSFER_GRACE_S, past which the prefill server starts no transfer.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable

import httpx
from specdeploy.engine.runtime.transfer import PoolLayout, StagingArena
from specdeploy.engine.serving.disagg.protocol import (
    ABORT_ACK_TIMEOUT_S,
    TRANSFER_GRACE_S,
    ServerInfo,
)
from specdeploy.engine.serving.scheduler import SamplingParams, Scheduler

log = logging.getLogger("specdeploy.disagg.decode")


class PrefillFailed(Exception):
    pass


class DecodeService:
    def __init__(self, scheduler: Scheduler, info: ServerInfo, timeout_s: float, agent=None,
                 arena: StagingArena | None = None, peer_headers: Callable[[], dict[str, str]] = dict):
        self.scheduler, self.runner, self.info, self.timeout_s = scheduler, scheduler.runner, info, timeout_s
        self.agent = agent  # kept alive: peers write into the memory it registered
        self.arena = arena  # registered staging: receive there, scatter into the slots on activation
        self._peers: dict[str, ServerInfo] = {}
        self._tasks: dict[str, asyncio.Task] = {}
        self._client: httpx.AsyncClient | None = None
        self._peer_headers = peer_headers  # the split roles' shared secret (serving/auth.py), read per call
        self.transfers = 0
        self.failures = 0

    # ---- RemotePrefill (called on the event loop by the scheduler) ----------------------------

    def start(self, req_id: str, prompt_ids: list[int], params: SamplingParams, prefill_url: str,
              row: int, slots: list[int]) -> None:
        self._tasks[req_id] = asyncio.ensure_future(
            self._exchange(req_id, prompt_ids, params, prefill_url.rstrip("/"), row, slots))

    def cancel(self, req_id: str) -> None:
        task = self._tasks.get(req_id)
        if task is not None:
            task.cancel()

    async def close(self) -> None:
        for task in list(self._tasks.values()):
            task.cancel()
        if self._tasks:
            await asyncio.wait(set(self._tasks.values()), timeout=ABORT_ACK_TIMEOUT_S)
        if self._client is not None:
            await self._client.aclose()

    # ---- the exchange ------------------------------------------------------------------------

    def _http(self) -> httpx.AsyncClient:
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=httpx.Timeout(self.timeout_s, connect=5.0))
        return self._client

    async def _peer(self, url: str) -> ServerInfo:
        info = self._peers.get(url)
        if info is None:
            r = await self._http().get(f"{url}/disagg/info", timeout=10.0, headers=self._peer_headers())
            if r.status_code != 200:
                raise PrefillFailed(f"{url}/disagg/info answered {r.status_code}")
            info = ServerInfo.from_dict(r.json())
            if info.role != "prefill":
                raise PrefillFailed(f"{url} is a {info.role!r} server, not a prefill server")
            why = self.info.mismatch(info)
            if why is not None:
                raise PrefillFailed(f"{url} does not pair with this decode server: {why}")
            # Name the memory the prefill server may write into: nothing else of this process.
            regions = [{"address": a, "bytes": n} for a, n in self.agent.regions()]
            r = await self._http().post(f"{url}/disagg/register", json={"peer": self.info.to_dict(), "regions": regions},
                                        timeout=10.0, headers=self._peer_headers())
            if r.status_code != 200:
                raise PrefillFailed(f"{url}/disagg/register answered {r.status_code}: {_message(r)}")
            self._peers[url] = info
            log.info("paired with prefill server %s (Mooncake session %s)", url, info.session_id)
        return info

    async def _exchange(self, req_id, prompt_ids, params: SamplingParams, url: str, row: int, slots) -> None:
        room = f"{req_id}-{uuid.uuid4().hex[:12]}"
        deadline = time.monotonic() + self.timeout_s
        sent = False  # whether the prefill server may have the request
        region = None
        try:
            await self._peer(url)
            staging = None
            if self.arena is not None:
                nbytes = self.runner.staged_kv(len(slots)).nbytes
                region = await self.arena.acquire(nbytes, deadline)
                staging = {"address": region.data_ptr(), "bytes": nbytes}
            layouts = ([PoolLayout.of(p).to_dict() for p in self.runner.kv_pools()]
                       if self.runner.slot_row_pools else [None])
            body = {"room": room, "peer": self.info.to_dict(), "prompt_ids": prompt_ids,
                    "temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k,
                    "seed": params.seed, "timeout_s": self.timeout_s, "slots": slots,
                    "target_kv": layouts[0], "draft_kv": layouts[1] if len(layouts) > 1 else None,
                    "metadata": self.runner.metadata.row_addresses(row), "staging": staging}
            sent = True
            r = await self._http().post(f"{url}/disagg/prefill", json=body, headers=self._peer_headers())
            if r.status_code == 412:  # it restarted and forgot this server: register again, once
                self._peers.pop(url, None)
                await self._peer(url)
                r = await self._http().post(f"{url}/disagg/prefill", json=body, headers=self._peer_headers())
            sent = False  # it answered: it has finished with the request either way
            if r.status_code != 200:
                raise PrefillFailed(f"the prefill server answered {r.status_code}: {_message(r)}")
            self.transfers += 1
            await self.scheduler.run_in_engine(lambda: self.scheduler.activate_remote(req_id, region))
        except asyncio.CancelledError:  # the client went away
            await asyncio.shield(self._stop_peer(url, room, deadline, sent))
            await asyncio.shield(self.scheduler.run_in_engine(lambda: self.scheduler.release_remote(req_id)))
            raise
        except Exception as e:  # noqa: BLE001 - every failure ends the same way: a clean error for this request
            self.failures += 1
            if isinstance(e, httpx.HTTPError):
                message = f"prefill server {url} unreachable or too slow: {type(e).__name__}: {e}"
            else:
                message = str(e)
            log.warning("request %s: %s", req_id, message)
            await asyncio.shield(self._stop_peer(url, room, deadline, sent))
            await asyncio.shield(self.scheduler.run_in_engine(
                lambda: self.scheduler.release_remote(req_id, error=message)))
        finally:
            self._tasks.pop(req_id, None)
            # Only now: the prefill server has finished with (or given up on) the room, and
            # activation has copied the region into the slots.
            if region is not None:
                self.arena.release(region)

    async def _stop_peer(self, url: str, room: str, deadline: float, sent: bool) -> None:
        """Return once the prefill server will not write into this room's slots any more."""
        if not sent:
            return
        try:
            r = await self._http().post(f"{url}/disagg/abort", json={"room": room}, timeout=ABORT_ACK_TIMEOUT_S,
                                        headers=self._peer_headers())
            if r.status_code == 200:
                return
        except httpx.ConnectError:
            return  # nothing listens there: the process (and its transfer engine) is gone
        except httpx.HTTPError:
            pass
        wait_s = deadline + TRANSFER_GRACE_S - time.monotonic()
        log.warning("room %s: the prefill server did not acknowledge the abort; its slots stay "
                    "taken for %.0f s more (past the deadline no transfer starts)", room, max(wait_s, 0))
        if wait_s > 0:
            await asyncio.sleep(wait_s)


def _message(r: httpx.Response) -> str:
    try:
        return r.json().get("error", {}).get("message") or r.text
    except ValueError:
        return r.text[:500]
