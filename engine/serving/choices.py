"""Many choices of one request: `n`, `best_of` and lists of prompts.

Each choice is its own engine request (its own handle, seed and grammar state); those of one
prompt share its KV through the prefix cache where it is on (the scheduler's admission defers a
request whose prompt another one of the same chunk is writing). The server gathers their
deltas: all of them for a whole response, or merged as they come for a stream. A client that
goes away, a server that stops, or a choice that cannot be submitted aborts every choice.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import AsyncIterator

from specdeploy.engine.serving.scheduler import Delta, RequestHandle

# How often a non-streaming request checks whether its client is still there.
DISCONNECT_POLL_S = 0.25


@dataclass
class Choice:
    handle: RequestHandle
    prompt_index: int = 0
    prompt_ids: list[int] = field(default_factory=list)
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    prompt_logprobs: list | None = None
    last: Delta | None = None

    def add(self, delta: Delta) -> None:
        self.text += delta.text
        self.token_ids += delta.token_ids
        self.logprobs += delta.logprobs or []
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        self.last = delta

    @property
    def cumulative_logprob(self) -> float:
        return sum(lp for lp, _ in self.logprobs)


def abort_all(choices: list[Choice]) -> None:
    for c in choices:
        c.handle.abort()


async def collect_all(choices: list[Choice], request) -> None:
    """Run every choice to its end; abort all if the client disconnects meanwhile."""

    async def consume(choice: Choice):
        async for delta in choice.handle.deltas():
            choice.add(delta)

    task = asyncio.ensure_future(asyncio.gather(*(consume(c) for c in choices)))
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if not task.done() and await request.is_disconnected():
                abort_all(choices)
                await task
    finally:
        if not task.done():  # cancelled ourselves (server stopping)
            abort_all(choices)
            task.cancel()


async def merged(choices: list[Choice]) -> AsyncIterator[tuple[int, Delta]]:
    """(choice index, delta) of every choice as they come, until each has finished. The caller
    aborts the unfinished ones if it stops iterating."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, choice: Choice):
        async for delta in choice.handle.deltas():
            await queue.put((i, delta))

    tasks = [asyncio.ensure_future(pump(i, c)) for i, c in enumerate(choices)]
    left = len(choices)
    try:
        while left:
            i, delta = await queue.get()
            choices[i].add(delta)
            if delta.finish_reason is not None:
                left -= 1
            yield i, delta
    finally:
        for t in tasks:
            t.cancel()


def best(choices: list[Choice], n: int) -> list[Choice]:
    """best_of: of one prompt's choices, the n with the highest cumulative log-probability."""
    return sorted(choices, key=lambda c: c.cumulative_logprob, reverse=True)[:n]
