"""The OpenAI request fields beyond plain sampling, and the response pieces they produce.

Request side: the fields that change the target's distribution or what is reported about it
(penalties, `logit_bias`, `min_tokens`, `logprobs` / `top_logprobs`, `echo`, `n`, `best_of`,
structured output, tools) are declared here once, checked against the tokenizer and the
engine's limits, and turned into the runner's `LogitControls` (engine/runtime/sampling.py).
A bad value raises `FieldError` naming the field; the server answers it with a 400.

Response side: log-probabilities in the two shapes OpenAI uses: the legacy completions object
(`tokens`, `token_logprobs`, `top_logprobs`, `text_offset`) and chat's `content` list
(`token`, `logprob`, `bytes`, `top_logprobs`).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from specdeploy.engine.runtime.sampling import LogitControls

# The most top log-probabilities a request may ask for per token (vLLM's default max_logprobs).
MAX_LOGPROBS = 20
# OpenAI's range for logit_bias values, and a bound on how many entries one request may bias.
LOGIT_BIAS_LIMIT = 100.0
MAX_LOGIT_BIAS_ENTRIES = 1024


class FieldError(ValueError):
    """A request field the engine refuses: -> HTTP 400 with `param`."""

    def __init__(self, param: str, message: str):
        super().__init__(f"{param}: {message}")
        self.param = param


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class JsonSchemaFormat(_Strict):
    name: str = "response"
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class ControlFields(_Strict):
    """Mixed into both request bodies (server.py)."""

    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0)
    logit_bias: dict[str, float] | None = None
    min_tokens: int = Field(0, ge=0)
    n: int = Field(1, ge=1)
    response_format: ResponseFormat | None = None
    # vLLM's guided decoding fields (one at most, or response_format).
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None


def logit_bias(body: ControlFields, vocab_size: int) -> dict[int, float]:
    """{"token id": bias} -> {id: bias}, every id in the vocabulary, every bias in [-100, 100]."""
    out: dict[int, float] = {}
    items = (body.logit_bias or {}).items()
    if len(items) > MAX_LOGIT_BIAS_ENTRIES:
        raise FieldError("logit_bias", f"at most {MAX_LOGIT_BIAS_ENTRIES} entries, got {len(items)}")
    for key, value in items:
        try:
            tok = int(key)
        except ValueError:
            raise FieldError("logit_bias", f"key {key!r} is not a token id") from None
        if not 0 <= tok < vocab_size:
            raise FieldError("logit_bias", f"token id {tok} is outside the vocabulary [0, {vocab_size})")
        if not -LOGIT_BIAS_LIMIT <= value <= LOGIT_BIAS_LIMIT:
            raise FieldError("logit_bias", f"bias {value} of token {tok} is outside [-100, 100]")
        out[tok] = float(value)
    return out


def check_logprobs(param: str, value: int | None) -> None:
    if value is not None and not 0 <= value <= MAX_LOGPROBS:
        raise FieldError(param, f"must be in [0, {MAX_LOGPROBS}], got {value}")


def controls(body: ControlFields, vocab_size: int, max_tokens: int, *, logprobs: int | None = None,
             prompt_logprobs: int | None = None, grammar=None) -> LogitControls | None:
    """The request's LogitControls, or None when it asks for nothing beyond sampling (it then
    runs the captured decode graphs)."""
    bias = logit_bias(body, vocab_size)
    if body.min_tokens > max_tokens:
        raise FieldError("min_tokens", f"{body.min_tokens} is more than max_tokens ({max_tokens})")
    c = LogitControls(presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
                      repetition_penalty=body.repetition_penalty, logit_bias=bias, min_tokens=body.min_tokens,
                      logprobs=logprobs, prompt_logprobs=prompt_logprobs, grammar=grammar)
    if not (c.penalized or bias or c.min_tokens or grammar is not None or logprobs is not None
            or prompt_logprobs is not None):
        return None
    return c


def controls_param(body) -> str:
    """The first field of a body that asks for LogitControls (for a refusal naming it): its
    log-probabilities, a ControlFields field (but `n`) or a tool choice away from its declared
    default."""
    declared = type(body).model_fields
    names = ("logprobs", "top_logprobs", *(n for n in ControlFields.model_fields if n != "n"), "tool_choice")
    for name in names:
        if name not in declared:
            continue
        value = getattr(body, name)
        if value not in (declared[name].default, False, {}) and not (name == "response_format" and value.type == "text"):
            return name
    return "tools"


# ---- log-probabilities in responses ----------------------------------------------------------

def _byte_level_table() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the character that stands for each byte in a vocabulary."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[chr(byte)] = byte
        else:
            chars[chr(256 + extra)] = byte
            extra += 1
    return chars


_BYTE_LEVEL = _byte_level_table()


def token_bytes(tokenizer, token_id: int) -> bytes:
    """The bytes a token stands for: a byte-level vocabulary's piece mapped back to bytes, else
    the UTF-8 of its decoded text."""
    piece = tokenizer.hf.id_to_token(token_id)
    if piece is not None and all(ch in _BYTE_LEVEL for ch in piece):
        return bytes(_BYTE_LEVEL[ch] for ch in piece)
    return tokenizer.decode([token_id], skip_special_tokens=False).encode("utf-8")


def token_text(tokenizer, token_id: int) -> str:
    """A token as text; one that is part of a UTF-8 character is written "bytes:\\xe2\\x80", as
    OpenAI writes it."""
    text = tokenizer.decode([token_id], skip_special_tokens=False)
    if "\ufffd" not in text:
        return text
    return "bytes:" + "".join(f"\\x{b:02x}" for b in token_bytes(tokenizer, token_id))


def completion_logprobs(tokenizer, token_ids: list[int], entries: list, want_top: int,
                        offset: int = 0) -> dict[str, Any]:
    """The legacy completions `logprobs` object. entries: one (logprob, [(id, logprob)]) per
    token, or None (the echoed prompt's first token, which nothing predicts)."""
    tokens, lps, tops, offsets = [], [], [], []
    at = offset
    for tok, entry in zip(token_ids, entries):
        text = token_text(tokenizer, tok)
        tokens.append(text)
        offsets.append(at)
        at += len(text)
        if entry is None:
            lps.append(None)
            tops.append(None)
            continue
        lp, top = entry
        lps.append(lp)
        top_map = {token_text(tokenizer, t): v for t, v in top[:want_top]}
        if want_top:
            top_map.setdefault(text, lp)  # OpenAI's top_logprobs include the chosen token
        tops.append(top_map)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(tokenizer, token_ids: list[int], entries: list, want_top: int) -> dict[str, Any]:
    def one(tok: int, lp: float) -> dict[str, Any]:
        text = token_text(tokenizer, tok)
        return {"token": text, "logprob": lp, "bytes": list(token_bytes(tokenizer, tok))}

    content = []
    for tok, (lp, top) in zip(token_ids, entries):
        item = one(tok, lp)
        item["top_logprobs"] = [one(t, v) for t, v in top[:want_top]]
        content.append(item)
    return {"content": content, "refusal": None}
