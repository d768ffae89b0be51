"""`specdeploy engine serve --adaptive-speculation`: the engine chooses the shape per step and
/metrics shows the choice, the steps per shape and the measured acceptance; the output is the
target-only server's token for token (greedy, float32)."""

from __future__ import annotations

import dataclasses

import openai


def test_adaptive_server_serves_the_same_tokens_and_shows_its_choice(start_server, server):
    url = start_server("--adaptive-speculation")
    adaptive = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    fixed = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
    for prompt in ("def main(", "import torch\n"):
        kw = {"model": server.model, "prompt": prompt, "max_tokens": 24, "temperature": 0.0,
              "extra_body": {"ignore_eos": True}}
        assert adaptive.completions.create(**kw).choices[0].text == fixed.completions.create(**kw).choices[0].text

    m = dataclasses.replace(server, url=url).metrics()
    assert m["specdeploy_spec_decode_adaptive{}"] == 1
    shapes = {k: v for k, v in m.items() if k.startswith("specdeploy_spec_decode_shape{")}
    assert sum(shapes.values()) == 1, shapes          # exactly one current shape
    current = next(k for k, v in shapes.items() if v == 1)
    steps = m["specdeploy_spec_decode_shape_num_steps{}"]
    assert (current == "specdeploy_spec_decode_shape{shape=none}") == (steps == 0)
    per_shape = {k: v for k, v in m.items() if k.startswith("specdeploy_spec_decode_shape_steps_total")}
    assert sum(per_shape.values()) >= 2 * 23 / 4  # every decode step counted under its shape
    rates = [v for k, v in m.items() if k.startswith("specdeploy_spec_decode_acceptance_rate{")]
    assert rates and all(0 <= r <= 1 for r in rates)
    assert m["specdeploy_spec_decode_expected_tokens_per_step{shape=none}"] == 1
