"""openai_fields.controls_param: a split prefill/decode server's refusal names the first field that
asks for LogitControls, away from the default its body declares (ControlFields' defaults are the
one description of the values that mean off)."""

from __future__ import annotations

import pytest

from specdeploy.engine.serving import openai_fields, server

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"model": "m", "prompt": "hi"}


@pytest.mark.parametrize("body, fields, param", [
    (server.ChatBody, {}, "tools"),
    (server.ChatBody, {"presence_penalty": 0.0, "logit_bias": {}, "n": 2}, "tools"),
    (server.ChatBody, {"presence_penalty": 0.5, "min_tokens": 1}, "presence_penalty"),
    (server.ChatBody, {"logprobs": True, "min_tokens": 1}, "logprobs"),
    (server.ChatBody, {"response_format": {"type": "text"}, "guided_regex": "a"}, "guided_regex"),
    (server.ChatBody, {"tool_choice": "none"}, "tool_choice"),
    (server.CompletionBody, {"repetition_penalty": 1.0, "logit_bias": {"1": 1.0}}, "logit_bias"),
    (server.CompletionBody, {"response_format": {"type": "json_object"}}, "response_format"),
])
def test_the_refusal_names_the_first_field_off_its_default(body, fields, param):
    base = CHAT if body is server.ChatBody else COMPLETION
    assert openai_fields.controls_param(body.model_validate({**base, **fields})) == param
