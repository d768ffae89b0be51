"""The OpenAI API through the official client: completions, chat, streaming, batching, sampling."""

from __future__ import annotations

import asyncio

import httpx

# Greedy generations long enough to span several speculative steps; EOS is ignored so that
# every request runs to max_tokens and the outputs are comparable.
LONG = {"ignore_eos": True}


def test_models_lists_the_served_model(client, server):
    models = client.models.list()
    assert [m.id for m in models.data] == [server.model]
    assert client.models.retrieve(server.model).id == server.model


def test_health_and_ready(server):
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    assert httpx.get(f"{server.url}/ready").status_code == 200


def test_completion_runs_to_max_tokens_with_usage(client, server):
    out = client.completions.create(model=server.model, prompt="def main(", max_tokens=24, temperature=0,
                                    extra_body=LONG)
    choice = out.choices[0]
    assert choice.finish_reason == "length"
    assert choice.text
    assert out.usage.completion_tokens == 24
    assert out.usage.prompt_tokens > 0
    assert out.usage.total_tokens == out.usage.prompt_tokens + 24
    assert out.model == server.model and out.object == "text_completion"


def test_completion_accepts_token_ids(client, server):
    ids = [0, 17, 42, 99]
    out = client.completions.create(model=server.model, prompt=ids, max_tokens=5, temperature=0, extra_body=LONG)
    assert out.usage.prompt_tokens == len(ids)
    assert out.usage.completion_tokens == 5


def test_greedy_is_deterministic(client, server):
    texts = {client.completions.create(model=server.model, prompt="import os\n", max_tokens=20, temperature=0,
                                       extra_body=LONG).choices[0].text for _ in range(2)}
    assert len(texts) == 1


def test_chat_completion(client, server):
    out = client.chat.completions.create(model=server.model, max_tokens=12, temperature=0, extra_body=LONG,
                                         messages=[{"role": "system", "content": "Be brief."},
                                                   {"role": "user", "content": "What is a slot?"}])
    msg = out.choices[0].message
    assert msg.role == "assistant" and msg.content
    assert out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 12
    # system + user turns, each wrapped by the template, plus the assistant header
    assert out.usage.prompt_tokens > len("Be brief. What is a slot?") // 8


def test_streamed_completion_equals_the_whole_one(client, server):
    kwargs = dict(model=server.model, prompt="class Runner:", max_tokens=40, temperature=0, extra_body=LONG)
    whole = client.completions.create(**kwargs)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert reasons[-1] == "length" and all(r is None for r in reasons[:-1])
    assert len([c for c in chunks if c.choices and c.choices[0].text]) > 1, "tokens should arrive in pieces"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 40


def test_streamed_chat(client, server):
    messages = [{"role": "user", "content": "hello"}]
    whole = client.chat.completions.create(model=server.model, messages=messages, max_tokens=16, temperature=0,
                                           extra_body=LONG)
    chunks = list(client.chat.completions.create(model=server.model, messages=messages, max_tokens=16,
                                                 temperature=0, stream=True, extra_body=LONG))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"


def test_raw_sse_ends_with_done(server):
    body = {"model": server.model, "prompt": "x = ", "max_tokens": 4, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"


async def test_concurrent_requests_match_each_alone(async_client, server):
    """Continuous batching must not change greedy outputs: requests of different lengths, run
    together (one batch, staggered admission), give what each gives alone."""
    prompts = ["def f(x):", "import sys", "# The scheduler owns requests", "while True:\n    "]
    max_tokens = [30, 45, 20, 38]

    async def one(prompt, n):
        out = await async_client.completions.create(model=server.model, prompt=prompt, max_tokens=n,
                                                    temperature=0, extra_body=LONG)
        return out.choices[0].text

    alone = [await one(p, n) for p, n in zip(prompts, max_tokens)]
    together = await asyncio.gather(*(one(p, n) for p, n in zip(prompts, max_tokens)))
    assert list(together) == alone


def test_stop_string_truncates_and_finishes(client, server):
    kwargs = dict(model=server.model, prompt="for i in range(", temperature=0, extra_body=LONG)
    full = client.completions.create(max_tokens=40, **kwargs).choices[0].text
    # The first three characters, past the start, that do not occur earlier: the output of a
    # tiny model repeats itself, so a fixed offset could name a string seen before it.
    stop = next(full[i:i + 3] for i in range(5, len(full) - 3) if full.index(full[i:i + 3]) == i)
    out = client.completions.create(max_tokens=40, stop=[stop], **kwargs)
    assert out.choices[0].text == full[:full.index(stop)]
    assert out.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        max_tokens=40, stop=stop, stream=True, **kwargs))
    assert streamed == full[:full.index(stop)], "a stop string must never be streamed"


def test_seeded_sampling_is_reproducible(client, server):
    kwargs = dict(model=server.model, prompt="return ", max_tokens=24, temperature=1.0, top_p=0.9,
                  extra_body={"top_k": 50, **LONG})
    a = client.completions.create(seed=7, **kwargs).choices[0].text
    b = client.completions.create(seed=7, **kwargs).choices[0].text
    assert a == b


def test_chat_default_max_tokens_fits_the_context(client, server):
    out = client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": "hi"}],
                                         temperature=0)
    assert out.usage.prompt_tokens + out.usage.completion_tokens <= server.context_length
    assert out.choices[0].finish_reason in ("stop", "length")


def test_chat_default_max_tokens_fits_a_pool_of_one_context(server, start_server):
    """One running request and a pool of one context (the CPU default, context x running): the
    default must leave room for the request's draft scratch, not ask for the whole context."""
    import openai

    url = start_server("--max-running-requests", "1", "--max-total-tokens", str(server.context_length))
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    out = client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": "hi"}],
                                         temperature=0, extra_body=LONG)
    assert out.choices[0].finish_reason == "length"
    # The whole pool but one iteration's scratch: (3 - 1) x topk 1 draft + 4 verified tokens.
    assert out.usage.prompt_tokens + out.usage.completion_tokens == server.context_length - 6


def test_stop_token_ids_end_generation_and_stay_out_of_the_text(client, server):
    # Every id is a stop id, so the very first token stops: counted in usage, absent from the text.
    out = client.completions.create(model=server.model, prompt="x", max_tokens=10, temperature=0,
                                    extra_body={"stop_token_ids": list(range(server.vocab_size)), "ignore_eos": True})
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].text == ""
    assert out.usage.completion_tokens == 1
