"""A bounded soak of the engine server on CPU: concurrent streaming clients with random prompts,
lengths, sampling settings and stop strings, some of which hang up mid-stream or are cancelled,
for a fixed time against the tiny pair; afterwards every KV slot and request row is back, and
every request that was not abandoned got a completion or an error in OpenAI's shape (never a 5xx,
a broken stream or a hang).

CI runs a short soak (SPECDEPLOY_SOAK_S, default 15 s, 8 clients); `make soak` runs minutes with
more clients and writes the figures (p50/p99 latency, time to first token, outcome counts) to
SPECDEPLOY_SOAK_REPORT.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import statistics
import time
from collections import Counter
from pathlib import Path

import httpx
import openai
import pytest

SOAK_S = float(os.environ.get("SPECDEPLOY_SOAK_S", "15"))
CLIENTS = int(os.environ.get("SPECDEPLOY_SOAK_CLIENTS", "8"))
SEED = int(os.environ.get("SPECDEPLOY_SOAK_SEED", "22"))
REPORT = os.environ.get("SPECDEPLOY_SOAK_REPORT")
MAX_RUNNING, MAX_QUEUED, CONTEXT = 4, 8, 256
# A request that has not finished after this long is a hang, which the soak reports as a failure.
REQUEST_TIMEOUT_S = 120
WORDS = ("def", "class", "return", "import", "self", "for", "in", "range", "if", "else", "(", ")", ":",
         "=", "+", "x", "y", "n", "print", "None", "True", "\n", "    ", "#", "'", "0", "1", "[", "]")
STOPS = ("\n", ")", ":", "return", "  ", "xyz-never")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))] if ordered else float("nan")


@pytest.fixture(scope="module")
def soak_server(model_dirs):
    from specdeploy.engine.serving.cli import ServerThread, free_port

    target, draft = model_dirs
    running = ServerThread([
        "engine", "serve", "--target", str(target), "--draft", str(draft), "--algorithm", "EAGLE",
        "--num-steps", "3", "--topk", "1", "--num-draft-tokens", "4", "--dtype", "float32",
        "--served-model-name", "tiny-target", "--context-length", str(CONTEXT),
        "--max-running-requests", str(MAX_RUNNING), "--max-queued-requests", str(MAX_QUEUED),
        "--max-total-tokens", "2048", "--host", "127.0.0.1", "--port", str(free_port()),
    ]).start(timeout_s=120)
    yield running
    running.stop()


class Soak:
    def __init__(self, base_url: str, model: str, rng: random.Random):
        self.base_url, self.model, self.rng = base_url, model, rng
        self.outcomes: Counter[str] = Counter()
        self.refusals: Counter[str] = Counter()  # 400 messages, by their start
        self.latencies_s: list[float] = []
        self.ttft_s: list[float] = []
        self.failures: list[str] = []
        self.tokens = 0
        self.client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0,
                                         timeout=REQUEST_TIMEOUT_S)
        self.http = httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S)

    def prompt(self) -> str:
        return "".join(self.rng.choice(WORDS) + self.rng.choice(("", " ")) for _ in range(self.rng.randint(1, 60)))

    def sampling(self) -> dict:
        kwargs: dict = {"max_tokens": self.rng.choice((1, 2, 8, 16, 32, 64, 128)),
                        "temperature": self.rng.choice((0.0, 0.0, 0.7, 1.0))}
        if self.rng.random() < 0.3:
            kwargs["top_p"] = self.rng.choice((0.5, 0.9))
        if self.rng.random() < 0.4:
            kwargs["stop"] = self.rng.sample(STOPS, self.rng.randint(1, 3))
        if self.rng.random() < 0.2:
            kwargs["seed"] = self.rng.randint(0, 1000)
        return kwargs

    def api_error(self, err: openai.APIStatusError) -> None:
        if err.status_code >= 500 and err.status_code != 503:
            self.failures.append(f"{err.status_code}: {err.message}")
        body = err.body if isinstance(err.body, dict) else {}
        if not {"message", "type"} <= set(body):
            self.failures.append(f"{err.status_code} without OpenAI's error body: {err.body!r}")
        self.outcomes[f"error {err.status_code}"] += 1
        if err.status_code == 400:
            self.refusals[str(body.get("message", ""))[:60]] += 1

    async def stream(self, chat: bool) -> None:
        t0 = time.monotonic()
        first = None
        finish = None
        n = 0
        kwargs = self.sampling()
        if chat:
            stream = await self.client.chat.completions.create(
                model=self.model, messages=[{"role": "user", "content": self.prompt()}], stream=True, **kwargs)
        else:
            stream = await self.client.completions.create(model=self.model, prompt=self.prompt(), stream=True, **kwargs)
        async for chunk in stream:
            if not chunk.choices:
                continue
            choice = chunk.choices[0]
            text = choice.delta.content if chat else choice.text
            if text and first is None:
                first = time.monotonic() - t0
            n += bool(text)
            finish = choice.finish_reason or finish
        if finish not in ("stop", "length"):
            self.failures.append(f"a stream ended without a finish reason (got {finish!r})")
            return
        self.latencies_s.append(time.monotonic() - t0)
        if first is not None:
            self.ttft_s.append(first)
        self.tokens += n
        self.outcomes[f"{'chat' if chat else 'completion'} stream {finish}"] += 1

    async def whole(self) -> None:
        t0 = time.monotonic()
        out = await self.client.completions.create(model=self.model, prompt=self.prompt(), **self.sampling())
        if out.choices[0].finish_reason not in ("stop", "length"):
            self.failures.append(f"finish_reason {out.choices[0].finish_reason!r}")
            return
        self.latencies_s.append(time.monotonic() - t0)
        self.tokens += out.usage.completion_tokens
        self.outcomes[f"completion {out.choices[0].finish_reason}"] += 1

    async def hang_up(self) -> None:
        """Read a few events of a long stream, then close the connection."""
        body = {"model": self.model, "prompt": self.prompt(), "max_tokens": 200, "stream": True, "ignore_eos": True}
        async with self.http.stream("POST", f"{self.base_url}/v1/completions", json=body) as r:
            if r.status_code != 200:
                self.outcomes[f"error {r.status_code}"] += 1
                return
            lines = 0
            async for line in r.aiter_lines():
                lines += line.startswith("data: ")
                if lines >= self.rng.randint(1, 6):
                    break
        self.outcomes["hung up mid-stream"] += 1

    async def cancel(self) -> None:
        """Cancel the client's task at a random moment (before, during or after admission)."""
        task = asyncio.ensure_future(self.stream(chat=self.rng.random() < 0.5))
        await asyncio.sleep(self.rng.uniform(0.0, 0.5))
        if task.done():
            await task
            return
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            self.outcomes["cancelled"] += 1

    async def one(self) -> None:
        action = self.rng.choices(("stream", "chat", "whole", "hang_up", "cancel", "too_long"),
                                  weights=(40, 15, 15, 12, 12, 6))[0]
        try:
            if action == "too_long":
                await self.client.completions.create(model=self.model, prompt="x " * (CONTEXT * 2), max_tokens=4)
                self.failures.append("a prompt longer than the context was served")
            elif action in ("stream", "chat"):
                await self.stream(chat=action == "chat")
            else:
                await getattr(self, action)()
        except openai.APIStatusError as err:
            self.api_error(err)
            if err.status_code == 429:  # queue full: back off, as a client should
                await asyncio.sleep(self.rng.uniform(0.5, 1.5))
        except (openai.APIConnectionError, httpx.TransportError) as err:
            self.failures.append(f"{action}: {type(err).__name__}: {err}")

    async def client_loop(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            await self.one()

    async def run(self, clients: int, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        await asyncio.gather(*(self.client_loop(deadline) for _ in range(clients)))
        await self.client.close()
        await self.http.aclose()


def test_soak(soak_server, capsys):
    runner = soak_server.state.scheduler.runner
    baseline = (runner.num_free_slots, len(runner.table._free_rows))
    soak = Soak(soak_server.base_url, soak_server.state.model_name, random.Random(SEED))
    t0 = time.monotonic()
    asyncio.run(soak.run(CLIENTS, SOAK_S))
    elapsed = time.monotonic() - t0

    scheduler = soak_server.state.scheduler
    deadline = time.monotonic() + 30
    while not (scheduler.is_idle and (runner.num_free_slots, len(runner.table._free_rows)) == baseline):
        if time.monotonic() > deadline:
            break
        time.sleep(0.05)
    after = (runner.num_free_slots, len(runner.table._free_rows))
    report = {
        "clients": CLIENTS, "seconds": round(elapsed, 1), "requests": sum(soak.outcomes.values()),
        "outcomes": dict(sorted(soak.outcomes.items())), "failures": soak.failures[:20],
        "refused_400": dict(soak.refusals.most_common(5)),
        "latency_s": {"p50": round(percentile(soak.latencies_s, 0.5), 3), "p99": round(percentile(soak.latencies_s, 0.99), 3),
                      "max": round(max(soak.latencies_s, default=float("nan")), 3)},
        "ttft_s": {"p50": round(percentile(soak.ttft_s, 0.5), 3), "p99": round(percentile(soak.ttft_s, 0.99), 3)},
        "tokens_per_s": round(soak.tokens / elapsed, 1),
        "kv_slots_free": {"before": baseline[0], "after": after[0]},
        "request_rows_free": {"before": baseline[1], "after": after[1]},
        "mean_latency_s": round(statistics.fmean(soak.latencies_s), 3) if soak.latencies_s else None,
    }
    with capsys.disabled():
        print("\nsoak: " + json.dumps(report, indent=1))
    if REPORT:
        Path(REPORT).write_text(json.dumps(report, indent=1) + "\n")

    assert not soak.failures, soak.failures[:20]
    assert after == baseline and scheduler.is_idle, report
    assert httpx.get(f"{soak_server.base_url}/ready").status_code == 200
    # Every kind of traffic happened, and most of it was served.
    kinds = {k.split()[0] for k in soak.outcomes}
    assert {"completion", "chat", "hung", "cancelled"} <= kinds, soak.outcomes
    # Of the requests that back-pressure (429) did not turn away, most were served; the rest were
    # refused for length (400), hung up on or cancelled by the clients themselves.
    served = sum(v for k, v in soak.outcomes.items() if k.startswith(("completion", "chat")))
    admitted = report["requests"] - soak.outcomes["error 429"]
    assert served >= 0.3 * admitted and soak.outcomes["error 400"] > 0, soak.outcomes
