"""Structured output through xgrammar: with the tiny pair's tokenizer and weights (float32),
speculative decoding under a grammar gives target-only decoding's tokens, every output parses
(and validates against its schema), sampled outputs too; and through the server with the
`openai` client, including the 400s for what does not compile."""

from __future__ import annotations

import json
import re

import jsonschema_rs
import pytest

from specdeploy.engine.demo.toy import copy_draft, predictable_target, tiny_config
from specdeploy.engine.runtime.runner import Request, Runner
from specdeploy.engine.planner.plan import SpecSettings
from specdeploy.engine.runtime.sampling import LogitControls
from specdeploy.engine.serving.structured import GrammarSpec, compile_spec
from specdeploy.engine.serving.tokenizer import Tokenizer
from api_errors import assert_error, assert_still_serving, post
from engine_server import CONTEXT_LENGTH

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "count", "ok"],
          "properties": {"name": {"type": "string", "maxLength": 6},
                         "count": {"type": "integer", "minimum": 0, "maximum": 99},
                         "ok": {"type": "boolean"}}}
SPECS = [GrammarSpec("json", SCHEMA, "response_format"), GrammarSpec("json", None, "response_format"),
         GrammarSpec("regex", r"(yes|no), [a-z]{2,5}!", "guided_regex"),
         GrammarSpec("choice", ["red", "green", "blue"], "guided_choice")]


def parses(spec: GrammarSpec, text: str) -> bool:
    if spec.kind == "json":
        value = json.loads(text)
        if spec.value is not None:
            jsonschema_rs.validate(spec.value, value)
        return isinstance(value, dict)
    if spec.kind == "regex":
        return re.fullmatch(spec.value, text) is not None
    return text in spec.value


@pytest.fixture(scope="module")
def tiny(model_dirs):
    tok = Tokenizer.from_dir(model_dirs[0])
    cfg = tiny_config(vocab_size=tok.hf.get_vocab_size(), max_position_embeddings=CONTEXT_LENGTH)
    target, perm = predictable_target(cfg, seed=0)  # the weights conftest saved for the server
    return tok, target, copy_draft("EAGLE", target, perm)


def generate(runner, tok, spec, compiled, prompts, temperature=0.0, seed=None):
    reqs = [Request(f"r{i}", tok.encode(p), 48, temperature=temperature, seed=None if seed is None else seed + i,
                    stop_token_ids=set(tok.eos_token_ids), controls=LogitControls(grammar=compiled.matcher()))
            for i, p in enumerate(prompts)]
    for r in reqs:
        runner.add(r)
    out = {r.id: [] for r in reqs}
    while runner.num_running:
        for o in runner.step():
            out[o.req_id] += o.token_ids
    return [[t for t in out[r.id] if t not in tok.eos_token_ids] for r in reqs], [out[r.id] for r in reqs]


PROMPTS = ["def main(", "import os\n", "class Runner:"]


@pytest.mark.parametrize("topk,n", [(1, 4), (2, 6)], ids=["chain", "tree"])
@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.kind}-{'schema' if s.value else 'any'}")
def test_speculative_output_equals_target_only_under_a_grammar(tiny, spec, topk, n):
    tok, target, draft = tiny
    compiled = compile_spec(spec, tok)
    ref = Runner(target, max_total_tokens=1024, max_running_requests=4, context_length=CONTEXT_LENGTH)
    want, raw = generate(ref, tok, spec, compiled, PROMPTS)
    spec_runner = Runner(target, draft, SpecSettings("EAGLE", 3, topk, n), max_total_tokens=1024,
                         max_running_requests=4, context_length=CONTEXT_LENGTH)
    got, _ = generate(spec_runner, tok, spec, compiled, PROMPTS)
    assert got == want
    assert spec_runner.num_draft_tokens_accepted > 0  # the drafts propose under the grammar's mask too
    bounded = not (spec.kind == "json" and spec.value is None)  # any JSON object may go on past 48 tokens
    for ids, whole in zip(want, raw):
        if bounded:
            assert whole[-1] in tok.eos_token_ids, "the grammar ended the output"
        if whole[-1] in tok.eos_token_ids:
            assert parses(spec, tok.decode(ids)), tok.decode(ids)


def test_sampled_outputs_parse(tiny):
    tok, target, draft = tiny
    spec = SPECS[0]
    compiled = compile_spec(spec, tok)
    runner = Runner(target, draft, SpecSettings("EAGLE", 3, 2, 5), max_total_tokens=2048, max_running_requests=8,
                    context_length=CONTEXT_LENGTH)
    outs, raw = generate(runner, tok, spec, compiled, PROMPTS * 2, temperature=1.0, seed=11)
    for ids, whole in zip(outs, raw):
        if whole[-1] in tok.eos_token_ids:
            assert parses(spec, tok.decode(ids))
    assert sum(whole[-1] in tok.eos_token_ids for whole in raw) >= 4
    assert len({tuple(o) for o in outs}) > 1


def test_json_schema_through_the_client(client, server):
    out = client.chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": "a record"}], max_tokens=64, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "record", "schema": SCHEMA}}, n=2)
    for choice in out.choices:
        assert choice.finish_reason == "stop"
        jsonschema_rs.validate(SCHEMA, json.loads(choice.message.content))
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": "a record"}], max_tokens=64, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "record", "schema": SCHEMA}}, stream=True)
        if c.choices)
    assert streamed == out.choices[0].message.content
    obj = client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": "x"}],
                                         max_tokens=96, temperature=0, response_format={"type": "json_object"})
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.choices[0].message.content), dict)
    choice = client.completions.create(model=server.model, prompt="colour:", max_tokens=8, temperature=0,
                                       extra_body={"guided_choice": ["red", "green", "blue"]})
    assert choice.choices[0].text in ("red", "green", "blue")
    regex = client.completions.create(model=server.model, prompt="answer:", max_tokens=16, temperature=0,
                                      extra_body={"guided_regex": r"(yes|no), [a-z]{2,5}!"})
    assert re.fullmatch(r"(yes|no), [a-z]{2,5}!", regex.choices[0].text)


@pytest.mark.parametrize("extra,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "sometimes"}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object",
                                                                                      "minProperties": "two"}}}},
     "response_format"),
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_regex": "a+", "guided_choice": ["a"]}, "guided_choice"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
])
def test_grammars_that_cannot_compile_are_400s(server, extra, param):
    body = {"model": server.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **extra}
    assert_error(post(server, "/v1/chat/completions", body), 400, param=param)
    assert_still_serving(server)


def test_a_grammar_pickles_with_its_state(tiny):
    """Tensor-parallel ranks get each request pickled: its matcher must arrive in the same state."""
    import pickle

    tok = tiny[0]
    g = compile_spec(SPECS[2], tok).matcher()
    g.accept(tok.encode("yes", add_special_tokens=False))
    copy = pickle.loads(pickle.dumps(g))
    assert copy.accepted == g.accepted
    assert (copy.masks([0], [-1]) == g.masks([0], [-1])).all()
