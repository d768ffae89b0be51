"""Tool calls: the two reply formats parsed (whole and streamed), tools rendered through the
model's template, required / named choices enforced by the grammar engine (speculative output
equal to target-only's under them), through the `openai` client against servers whose tiny
model has a Hermes-style (Qwen3) or a Llama-3.1-style tool template."""

from __future__ import annotations

import json
import shutil

import jsonschema_rs
import openai
import pytest

from specdeploy.engine.demo.toy import copy_draft, predictable_target, tiny_config
from specdeploy.engine.runtime.runner import Request, Runner
from specdeploy.engine.planner.plan import SpecSettings
from specdeploy.engine.runtime.sampling import LogitControls
from specdeploy.engine.serving import tools
from specdeploy.engine.serving.tokenizer import Tokenizer
from api_errors import assert_error, assert_still_serving, post
from engine_server import CONTEXT_LENGTH, MODEL_NAME, free_port, serve_argv

# Qwen3's tool branches (its template, shortened: no thinking, no multi-part content).
HERMES_TEMPLATE = (
    "{%- if tools %}<|system|>"
    "{%- if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{%- endif %}"
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
    "{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\n</tool_call><|end|>\n"
    "{%- elif messages[0].role == 'system' %}<|system|>{{ messages[0].content }}<|end|>\n{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' %}<|user|>{{ message.content }}<|end|>\n"
    "{%- elif message.role == 'assistant' %}<|assistant|>{{ message.content or '' }}"
    "{%- for tc in message.tool_calls or [] %}\n<tool_call>\n{\"name\": \"{{ tc.function.name }}\", "
    "\"arguments\": {{ tc.function.arguments | tojson }}}\n</tool_call>{%- endfor %}<|end|>\n"
    "{%- elif message.role == 'tool' %}<|user|>\n<tool_response>\n{{ message.content }}\n</tool_response><|end|>\n"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|assistant|>{%- endif %}")

# Llama 3.1's JSON tool calling (its template, shortened: tools in the first user turn).
LLAMA_TEMPLATE = (
    "{{ bos_token }}{%- if not tools is defined %}{%- set tools = none %}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' and loop.first and tools is not none %}<|user|>"
    "Given the following functions, please respond with a JSON for a function call with its proper arguments "
    "that best answers the given prompt.\n\nRespond in the format {\"name\": function name, \"parameters\": "
    "dictionary of argument name and its value}. Do not use variables.\n\n"
    "{%- for t in tools %}{{ t | tojson }}\n\n{%- endfor %}{{ message.content }}<|end|>"
    "{%- elif message.role == 'assistant' and message.tool_calls %}<|assistant|>"
    "{%- for tc in message.tool_calls %}{\"name\": \"{{ tc.function.name }}\", \"parameters\": "
    "{{ tc.function.arguments | tojson }}}{%- endfor %}<|end|>"
    "{%- elif message.role == 'tool' %}<|user|>{{ message.content }}<|end|>"
    "{%- else %}<|{{ message.role }}|>{{ message.content }}<|end|>{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|assistant|>{%- endif %}")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "days"],
                   "properties": {"city": {"type": "string", "maxLength": 8},
                                  "days": {"type": "integer", "minimum": 1, "maximum": 7}}}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "additionalProperties": False, "required": ["zone"],
                                       "properties": {"zone": {"enum": ["UTC", "CET", "PST"]}}}}}
LONG_CONTEXT = 2048
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}


def test_hermes_replies_parse():
    text = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n' \
           '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>'
    content, calls = tools.parse(text, "hermes")
    assert content == "Let me check."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Oslo", "days": 2}), ("get_time", {"zone": "CET"})]
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)
    assert tools.parse("no call here", "hermes") == ("no call here", [])
    assert tools.parse("<tool_call>\n{broken\n</tool_call>", "hermes")[1] == []


def test_llama_json_replies_parse():
    content, calls = tools.parse('<|python_tag|>{"name": "get_time", "parameters": {"zone": "UTC"}}; '
                                 '{"name": "get_weather", "parameters": {"city": "Rome", "days": 1}}', "llama3_json")
    assert content is None and [c["function"]["name"] for c in calls] == ["get_time", "get_weather"]
    assert json.loads(calls[1]["function"]["arguments"]) == {"city": "Rome", "days": 1}
    assert tools.parse("The weather is fine.", "llama3_json") == ("The weather is fine.", [])
    assert tools.parse('{"not": "a call"}', "llama3_json")[1] == []


@pytest.mark.parametrize("fmt,text", [
    ("hermes", 'Sure. <tool_call>\n{"name": "get_time", "arguments": {"zone": "PST"}}\n</tool_call>'),
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {"a": "x}\\"{", "b": [1, {"c": 2}]}}\n</tool_call>\n'
               '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'),
    ("llama3_json", '{"name": "get_time", "parameters": {"zone": "PST"}}'),
    ("llama3_json", '{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {"y": "}"}}'),
    ("hermes", "Just text, with a < sign and <tool but no call."),
])
def test_streamed_replies_split_content_from_calls(fmt, text):
    stream, streamed, events = tools.ToolStream(fmt), "", []
    for i in range(0, len(text), 3):
        content, more = stream.feed(text[i:i + 3])
        streamed, events = streamed + content, events + more
    tail, more, calls = stream.finish()
    events += more
    content, want = tools.parse(text, fmt)
    assert [c["function"] for c in calls] == [c["function"] for c in want]
    # The deltas, accumulated as clients do, give the calls.
    acc = {}
    for e in events:
        entry = acc.setdefault(e["index"], {"name": "", "arguments": ""})
        entry["name"] += e["function"].get("name") or ""
        entry["arguments"] += e["function"].get("arguments") or ""
    assert [(acc[k]["name"], json.loads(acc[k]["arguments"])) for k in sorted(acc)] == [
        (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in want]
    if want:
        assert (streamed + tail).strip() == (content or "")
        assert len([e for e in events if "arguments" in e["function"] and e["function"]["arguments"]]) > 1
    else:
        assert streamed + tail == text


@pytest.fixture(scope="module")
def tool_servers(model_dirs, tmp_path_factory):
    """Servers of the tiny pair with a Hermes-style and a Llama-style tool template."""
    from specdeploy.engine.serving.cli import ServerThread

    running = {}
    for fmt, template in (("hermes", HERMES_TEMPLATE), ("llama3_json", LLAMA_TEMPLATE)):
        root = tmp_path_factory.mktemp(fmt)
        target, draft = root / "target", root / "draft"
        for src, dst in zip(model_dirs, (target, draft)):
            shutil.copytree(src, dst)
            # The same weights with a longer context: tool signatures are long in a 320-token vocabulary.
            config = json.loads((dst / "config.json").read_text())
            config["max_position_embeddings"] = LONG_CONTEXT
            (dst / "config.json").write_text(json.dumps(config))
        config = json.loads((target / "tokenizer_config.json").read_text())
        config["chat_template"] = template
        (target / "tokenizer_config.json").write_text(json.dumps(config))
        (target / "chat_template.jinja").unlink(missing_ok=True)
        argv = serve_argv(target, draft, free_port(), "--context-length", str(LONG_CONTEXT), "--max-total-tokens",
                          str(8 * LONG_CONTEXT))
        running[fmt] = ServerThread(argv).start(timeout_s=120)
    yield {fmt: r.base_url for fmt, r in running.items()}
    for r in running.values():
        r.stop()


def client_of(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


MESSAGES = [{"role": "user", "content": "What is the weather in Oslo?"}]


@pytest.mark.parametrize("fmt", ["hermes", "llama3_json"])
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}],
                         ids=["required", "named"])
def test_required_and_named_choices_give_valid_calls(tool_servers, fmt, choice):
    client = client_of(tool_servers[fmt])
    kwargs = dict(model=MODEL_NAME, messages=MESSAGES, tools=[WEATHER, TIME], tool_choice=choice, max_tokens=200,
                  temperature=0)
    out = client.chat.completions.create(**kwargs)
    c = out.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.tool_calls, c
    for call in c.message.tool_calls:
        if isinstance(choice, dict):
            assert call.function.name == "get_time"
        jsonschema_rs.validate(SCHEMAS[call.function.name], json.loads(call.function.arguments))
    # Streamed: the same call, assembled from its deltas.
    calls, finish = {}, None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for ch in chunk.choices:
            finish = ch.finish_reason or finish
            for d in ch.delta.tool_calls or []:
                entry = calls.setdefault(d.index, {"name": "", "arguments": ""})
                if d.function and d.function.name:
                    entry["name"] = d.function.name
                if d.function and d.function.arguments:
                    entry["arguments"] += d.function.arguments
    assert finish == "tool_calls"
    assert [(v["name"], json.loads(v["arguments"])) for _, v in sorted(calls.items())] == [
        (t.function.name, json.loads(t.function.arguments)) for t in c.message.tool_calls]


@pytest.mark.parametrize("fmt", ["hermes", "llama3_json"])
def test_tools_are_rendered_unless_none(tool_servers, fmt):
    client = client_of(tool_servers[fmt])
    base = dict(model=MODEL_NAME, messages=MESSAGES, max_tokens=4, temperature=0)
    bare = client.chat.completions.create(**base).usage.prompt_tokens
    auto = client.chat.completions.create(tools=[WEATHER], **base)
    none = client.chat.completions.create(tools=[WEATHER], tool_choice="none", **base)
    assert auto.usage.prompt_tokens > bare + 20  # the signature is in the prompt
    assert none.usage.prompt_tokens == bare and not none.choices[0].message.tool_calls
    # A conversation that carries a call and its result renders (arguments as clients send them: a string).
    turn = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": '{"city": "Oslo", "days": 1}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    out = client.chat.completions.create(model=MODEL_NAME, messages=turn, tools=[WEATHER], max_tokens=4, temperature=0)
    assert out.usage.prompt_tokens > auto.usage.prompt_tokens


@pytest.mark.parametrize("extra,param", [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "banana"}}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
])
def test_bad_tools_are_400s(tool_servers, extra, param):
    class S:
        url = tool_servers["hermes"]
        model = MODEL_NAME
    body = {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 4, **extra}
    assert_error(post(S, "/v1/chat/completions", body), 400, param=param)
    assert_still_serving(S)


def test_speculative_equals_target_only_under_a_required_tool_choice(model_dirs):
    tok = Tokenizer.from_dir(model_dirs[0])
    cfg = tiny_config(vocab_size=tok.hf.get_vocab_size(), max_position_embeddings=CONTEXT_LENGTH)
    target, perm = predictable_target(cfg, seed=0)
    draft = copy_draft("EAGLE", target, perm)

    class Body(tools.ToolFields):
        pass
    for fmt, template in (("hermes", HERMES_TEMPLATE), ("llama3_json", LLAMA_TEMPLATE)):
        req = tools.tool_request(Body(tools=[WEATHER, TIME], tool_choice="required"), template)
        assert req.fmt == fmt
        compiled = tools.call_grammar(req, tok)
        outs = []
        for runner in (Runner(target, max_total_tokens=1024, max_running_requests=4, context_length=CONTEXT_LENGTH),
                       Runner(target, draft, SpecSettings("EAGLE", 3, 1, 4), max_total_tokens=1024,
                              max_running_requests=4, context_length=CONTEXT_LENGTH)):
            reqs = [Request(f"r{i}", tok.encode(p), 200, stop_token_ids=set(tok.eos_token_ids),
                            controls=LogitControls(grammar=compiled.matcher()))
                    for i, p in enumerate(["weather?", "time?"])]
            for r in reqs:
                runner.add(r)
            got = {r.id: [] for r in reqs}
            while runner.num_running:
                for o in runner.step():
                    got[o.req_id] += o.token_ids
            outs.append(got)
        assert outs[0] == outs[1]
        for ids in outs[0].values():
            _, calls = tools.parse(tok.decode(ids), fmt)
            assert len(calls) == 1, (tok.decode(ids), ids[-3:])
            jsonschema_rs.validate(SCHEMAS[calls[0]["function"]["name"]], json.loads(calls[0]["function"]["arguments"]))
