"""The prefix cache through the real server and the official client: a shared system prompt is
served from the cache on the second request (usage.prompt_tokens_details.cached_tokens, also in
the streamed usage chunk), the text equals a cache-off server's, and the hit rate shows in
/metrics and in the periodic log line."""

from __future__ import annotations

import logging
import time

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

LONG = {"ignore_eos": True}
# Unique to this file, so that no other test on the shared server has cached it.
SYSTEM = ("You answer questions about the prefix cache of the specdeploy engine. Be precise, cite "
          "the module, and keep every answer under three sentences.")
QUESTIONS = ["What is a slot?", "Why bigram keys?", "When is a node evicted?"]


def chat(client, question: str, **kw):
    return client.chat.completions.create(
        model="tiny-target", messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        max_tokens=12, temperature=0, extra_body=LONG, **kw)


def metric(url: str, name: str) -> float:
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        for sample in family.samples:
            if sample.name == name:
                return sample.value
    raise KeyError(name)


def cached(usage) -> int:
    return usage.prompt_tokens_details.cached_tokens


def test_shared_system_prompt_is_served_from_the_cache(client, server, start_server, caplog):
    caplog.set_level(logging.INFO, logger="specdeploy.scheduler")
    off_url = start_server("--no-prefix-cache")
    off = openai.OpenAI(base_url=f"{off_url}/v1", api_key="unused", max_retries=0, timeout=120)
    hits_before = metric(server.url, "specdeploy_prefix_cache_hits_total")
    queries_before = metric(server.url, "specdeploy_prefix_cache_queries_total")

    first = chat(client, QUESTIONS[0])
    # At most the chat template's opening, which any other test's chat on this server may have cached.
    assert cached(first.usage) < len(SYSTEM) // 8
    for question in QUESTIONS[1:]:
        hit, ref = chat(client, question), chat(off, question)
        assert hit.choices[0].message.content == ref.choices[0].message.content
        assert cached(ref.usage) == 0
        # The system prompt (tokens into the user turn's header at most), never the last token.
        assert len(SYSTEM) // 8 < cached(hit.usage) < hit.usage.prompt_tokens

    # The same prompt again: all but its last token; streamed, the usage chunk says so too.
    again = list(chat(client, QUESTIONS[0], stream=True, stream_options={"include_usage": True}))
    assert cached(again[-1].usage) == first.usage.prompt_tokens - 1
    assert "".join(c.choices[0].delta.content or "" for c in again if c.choices) == first.choices[0].message.content

    # /v1/completions reports it as well.
    prompt = SYSTEM + " Question: what is evicted first?"
    client.completions.create(model=server.model, prompt=prompt, max_tokens=4, temperature=0, extra_body=LONG)
    out = client.completions.create(model=server.model, prompt=prompt, max_tokens=4, temperature=0, extra_body=LONG)
    assert cached(out.usage) == out.usage.prompt_tokens - 1

    hits = metric(server.url, "specdeploy_prefix_cache_hits_total") - hits_before
    queries = metric(server.url, "specdeploy_prefix_cache_queries_total") - queries_before
    assert hits >= sum(cached(u) for u in (again[-1].usage, out.usage))
    assert 0 < hits < queries
    assert metric(server.url, "specdeploy_prefix_cache_slots") > 0
    assert metric(off_url, "specdeploy_prefix_cache_queries_total") == 0

    # The line comes at most every log interval (5 s), from a decode step, and reports that
    # interval's hits: keep hitting requests coming until one with hits is logged (a loaded
    # machine can stretch the interval well past 5 s).
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        lines = [r.getMessage() for r in caplog.records
                 if "prefix_hit=" in r.getMessage() and "prefix_hit=0.0%" not in r.getMessage()]
        if lines:
            break
        client.completions.create(model=server.model, prompt=prompt, max_tokens=2, temperature=0, extra_body=LONG)
        time.sleep(0.5)
    assert lines, "no periodic log line with the prefix cache hit rate"
    assert 0 < metric(server.url, "specdeploy_prefix_cache_hit_rate") <= 1
