"""Structured output: JSON (any object, or a JSON Schema), a regular expression or a choice of
strings, through xgrammar (imported on the first such request: it loads transformers).

A request's grammar is compiled once (a compile error is a 400 naming the field) and gives each
of its choices its own `Grammar`: an xgrammar matcher kept in step with the tokens the choice
emits, which the runner asks for allowed-token masks (engine/runtime/sampling.py). For a draft
tree it gives one mask per node, the matcher advanced along the path root → node and rolled
back: the verify pass then compares every draft token against the target's logits masked as
target-only decoding would have masked them at that point, so speculative output under a
grammar is target-only's. A draft token the grammar forbids is never accepted (its
probability is zero); the draft also proposes under the mask (each node to expand with its own
path), which only raises acceptance.
"""

from __future__ import annotations

import json
import re
import threading
from dataclasses import dataclass
from typing import Any

import torch

from specdeploy.engine.serving.openai_fields import FieldError

# JSON output without free whitespace between tokens: a model cannot loop on spaces forever.
_JSON_OPTIONS = dict(any_whitespace=False)

_compilers: dict[int, Any] = {}
_lock = threading.Lock()


def _compiler(tokenizer):
    """One xgrammar compiler per tokenizer (its vocabulary preprocessed once)."""
    import xgrammar as xgr
    from transformers import PreTrainedTokenizerFast

    with _lock:
        compiler = _compilers.get(id(tokenizer))
        if compiler is None:
            fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer.hf)
            info = xgr.TokenizerInfo.from_huggingface(fast, vocab_size=tokenizer.vocab_size,
                                                      stop_token_ids=sorted(tokenizer.eos_token_ids) or None)
            compiler = _compilers[id(tokenizer)] = xgr.GrammarCompiler(info, max_threads=2)
        return compiler


@dataclass(frozen=True)
class GrammarSpec:
    """What a request constrains its output to: kind "json" (value: a schema, or None for any
    JSON object), "regex" or "choice" (a list of strings); `param` names its field."""
    kind: str
    value: Any
    param: str


def request_spec(body) -> GrammarSpec | None:
    """The grammar a request body names (response_format, or vLLM's guided_json / guided_regex /
    guided_choice), at most one."""
    given = []
    rf = getattr(body, "response_format", None)
    if rf is not None and rf.type == "json_object":
        given.append(GrammarSpec("json", None, "response_format"))
    elif rf is not None and rf.type == "json_schema":
        if rf.json_schema is None or rf.json_schema.schema_ is None:
            raise FieldError("response_format", "json_schema needs json_schema.schema")
        given.append(GrammarSpec("json", rf.json_schema.schema_, "response_format"))
    if getattr(body, "guided_json", None) is not None:
        schema = body.guided_json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as e:
                raise FieldError("guided_json", f"not JSON: {e}") from None
        given.append(GrammarSpec("json", schema, "guided_json"))
    if getattr(body, "guided_regex", None) is not None:
        given.append(GrammarSpec("regex", body.guided_regex, "guided_regex"))
    if getattr(body, "guided_choice", None) is not None:
        if not body.guided_choice or any(not c for c in body.guided_choice):
            raise FieldError("guided_choice", "needs one or more non-empty strings")
        given.append(GrammarSpec("choice", list(body.guided_choice), "guided_choice"))
    if len(given) > 1:
        raise FieldError(given[1].param, f"only one of response_format, guided_json, guided_regex and "
                                         f"guided_choice may be given (also {given[0].param})")
    return given[0] if given else None


def compile_spec(spec: GrammarSpec, tokenizer) -> CompiledGrammar:
    """-> the compiled grammar; FieldError (a 400) for a schema or pattern that does not compile.
    Slow for big schemas: the server calls it in a worker thread."""
    compiler = _compiler(tokenizer)
    try:
        if spec.kind == "json" and spec.value is None:  # json_object: an object, as OpenAI's mode gives
            compiled = compiler.compile_json_schema('{"type": "object"}', **_JSON_OPTIONS)
        elif spec.kind == "json":
            check_json_schema(spec.value, spec.param)
            compiled = compiler.compile_json_schema(json.dumps(json_safe_strings(spec.value)), **_JSON_OPTIONS)
        elif spec.kind == "regex":
            compiled = compiler.compile_regex(spec.value)
        else:
            compiled = compiler.compile_regex("|".join(re.escape(c) for c in spec.value))
    except FieldError:
        raise
    except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError / ValueError / its own
        raise FieldError(spec.param, f"the grammar engine cannot compile it: {str(e).splitlines()[0][:300]}") \
            from None
    return CompiledGrammar(compiled, tokenizer.vocab_size)


def json_safe_strings(schema: Any) -> Any:
    """The schema with each length-bounded string also given a pattern that excludes control
    characters: xgrammar's rule for minLength / maxLength strings lets raw U+0000-U+001F through,
    which JSON forbids inside strings (its rule for unbounded strings does exclude them)."""
    if isinstance(schema, list):
        return [json_safe_strings(x) for x in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: json_safe_strings(v) for k, v in schema.items()}
    kinds = out.get("type")
    is_string = kinds == "string" or (isinstance(kinds, list) and kinds == ["string"])
    bounded = "minLength" in out or "maxLength" in out
    if is_string and bounded and not any(k in out for k in ("pattern", "format", "enum", "const")):
        low, high = int(out.get("minLength", 0)), out.get("maxLength")
        out["pattern"] = f'^[^\\u0000-\\u001f"\\\\]{{{low},{"" if high is None else int(high)}}}$'
    return out


def check_json_schema(schema: Any, param: str) -> None:
    """A JSON Schema must at least be an object (or a boolean) whose "type" names JSON types."""
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise FieldError(param, f"a JSON Schema is an object, got {type(schema).__name__}")
    known = {"object", "array", "string", "number", "integer", "boolean", "null"}
    kinds = schema.get("type")
    for kind in kinds if isinstance(kinds, list) else [kinds] if kinds is not None else []:
        if kind not in known:
            raise FieldError(param, f"not a valid JSON Schema: type {kind!r}")
    try:
        import jsonschema_rs

        jsonschema_rs.validator_for(schema)
    except ImportError:
        pass
    except Exception as e:  # noqa: BLE001 - the validator's own error types
        raise FieldError(param, f"not a valid JSON Schema: {str(e).splitlines()[0][:300]}") from None


class CompiledGrammar:
    def __init__(self, compiled, vocab_size: int):
        self.compiled, self.vocab_size = compiled, vocab_size

    def matcher(self) -> Grammar:
        return Grammar(self)


class Grammar:
    """One choice's matcher (sampling.TokenGrammar). Pickles (tensor-parallel ranks each get
    the request, engine/runtime/distributed.py) as its grammar and the tokens it accepted."""

    def __init__(self, compiled: CompiledGrammar, accepted: list[int] | None = None):
        import xgrammar as xgr

        self._xgr = xgr
        self.compiled = compiled
        self.vocab_size = compiled.vocab_size
        self.matcher = xgr.GrammarMatcher(compiled.compiled)
        self._bits = torch.arange(32, dtype=torch.int32)
        self.accepted: list[int] = []
        self.accept(accepted or [])

    def __reduce__(self):
        c = self.compiled.compiled
        return (_rebuild, (c.serialize_json(), c.tokenizer_info.serialize_json(), self.vocab_size,
                           list(self.accepted)))

    def masks(self, tokens: list[int], parents: list[int]) -> torch.Tensor:
        n = len(tokens)
        bitmask = self._xgr.allocate_token_bitmask(n, self.vocab_size)
        m = self.matcher
        if m.is_terminated():
            bitmask.fill_(-1)  # finished: whatever comes is cut by the stop token before it
        else:
            m.fill_next_token_bitmask(bitmask, 0)
        for i in range(1, n):
            path = []
            j = i
            while j > 0:
                path.append(tokens[j])
                j = parents[j]
            accepted = 0
            for tok in reversed(path):
                if m.is_terminated() or not m.accept_token(tok):
                    break
                accepted += 1
            if accepted == len(path) and not m.is_terminated():
                m.fill_next_token_bitmask(bitmask, i)
            else:
                # Unreachable (a token on its path is forbidden, so never accepted) or past the
                # end: any mask will do.
                bitmask[i] = -1
            if accepted:
                m.rollback(accepted)
        allowed = ((bitmask[:, :, None] >> self._bits) & 1).bool().view(n, -1)[:, :self.vocab_size]
        return allowed

    def accept(self, tokens: list[int]) -> None:
        for tok in tokens:
            if self.matcher.is_terminated() or not self.matcher.accept_token(tok):
                return  # the stop token past the end, or the tokens of a finished request
            self.accepted.append(tok)


def _rebuild(compiled_json: str, info_json: str, vocab_size: int, accepted: list[int]) -> Grammar:
    import xgrammar as xgr

    info = xgr.TokenizerInfo.deserialize_json(info_json)
    return Grammar(CompiledGrammar(xgr.CompiledGrammar.deserialize_json(compiled_json, info), vocab_size), accepted)
