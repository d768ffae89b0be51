"""The OpenAI fields beyond plain sampling, through the official client against the speculative
tiny server (float32): logprobs and echo, n / best_of / lists of prompts, penalties, logit_bias,
min_tokens, and the 400s for values out of bounds."""

from __future__ import annotations

import math

import httpx
import openai
import pytest

from api_errors import assert_error, assert_still_serving, post

LONG = {"ignore_eos": True}


def test_completion_logprobs_are_the_greedy_choice(client, server):
    out = client.completions.create(model=server.model, prompt="def main(", max_tokens=12, temperature=0,
                                    logprobs=3, extra_body=LONG)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == out.usage.completion_tokens == 12
    if not any(t.startswith("bytes:") for t in lp.tokens):
        assert "".join(lp.tokens) == out.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(12)]
    for token_lp, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert token_lp <= 0 and 3 <= len(top) <= 4
        assert token_lp == pytest.approx(max(top.values()), abs=1e-5)  # greedy: the most likely token


def test_echo_of_a_text_prompt_without_generating(client, server):
    out = client.completions.create(model=server.model, prompt="import os\n", max_tokens=0, echo=True,
                                    logprobs=1, temperature=0)
    c = out.choices[0]
    assert c.text == "import os\n" and out.usage.completion_tokens == 0
    assert len(c.logprobs.tokens) == out.usage.prompt_tokens
    assert c.logprobs.token_logprobs[0] is None  # nothing predicts the first prompt token
    assert all(lp <= 0 for lp in c.logprobs.token_logprobs[1:])


def test_echo_logprobs_of_token_prompts_match_generation(client, server):
    """The logprobs of generated tokens (the verify pass, under speculation) equal those the
    prefill of the same tokens gives (echo): the target's distribution either way."""
    first = client.completions.create(model=server.model, prompt=[5, 6, 7, 8], max_tokens=8, temperature=0,
                                      logprobs=2, extra_body=LONG)
    gen_lps = first.choices[0].logprobs.token_logprobs
    gen_ids = httpx.post(f"{server.url}/v1/completions", json={
        "model": server.model, "prompt": [5, 6, 7, 8], "max_tokens": 8, "temperature": 0, "ignore_eos": True,
        "logprobs": 0, "return_token_ids": True}).json()
    assert gen_ids["choices"][0]["text"] == first.choices[0].text
    ids = [5, 6, 7, 8] + gen_ids["choices"][0]["token_ids"]
    text_ids = httpx.post(f"{server.url}/v1/completions", json={
        "model": server.model, "prompt": ids, "max_tokens": 0, "logprobs": 0,
        "echo": True}).json()["choices"][0]["logprobs"]
    assert text_ids["token_logprobs"][4:] == pytest.approx(gen_lps, abs=1e-5)
    assert text_ids["token_logprobs"][0] is None and len(text_ids["token_logprobs"]) == 12


def test_chat_logprobs_stream_and_whole_agree(client, server):
    kwargs = dict(model=server.model, messages=[{"role": "user", "content": "hello"}], max_tokens=10,
                  temperature=0, logprobs=True, top_logprobs=2, extra_body=LONG)
    whole = client.chat.completions.create(**kwargs)
    content = whole.choices[0].logprobs.content
    assert len(content) == 10
    joined = b"".join(bytes(c.bytes) for c in content).decode("utf-8", "replace")
    assert joined.startswith(whole.choices[0].message.content)  # special tokens are not in the text
    assert all(len(c.top_logprobs) == 2 and c.top_logprobs[0].logprob == pytest.approx(c.logprob, abs=1e-5)
               for c in content)
    streamed = [c for chunk in client.chat.completions.create(stream=True, **kwargs)
                for choice in chunk.choices if choice.logprobs for c in choice.logprobs.content]
    assert [(c.token, round(c.logprob, 4)) for c in streamed] == [(c.token, round(c.logprob, 4)) for c in content]


def test_n_choices_seeded_and_streamed(client, server):
    kwargs = dict(model=server.model, prompt="return ", max_tokens=12, temperature=1.0, seed=7, extra_body=LONG)
    out = client.completions.create(n=3, **kwargs)
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert len({c.text for c in out.choices}) > 1  # each choice draws its own tokens
    assert out.usage.completion_tokens == 36
    again = client.completions.create(n=3, **kwargs)
    assert [c.text for c in again.choices] == [c.text for c in out.choices]  # seed, seed + 1, ...
    texts, finished, usage = {}, set(), None
    for chunk in client.completions.create(n=3, stream=True, stream_options={"include_usage": True}, **kwargs):
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason:
                finished.add(c.index)
    assert finished == {0, 1, 2} and [texts[i] for i in range(3)] == [c.text for c in out.choices]
    assert usage.completion_tokens == 36 and usage.prompt_tokens == out.usage.prompt_tokens


def test_chat_n_choices(client, server):
    out = client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": "hi"}], n=2,
                                         max_tokens=6, temperature=0, extra_body=LONG)
    assert [c.index for c in out.choices] == [0, 1]
    assert out.choices[0].message.content == out.choices[1].message.content  # greedy
    assert out.usage.completion_tokens == 12


def test_a_list_of_prompts_answers_each_in_order(client, server):
    prompts = ["import os\n", "class A:", "def f(x):"]
    alone = [client.completions.create(model=server.model, prompt=p, max_tokens=8, temperature=0,
                                       extra_body=LONG).choices[0].text for p in prompts]
    out = client.completions.create(model=server.model, prompt=prompts, max_tokens=8, temperature=0, extra_body=LONG)
    assert [c.text for c in out.choices] == alone
    assert out.usage.completion_tokens == 24


def test_best_of_returns_the_most_likely_choice(client, server):
    kwargs = dict(model=server.model, prompt="x = ", max_tokens=8, temperature=1.0, seed=3, logprobs=0,
                  extra_body=LONG)
    pool = client.completions.create(n=4, **kwargs).choices
    best = client.completions.create(n=1, best_of=4, **kwargs).choices
    assert len(best) == 1
    sums = [sum(c.logprobs.token_logprobs) for c in pool]
    assert best[0].text == pool[max(range(4), key=lambda i: sums[i])].text
    # best_of also works without logprobs asked for (they are computed, not shown)
    plain = client.completions.create(model=server.model, prompt="x = ", max_tokens=8, temperature=1.0, seed=3,
                                      n=1, best_of=4, extra_body=LONG).choices[0]
    assert plain.text == best[0].text and plain.logprobs is None


def test_penalties_and_bias_change_greedy_output(client, server):
    kwargs = dict(model=server.model, prompt="aaaa", max_tokens=24, temperature=0, extra_body=LONG)
    plain = client.completions.create(**kwargs).choices[0]
    penalized = client.completions.create(frequency_penalty=2.0, presence_penalty=1.0, logprobs=0, **kwargs).choices[0]
    assert penalized.text != plain.text

    def repeats(tokens):
        return len(tokens) - len(set(tokens))
    plain_tokens = client.completions.create(logprobs=0, **kwargs).choices[0].logprobs.tokens
    assert repeats(penalized.logprobs.tokens) <= repeats(plain_tokens)
    # Streaming gives the same tokens under the same penalties.
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        frequency_penalty=2.0, presence_penalty=1.0, stream=True, **kwargs))
    assert streamed == penalized.text
    first = httpx.post(f"{server.url}/v1/completions", json={**{k: v for k, v in kwargs.items() if k != "extra_body"},
                                                             "ignore_eos": True, "prompt": [5, 6, 7], "max_tokens": 3,
                                                             "echo": False}).json()
    assert first["choices"][0]["text"]
    forced = httpx.post(f"{server.url}/v1/completions", json={
        "model": server.model, "prompt": [5, 6, 7], "max_tokens": 5, "temperature": 0, "ignore_eos": True,
        "logit_bias": {"42": 100}, "logprobs": 0, "echo": True}).json()["choices"][0]
    assert forced["logprobs"]["tokens"][3:] == [forced["logprobs"]["tokens"][3]] * 5


def test_min_tokens_holds_back_the_stop_token(client, server, model_dirs):
    from specdeploy.engine.serving.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(model_dirs[0])
    # Make token 42 the greedy choice everywhere, then call it a stop token: it ends at once...
    body = {"model": server.model, "prompt": [5, 6, 7], "max_tokens": 10, "temperature": 0,
            "logit_bias": {"42": 50}, "stop_token_ids": [42]}
    r = httpx.post(f"{server.url}/v1/completions", json=body).json()
    assert r["usage"]["completion_tokens"] == 1 and r["choices"][0]["finish_reason"] == "stop"
    # ...unless min_tokens holds it back for 6 tokens.
    r = httpx.post(f"{server.url}/v1/completions", json={**body, "min_tokens": 6}).json()
    assert r["usage"]["completion_tokens"] == 7 and r["choices"][0]["finish_reason"] == "stop", r
    assert tok.vocab_size > 42


@pytest.mark.parametrize("path,extra,param", [
    ("/v1/completions", {"n": 100}, "n"),
    ("/v1/completions", {"best_of": 100}, "best_of"),
    ("/v1/completions", {"n": 3, "best_of": 2}, "best_of"),
    ("/v1/completions", {"best_of": 2, "stream": True}, "best_of"),
    ("/v1/completions", {"prompt": ["a"] * 3, "n": 2}, "n"),
    ("/v1/completions", {"logprobs": 21}, "logprobs"),
    ("/v1/completions", {"logprobs": -1}, "logprobs"),
    ("/v1/completions", {"suffix": "}"}, "suffix"),
    ("/v1/completions", {"max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"logit_bias": {"99999": 1}}, "logit_bias"),
    ("/v1/completions", {"logit_bias": {"x": 1}}, "logit_bias"),
    ("/v1/completions", {"logit_bias": {"3": 101}}, "logit_bias"),
    ("/v1/completions", {"presence_penalty": 2.5}, "presence_penalty"),
    ("/v1/completions", {"frequency_penalty": -3}, "frequency_penalty"),
    ("/v1/completions", {"repetition_penalty": 0}, "repetition_penalty"),
    ("/v1/completions", {"min_tokens": 9}, "min_tokens"),
    ("/v1/chat/completions", {"n": 5}, "n"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
])
def test_out_of_bounds_fields_are_400s_naming_the_field(server, path, extra, param):
    body = {"model": server.model, "max_tokens": 4}
    body.update({"prompt": "hi"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]})
    body.update(extra)
    assert_error(post(server, path, body), 400, param=param)


def test_server_still_serves_after_the_bad_requests(server):
    assert_still_serving(server)
    assert math.isfinite(httpx.get(f"{server.url}/metrics").elapsed.total_seconds())


def test_client_raises_bad_request(client, server):
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=server.model, prompt="hi", max_tokens=2, n=50)


def test_choices_of_one_prompt_share_its_kv(client, server):
    """n choices are n requests of one prompt: all but the first reuse its positions (prefix cache)."""
    prompt = "class Scheduler:\n    def step(self):\n        return self.runner.step() + 1 " * 2
    out = client.completions.create(model=server.model, prompt=prompt, max_tokens=4, temperature=1.0, n=3, seed=1,
                                    extra_body=LONG)
    p = out.usage.prompt_tokens
    assert out.usage.prompt_tokens_details.cached_tokens >= 2 * (p // 2)


def test_streamed_echo_with_logprobs_and_n(client, server):
    kwargs = dict(model=server.model, prompt=[5, 6, 7, 8], max_tokens=5, temperature=0, logprobs=1, echo=True,
                  extra_body=LONG)
    whole = client.completions.create(n=2, **kwargs)
    texts, lps = {}, {}
    for chunk in client.completions.create(n=2, stream=True, **kwargs):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.logprobs is not None:
                lps.setdefault(c.index, []).extend(c.logprobs.token_logprobs)
    for i, choice in enumerate(whole.choices):
        assert texts[i] == choice.text
        assert len(lps[i]) == 4 + 5 and lps[i][0] is None and choice.logprobs.token_logprobs[0] is None
        assert lps[i][1:] == pytest.approx(choice.logprobs.token_logprobs[1:], abs=1e-5)
    assert whole.choices[1].logprobs.token_logprobs == pytest.approx(whole.choices[0].logprobs.token_logprobs,
                                                                     abs=1e-5)  # greedy: the same
