"""Bounds on request fields, checked at the API before anything reaches the engine.

Every value a request carries into the engine thread is bounded here or in the request models
(engine/serving/server.py), so a careless or hostile value is a 400 naming its field, never an
exception inside a batched step: OpenAI's and vLLM's own bounds where they have one (seed is a
signed 64-bit integer, as both declare it), and where they have none, a bound well past any real
use that keeps one request's cost to the step loop small (stop strings are searched in every
step's text, so their count and length are bounded).

Fields that change which tokens come out but that this engine does not implement are refused by
name (400) rather than ignored: a client asking for a logit bias or a JSON schema would
otherwise get a silently different answer. `NOT_IMPLEMENTED` is that list; a field leaves it
when the engine implements it, and is then declared with its default (the value that means off)
in openai_fields.ControlFields, the one description of the fields the engine does implement.
"""

from __future__ import annotations

import re
from typing import Any

INT64_MIN, INT64_MAX = -2**63, 2**63 - 1
# OpenAI documents up to 4 stop sequences; vLLM takes any number. Each is searched in every
# step's new text (and a tail the length of the longest is held back), so both are bounded.
MAX_STOP_SEQUENCES = 16
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 1024
# Lists in a body are bounded before pydantic walks them: validating a union member that does not
# match costs an error per item (2.5 M empty lists as a `prompt` took 18 s of the event loop).
MAX_PROMPTS = 128             # prompts in one /v1/completions list (one is served today)
MAX_PROMPT_TOKEN_IDS = 1 << 21  # token ids in one prompt: past any context length
MAX_CHAT_MESSAGES = 4096
MAX_CONTENT_PARTS = 4096      # parts of one message's content
# A temperature below this samples as greedy (vLLM's _SAMPLING_EPS): a float32 temperature of
# 1e-300 is 0, one of 1e-30 scales logits past any meaning.
MIN_SAMPLING_TEMPERATURE = 1e-5

# field -> values that mean "off" (a client sending the default is served). The openai client
# sends none of these unless asked to.
NOT_IMPLEMENTED: dict[str, tuple[Any, ...]] = {
    "prompt_logprobs": (None,),
    "min_p": (None, 0, 0.0),
    "bad_words": (None, []),
    "allowed_token_ids": (None,),
    "functions": (None, []),
    "function_call": (None, "none"),
    "guided_grammar": (None,),
    "structured_outputs": (None,),
    "suffix": (None, ""),
    "use_beam_search": (None, False),
}


def refused_field(fields: dict[str, Any]) -> str | None:
    """The first field of a request body (its declared and extra fields) that asks for something
    NOT_IMPLEMENTED, or None."""
    for name, neutral in NOT_IMPLEMENTED.items():
        if name in fields and not any(_same(fields[name], n) for n in neutral):
            return name
    return None


def _same(value: Any, neutral: Any) -> bool:
    # True == 1 and False == 0 in Python: `logprobs: true` must not pass as the neutral 1 of best_of.
    return type(value) is type(neutral) and value == neutral or (
        isinstance(value, (int, float)) and not isinstance(value, bool)
        and isinstance(neutral, (int, float)) and not isinstance(neutral, bool) and value == neutral)


_SURROGATE = re.compile("[\ud800-\udfff]")


def lone_surrogate(value: Any, path: str = "") -> str | None:
    """The path ("messages.0.content") of the first string in a JSON value holding a lone UTF-16
    surrogate ("\\ud800" is valid JSON but no text: the tokenizer cannot encode it), or None."""
    if isinstance(value, str):
        return path or "body" if _SURROGATE.search(value) else None
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, list):
        if value and isinstance(value[0], int):  # token ids: no text in them
            return None
        items = enumerate(value)
    else:
        return None
    for key, item in items:
        found = lone_surrogate(item, f"{path}.{key}" if path else str(key))
        if found is not None:
            return found
    return None


def stop_problem(stop: list[str]) -> str | None:
    """What is wrong with a request's stop strings, or None."""
    if len(stop) > MAX_STOP_SEQUENCES:
        return f"at most {MAX_STOP_SEQUENCES} stop sequences, got {len(stop)}"
    if any(s == "" for s in stop):
        return "stop strings must not be empty"
    longest = max((len(s) for s in stop), default=0)
    if longest > MAX_STOP_CHARS:
        return f"a stop string may have at most {MAX_STOP_CHARS} characters, got {longest}"
    return None


def check_prompt_shape(prompt: Any) -> Any:
    """Refuse, before the union is validated, a prompt list too long or of mixed kinds: a list
    of token ids holds ints only; a list of prompts at most MAX_PROMPTS."""
    if isinstance(prompt, list) and prompt:
        if type(prompt[0]) is int:
            if len(prompt) > MAX_PROMPT_TOKEN_IDS:
                raise ValueError(f"at most {MAX_PROMPT_TOKEN_IDS} token ids, got {len(prompt)}")
            if not all(type(t) is int for t in prompt):
                raise ValueError("a list of token ids must hold integers only")
        elif len(prompt) > MAX_PROMPTS:
            raise ValueError(f"at most {MAX_PROMPTS} prompts in one request, got {len(prompt)}")
    return prompt


def check_list_length(value: Any, limit: int, what: str) -> Any:
    if isinstance(value, list) and len(value) > limit:
        raise ValueError(f"at most {limit} {what}, got {len(value)}")
    return value
