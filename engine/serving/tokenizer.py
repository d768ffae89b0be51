"""Tokenizer for the server: HF `tokenizer.json` through the `tokenizers` package, the chat
template from `tokenizer_config.json` (or `chat_template.jinja`) rendered with jinja2, and what
`generation_config.json` says about ending and sampling: its `eos_token_id` list (Llama 3.1
Instruct ends a turn with <|eot_id|>, not the <|end_of_text|> of config.json's tokenizer) and the
default temperature / top_p / top_k a request gets when it names none (`sampling_defaults`; the
model's authors chose them, as transformers' generate and vLLM apply them).

The server never imports transformers: it is slow to import and pulls in far more than we need.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.sandbox
from tokenizers import Tokenizer as _HFTokenizer

# How many already-decoded tokens the incremental detokenizer keeps as left context. Byte-level and
# sentencepiece decoders can render a token differently depending on its neighbours (a leading
# space, a multi-byte character split over tokens), so each delta is decoded with a little context.
_DETOKENIZE_CONTEXT_TOKENS = 5
# encode_at_most: a text up to this many characters per allowed token (and at least
# _COUNT_CHUNK_CHARS) is encoded whole; a longer one is first counted piece by piece, so one that
# cannot fit is refused after encoding about as much of it as would fit, not all of it.
_WHOLE_CHARS_PER_TOKEN = 8
_COUNT_CHUNK_CHARS = 16384


class PromptTooLong(ValueError):
    """A text has more tokens than allowed; `num_tokens` is its count (`exact`) or a lower bound."""

    def __init__(self, num_tokens: int, exact: bool):
        super().__init__(f"{'' if exact else 'at least '}{num_tokens} tokens")
        self.num_tokens, self.exact = num_tokens, exact


class ChatTemplateError(ValueError):
    """The messages cannot be rendered (no template, or the template raised). A client error."""


def _token_content(value: Any) -> str | None:
    # tokenizer_config.json writes special tokens either as "<s>" or as {"content": "<s>", ...}.
    if isinstance(value, dict):
        return value.get("content")
    return value


def _raise_template_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@dataclass
class Tokenizer:
    """Encodes prompts, decodes outputs, renders chat messages. Thread-safe for encode/decode."""

    hf: _HFTokenizer
    chat_template: str | None = None
    bos_token: str | None = None
    eos_token: str | None = None
    add_bos_token: bool = False
    eos_token_ids: set[int] = field(default_factory=set)
    # generation_config.json's sampling fields ({} without one): temperature, top_p, top_k.
    sampling_defaults: dict[str, float] = field(default_factory=dict)
    _compiled_template: jinja2.Template | None = field(default=None, repr=False)

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        path = Path(path)
        hf = _HFTokenizer.from_file(str(path / "tokenizer.json"))
        config = _read_json(path / "tokenizer_config.json")
        # chat_template.jinja, where a repository has one, wins over tokenizer_config.json's entry,
        # as transformers reads them (newer save_pretrained writes the template only there).
        template = config.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
            by_name = {t.get("name"): t.get("template") for t in template}
            template = by_name.get("default") or next(iter(by_name.values()), None)
        if (path / "chat_template.jinja").is_file():
            template = (path / "chat_template.jinja").read_text()
        bos = _token_content(config.get("bos_token"))
        eos = _token_content(config.get("eos_token"))
        tok = cls(hf=hf, chat_template=template, bos_token=bos, eos_token=eos,
                  add_bos_token=bool(config.get("add_bos_token", False)))
        tok.eos_token_ids = _collect_eos_ids(path, hf, eos)
        tok.sampling_defaults = sampling_defaults(_read_json(path / "generation_config.json"))
        return tok

    @property
    def vocab_size(self) -> int:
        return self.hf.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self.hf.encode(text, add_special_tokens=add_special_tokens).ids
        # tokenizer.json's post-processor usually adds BOS itself; add it only where it did not.
        if add_special_tokens and self.add_bos_token and self.bos_token is not None:
            bos_id = self.hf.token_to_id(self.bos_token)
            if bos_id is not None and (not ids or ids[0] != bos_id):
                ids = [bos_id] + ids
        return ids

    def encode_at_most(self, text: str, max_tokens: int, add_special_tokens: bool = True) -> list[int]:
        """encode(), or PromptTooLong when the text has more than max_tokens tokens: found after
        encoding about max_tokens tokens' worth of a much longer text, not all of it (an 8 MB
        prompt costs the CPU seconds to encode, for a request that is refused anyway)."""
        if len(text) > max(_COUNT_CHUNK_CHARS, _WHOLE_CHARS_PER_TOKEN * max_tokens):
            # Pieces encode alone the way the whole does, except the words cut at a boundary:
            # each cut costs at most a margin of one vocabulary entry's length in tokens.
            margin, counted = self.longest_token_chars, 0
            for i, start in enumerate(range(0, len(text), _COUNT_CHUNK_CHARS)):
                piece = text[start:start + _COUNT_CHUNK_CHARS]
                counted += len(self.hf.encode(piece, add_special_tokens=False).ids)
                if counted - i * margin > max_tokens:
                    raise PromptTooLong(counted - i * margin, exact=False)
        ids = self.encode(text, add_special_tokens=add_special_tokens)
        if len(ids) > max_tokens:
            raise PromptTooLong(len(ids), exact=True)
        return ids

    @functools.cached_property
    def longest_token_chars(self) -> int:
        """The most characters one token spells (added tokens included)."""
        return max((len(t) for t in self.hf.get_vocab(with_added_tokens=True)), default=1)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None) -> str:
        if self.chat_template is None:
            raise ChatTemplateError("this model has no chat template; use /v1/completions")
        if self._compiled_template is None:
            # The same environment settings as HF's renderer, so templates written for it render
            # identically; sandboxed because the template comes with the model.
            env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                               extensions=["jinja2.ext.loopcontrols"])
            env.filters["tojson"] = lambda v, indent=None: json.dumps(v, indent=indent, ensure_ascii=False)
            env.globals["raise_exception"] = _raise_template_exception
            env.globals["strftime_now"] = _strftime_now
            self._compiled_template = env.from_string(self.chat_template)
        try:
            return self._compiled_template.render(
                messages=messages, add_generation_prompt=add_generation_prompt, tools=tools,
                bos_token=self.bos_token or "", eos_token=self.eos_token or "")
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template failed: {e}") from e

    def encode_chat(self, messages: list[dict[str, Any]], max_tokens: int | None = None,
                    tools: list[dict[str, Any]] | None = None) -> list[int]:
        # The rendered template already carries BOS where the model wants it.
        text = self.apply_chat_template(messages, tools=tools)
        if max_tokens is None:
            return self.encode(text, add_special_tokens=False)
        return self.encode_at_most(text, max_tokens, add_special_tokens=False)


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.exists() else {}


SAMPLING_FIELDS = ("temperature", "top_p", "top_k")


def sampling_defaults(generation_config: dict[str, Any]) -> dict[str, float]:
    """The sampling fields a request inherits: `do_sample: false` means greedy (temperature 0),
    as transformers' generate reads it; otherwise whichever of temperature, top_p, top_k the
    file sets. Values of the wrong type or range are ignored rather than served."""
    if generation_config.get("do_sample") is False:
        return {"temperature": 0.0}
    out: dict[str, float] = {}
    for name in SAMPLING_FIELDS:
        value = generation_config.get(name)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if (name == "temperature" and 0 <= value <= 2) or (name == "top_p" and 0 < value <= 1) or \
                (name == "top_k" and value >= 0 and float(value).is_integer()):
            out[name] = int(value) if name == "top_k" else float(value)
    return out


def _collect_eos_ids(path: Path, hf: _HFTokenizer, eos_token: str | None) -> set[int]:
    """EOS ids from every place a HF model directory may declare them (chat models often list
    several, e.g. Llama 3's <|end_of_text|> and <|eot_id|> in generation_config.json)."""
    ids: set[int] = set()
    if eos_token is not None and hf.token_to_id(eos_token) is not None:
        ids.add(hf.token_to_id(eos_token))
    for name in ("generation_config.json", "config.json"):
        value = _read_json(path / name).get("eos_token_id")
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(int(v) for v in value)
    return ids


class IncrementalDetokenizer:
    """Turns a growing list of output token ids into text deltas.

    A token can end in the middle of a UTF-8 character (byte-level BPE); such text decodes to
    U+FFFD and is held back until the next token completes it.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int]):
        self._tokenizer = tokenizer
        self._ids = list(prompt_ids[-_DETOKENIZE_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)

    def add(self, token_ids: list[int]) -> str:
        self._ids.extend(token_ids)
        prefix_text = self._tokenizer.decode(self._ids[self._prefix_offset:self._read_offset])
        full_text = self._tokenizer.decode(self._ids[self._prefix_offset:])
        if len(full_text) <= len(prefix_text) or full_text.endswith("\ufffd"):
            return ""
        delta = full_text[len(prefix_text):]
        self._prefix_offset = max(self._read_offset, len(self._ids) - _DETOKENIZE_CONTEXT_TOKENS)
        self._read_offset = len(self._ids)
        return delta

    def flush(self) -> str:
        """The text still held back (an incomplete character at the very end), as it decodes now."""
        prefix_text = self._tokenizer.decode(self._ids[self._prefix_offset:self._read_offset])
        full_text = self._tokenizer.decode(self._ids[self._prefix_offset:])
        self._prefix_offset = self._read_offset = len(self._ids)
        return full_text[len(prefix_text):]
