"""Tool calls: `tools` / `tool_choice` in, OpenAI `tool_calls` out.

The tools go to the model through its own chat template (the `tools` variable, as transformers
passes it); the reply is parsed in the format the template teaches, found from the template:

    hermes       (Qwen2.5 / Qwen3, Hermes)  <tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>
    llama3_json  (Llama 3.1 / 3.2 / 3.3)    {"name": ..., "parameters": {...}}, several joined by "; "

tool_choice: "none" (the tools are not rendered: the model cannot call them), "auto" (the
model decides; a reply in the call format becomes tool_calls), "required" or a named function:
the grammar engine (structured.py) holds the reply to one call of one of the tools (or the
named one) whose arguments follow its JSON Schema, and speculation keeps target-only's output
under it as under any grammar. Streamed, text before a call streams as content; each call as
deltas: its id, type and name once its head is complete, then its arguments as they come.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from specdeploy.engine.serving.openai_fields import FieldError
from specdeploy.engine.serving import structured

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_HERMES_OPEN, _HERMES_CLOSE = "<tool_call>", "</tool_call>"


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class FunctionDef(_Strict):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(_Strict):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class ToolFields(_Strict):
    """Mixed into the chat body (server.py)."""

    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True


@dataclass
class ToolRequest:
    tools: list[dict[str, Any]]     # as the template reads them: [{"type": "function", "function": {...}}]
    choice: str                     # "auto" | "required" | "named"
    named: str | None
    fmt: str                        # "hermes" | "llama3_json"


def tool_request(body: ToolFields, chat_template: str | None) -> ToolRequest | None:
    """Check tools and tool_choice; -> what to render and enforce, or None (no tools, or "none")."""
    choice = body.tool_choice
    if not body.tools:
        if choice not in (None, "none"):
            raise FieldError("tool_choice", "needs tools")
        return None
    names = []
    for tool in body.tools:
        f = tool.function
        if not _NAME.match(f.name):
            raise FieldError("tools", f"function name {f.name!r}: use 1-64 letters, digits, _ or -")
        if f.name in names:
            raise FieldError("tools", f"function name {f.name!r} given twice")
        names.append(f.name)
        if f.parameters is not None:
            structured.check_json_schema(f.parameters, "tools")
    if choice == "none":
        return None
    named = None
    if isinstance(choice, NamedToolChoice):
        named = choice.function.name
        if named not in names:
            raise FieldError("tool_choice", f"names {named!r}, which is not among the tools")
    if chat_template is None:
        raise FieldError("tools", "this model has no chat template to render tools with")
    fmt = "hermes" if _HERMES_OPEN in chat_template else "llama3_json"
    rendered = [{"type": "function", "function": t.function.model_dump(exclude_none=True)} for t in body.tools]
    return ToolRequest(rendered, "named" if named else (choice or "auto"), named, fmt)


def call_grammar(req: ToolRequest, tokenizer) -> structured.CompiledGrammar | None:
    """required / named: one call of one allowed function, its arguments per its schema."""
    if req.choice == "auto":
        return None
    import xgrammar as xgr

    key = "arguments" if req.fmt == "hermes" else "parameters"
    options = []
    for tool in req.tools:
        f = tool["function"]
        if req.named is not None and f["name"] != req.named:
            continue
        params = structured.json_safe_strings(f.get("parameters") or {"type": "object"})
        schema = {"type": "object", "additionalProperties": False, "required": ["name", key],
                  "properties": {"name": {"const": f["name"]}, key: params}}
        call = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)
        if req.fmt == "hermes":
            call = xgr.Grammar.concat(xgr.Grammar.from_ebnf('root ::= "<tool_call>\\n"'), call,
                                      xgr.Grammar.from_ebnf('root ::= "\\n</tool_call>"'))
        options.append(call)
    grammar = options[0] if len(options) == 1 else xgr.Grammar.union(*options)
    try:
        compiled = structured._compiler(tokenizer).compile_grammar(grammar)
    except Exception as e:  # noqa: BLE001 - xgrammar's errors
        raise FieldError("tools", f"the grammar engine cannot compile the tools' schemas: "
                                  f"{str(e).splitlines()[0][:300]}") from None
    return structured.CompiledGrammar(compiled, tokenizer.vocab_size)


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI messages as chat templates read them: an assistant's tool call arguments as an
    object, not the JSON string clients send back."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if m.get("role") == "assistant" and isinstance(calls, list):
            m = {**m, "tool_calls": [_call_for_template(c) for c in calls]}
        out.append(m)
    return out


def _call_for_template(call: Any) -> Any:
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        return call
    f = dict(call["function"])
    if isinstance(f.get("arguments"), str):
        try:
            f["arguments"] = json.loads(f["arguments"])
        except ValueError:
            pass
    return {**call, "function": f}


# ---- the reply -------------------------------------------------------------------------------

def _call(name: Any, arguments: Any) -> dict[str, Any] | None:
    if not isinstance(name, str) or not isinstance(arguments, (dict, str)):
        return None
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {"name": name, "arguments": args}}


def parse(text: str, fmt: str) -> tuple[str | None, list[dict[str, Any]]]:
    """A whole reply -> (content, tool_calls). Text that is not in the call format is content."""
    if fmt == "hermes":
        at = text.find(_HERMES_OPEN)
        if at < 0:
            return text, []
        calls = []
        for body in re.findall(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", text[at:], re.DOTALL):
            try:
                obj = json.loads(body)
            except ValueError:
                return text, []
            call = _call(obj.get("name"), obj.get("arguments", obj.get("parameters"))) if isinstance(obj, dict) \
                else None
            if call is None:
                return text, []
            calls.append(call)
        content = text[:at].strip()
        return content or None, calls
    stripped = text.strip().removeprefix("<|python_tag|>").strip()
    if not stripped.startswith("{"):
        return text, []
    calls = []
    decoder = json.JSONDecoder()
    at = 0
    while at < len(stripped):
        try:
            obj, end = decoder.raw_decode(stripped, at)
        except ValueError:
            return text, []
        call = _call(obj.get("name"), obj.get("parameters", obj.get("arguments"))) if isinstance(obj, dict) else None
        if call is None:
            return text, []
        calls.append(call)
        at = end
        while at < len(stripped) and stripped[at] in " \n;":
            at += 1
    return None, calls


_CALL_HEAD = re.compile(r'\{\s*"name"\s*:\s*"([^"\\]*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')


class ToolStream:
    """A streamed reply: content streams until the call format starts; then each call streams
    as deltas: its id, type and name once its head (`{"name": ..., "arguments": `) is complete,
    its arguments as they come, up to the brace that closes them (a JSON scan that knows
    strings and escapes). A call whose name follows its arguments is sent whole at the end."""

    def __init__(self, fmt: str):
        self.fmt = fmt
        self.text = ""
        self.sent = 0        # characters of text already streamed as content
        self.in_call = False
        self.scan = 0        # where the next call head is looked for
        self.calls: list[dict[str, Any]] = []   # streamed so far: id, name, arguments
        self._args = None    # the scan state inside a call's arguments: [depth, in string, escaped]

    def feed(self, delta: str) -> tuple[str, list[dict[str, Any]]]:
        """-> (the content to stream now, tool_calls delta entries)."""
        self.text += delta
        content = "" if self.in_call else self._content()
        return content, self._calls() if self.in_call else []

    def _content(self) -> str:
        if self.fmt == "hermes":
            at = self.text.find(_HERMES_OPEN, self.sent)
            if at >= 0:
                self.in_call, self.scan = True, at
                end = at
            else:  # hold back a tail that may begin the tag
                end = len(self.text) - _overlap(self.text, _HERMES_OPEN)
        else:
            head = self.text.lstrip()
            if not head:
                return ""
            if self.sent == 0 and head.startswith("{"):
                self.in_call = True
                return ""
            end = len(self.text)
        out = self.text[self.sent:end]
        self.sent = max(self.sent, end)
        return out

    def _calls(self) -> list[dict[str, Any]]:
        events = []
        while True:
            if self._args is None:
                m = _CALL_HEAD.search(self.text, self.scan)
                if m is None:
                    return events
                call = {"id": f"call_{uuid.uuid4().hex[:24]}", "name": m.group(1), "arguments": ""}
                events.append({"index": len(self.calls), "id": call["id"], "type": "function",
                               "function": {"name": call["name"], "arguments": ""}})
                self.calls.append(call)
                self.scan, self._args = m.end(), [0, False, False]
            depth, in_str, esc = self._args
            start = self.scan
            if depth == 0:  # before the value: whitespace that came after the head
                while start < len(self.text) and self.text[start].isspace():
                    start += 1
            end, done = start, False
            for ch in self.text[start:]:
                end += 1
                if in_str:
                    esc, in_str = (False, True) if esc else (ch == "\\", ch != '"')
                elif ch == '"':
                    in_str = True
                elif ch in "{[":
                    depth += 1
                elif ch in "}]":
                    depth -= 1
                    if depth == 0:
                        done = True
                        break
            self._args = None if done else [depth, in_str, esc]
            piece = self.text[start:end]
            self.scan = end
            if piece:
                self.calls[-1]["arguments"] += piece
                events.append({"index": len(self.calls) - 1, "function": {"arguments": piece}})
            if not done:
                return events

    def finish(self) -> tuple[str, list[dict[str, Any]], list[dict[str, Any]]]:
        """-> (content not streamed yet, tool_calls delta entries still to send, the reply's
        calls as parsed whole)."""
        content, calls = parse(self.text, self.fmt)
        if not calls:
            if self.calls:  # streamed as calls but not one when whole (cut off, say): as streamed
                return "", [], [{"id": c["id"], "type": "function",
                                 "function": {"name": c["name"], "arguments": c["arguments"]}} for c in self.calls]
            rest = self.text[self.sent:]
            self.sent = len(self.text)
            return rest, [], []
        events = []
        for k, call in enumerate(calls[len(self.calls):], start=len(self.calls)):  # not streamed: whole
            events.append({"index": k, "id": call["id"], "type": "function",
                           "function": {"name": call["function"]["name"], "arguments": call["function"]["arguments"]}})
        for c, call in zip(self.calls, calls):
            call["id"] = c["id"]
        return "", events, calls


def _overlap(text: str, tag: str) -> int:
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
