"""The options the resource, `specdeploy plan` and `engine serve` share, declared once.

Each field of `EngineOptions` is one option: its default (the planner's), the help both commands
print, where the resource holds it (`spec.speculative.numSteps`), and the spellings an older
release used. `add_arguments` generates a command's flags from these fields, so `--num-steps`
means the same in both commands; the operator fills a resource's missing fields from `DEFAULTS`.

Context length, without one given: the planner's 8192, capped at the target's
max_position_embeddings (`default_context_length`); the operator plans the resource's
contextLength as it is (8192 when unset) and notes one beyond the target's maximum.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import Any

from specdeploy.engine.planner.shapes import DRAFT_QUANTIZATIONS, KV_CACHE_DTYPES


@dataclass(frozen=True)
class Option:
    """How one EngineOptions field appears: on a command line and in the resource."""

    help: str
    metavar: str | None = None
    choices: tuple[str, ...] | None = None
    resource: str = ""  # "section.field" under the resource's spec; "" where it has none
    old_flags: tuple[str, ...] = ()  # earlier spellings, still parsed, not shown
    # The command resolves an unset value itself (it depends on the model): the flag's default
    # stays None in every command.
    resolved_later: bool = False


def _option(default: Any, help: str, **how: Any) -> Any:
    return dataclasses.field(default=default, metadata={"option": Option(help, **how)})


_CONTEXT_LENGTH = 8192


@dataclass(frozen=True)
class EngineOptions:
    num_steps: int = _option(3, "draft steps per verify step (the draft's depth)", metavar="S",
                             resource="speculative.numSteps", old_flags=("--steps",))
    topk: int = _option(1, "branches kept per draft step", metavar="K", resource="speculative.topk")
    num_draft_tokens: int | None = _option(
        None, "tokens verified per request per step, the root included (default num_steps + 1)", metavar="N",
        resource="speculative.numDraftTokens", old_flags=("--draft-tokens",))
    adaptive_speculation: bool = _option(
        False, "choose the speculative shape each step (NONE, chains up to --num-steps, the configured shape) "
        "from the batch size, the measured acceptance and step costs measured at start-up",
        resource="speculative.adaptive")
    max_running_requests: int = _option(32, "concurrent requests, also the largest CUDA-graph batch", metavar="R",
                                        resource="engine.maxRunningRequests")
    context_length: int = _option(
        _CONTEXT_LENGTH, "tokens per request the KV pool holds for every running request at once (default "
        f"{_CONTEXT_LENGTH}, or the target's max_position_embeddings when smaller)", metavar="L", resource="engine.contextLength",
        resolved_later=True)
    kv_cache_dtype: str = _option(
        "auto", "KV cache storage: auto (the compute dtype) or fp8_e4m3 (e4m3 codes with per-layer scales: half "
        "the bytes per token of bf16)", choices=tuple(KV_CACHE_DTYPES), resource="engine.kvCacheDtype")
    draft_quantization: str = _option(
        "none", "the draft head's weights: none (as its checkpoint stores them) or fp8 (its linears quantized to "
        "e4m3 with 128 x 128 block scales as they load, EAGLE-3's own lm_head too: Llama-3.1-8B's EAGLE-3 head "
        "0.79 -> 0.40 GiB; embeddings and norms stay; the target still verifies every token)", choices=DRAFT_QUANTIZATIONS,
        resource="speculative.draftQuantization")
    prefix_cache: bool = _option(
        True, "reuse the KV of shared prompt prefixes (system prompts, chat history) held in the KV pool's "
        "unused slots", resource="engine.prefixCache")
    extend_graphs: bool = _option(
        True, "replay CUDA graphs for a prefill chunk of one request and at most 256 tokens (a prefix-cache hit's "
        "remainder) instead of running it eagerly; the plan's CUDA-graph pool holds them",
        resource="engine.extendGraphs")


DEFAULTS = EngineOptions()


def option(name: str) -> Option:
    """The Option of EngineOptions' field `name`."""
    return _FIELDS[name].metadata["option"]


def flag(name: str) -> str:
    """The command-line spelling of a field: num_steps -> --num-steps."""
    return "--" + name.replace("_", "-")


def resource_fields() -> dict[str, str]:
    """{field name: its "section.field" in the resource's spec} for the fields the resource has."""
    return {f.name: option(f.name).resource for f in dataclasses.fields(EngineOptions) if option(f.name).resource}


def add_arguments(parser: argparse.ArgumentParser, names: tuple[str, ...], *, defaults: bool,
                  note: str = "") -> None:
    """Add the flags of EngineOptions' fields `names` to `parser`, their help from the fields.
    defaults: the flags default to the field's value; else to None, so that a command can tell a
    value given from one left out (engine serve with --plan compares only what was given).
    note: appended to every help (what else decides an unset value)."""
    for name in names:
        how, default = option(name), _FIELDS[name].default
        shown = ("" if default is None or how.resolved_later else
                 f" (default {_shown(default)}{'' if isinstance(default, bool) else note})")
        kwargs: dict[str, Any] = {"dest": name}
        if isinstance(default, bool):  # an on/off switch keeps its default in every command
            kwargs.update(action=argparse.BooleanOptionalAction if default else "store_true", default=default)
        else:
            kwargs.update(type=type(default) if default is not None else int, metavar=how.metavar,
                          choices=how.choices, default=default if defaults and not how.resolved_later else None)
            if how.choices:
                del kwargs["metavar"]
        parser.add_argument(flag(name), help=how.help + shown, **kwargs)
        for old in how.old_flags:
            parser.add_argument(old, **{**kwargs, "default": argparse.SUPPRESS}, help=argparse.SUPPRESS)


def options_from_args(args: argparse.Namespace) -> EngineOptions:
    """EngineOptions of a command's parsed flags; a field's default where its flag was left out
    (None) or the command has none. An unset context_length is the default, uncapped: a command
    that knows the target takes default_context_length instead."""
    given = {name: getattr(args, name) for name in _FIELDS if getattr(args, name, None) is not None}
    return dataclasses.replace(DEFAULTS, **given)


def _shown(value: Any) -> str:
    return ("on" if value else "off") if isinstance(value, bool) else str(value)


def model_max_context(config: Any) -> int | None:
    """A target config's max_position_embeddings (under text_config for a multimodal one), or
    None where it has none that reads as a positive int."""
    c: dict = config if isinstance(config, dict) else {}
    text = c.get("text_config")
    c = text if isinstance(text, dict) else c
    limit = c.get("max_position_embeddings")
    return limit if isinstance(limit, int) and not isinstance(limit, bool) and limit > 0 else None


def default_context_length(config: Any) -> int:
    """The context length a command plans without one given: the default, capped at the target's
    max_position_embeddings."""
    limit = model_max_context(config)
    return min(DEFAULTS.context_length, limit or DEFAULTS.context_length)


_FIELDS = {f.name: f for f in dataclasses.fields(EngineOptions)}
