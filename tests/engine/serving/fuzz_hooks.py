"""Schemathesis hooks for tests/engine/serving/test_fuzz_openapi.py (loaded by the CLI through
SCHEMATHESIS_HOOKS).

The server answers 404 for any `model` but the one it serves, and no schema can say which that is,
so without help nearly every generated request would stop at the model check. Most generated
bodies that name a model get the served one (SPECDEPLOY_FUZZ_MODEL); one in eight keeps what was generated, so the
404 path is fuzzed too.
"""

from __future__ import annotations

import os
import random

import schemathesis

_rng = random.Random(int(os.environ.get("SPECDEPLOY_FUZZ_SEED", "22")))


@schemathesis.hook
def map_body(context, body):
    model = os.environ.get("SPECDEPLOY_FUZZ_MODEL")
    # Only a string already there is replaced: adding a missing `model`, or fixing its type, would
    # turn a generated invalid body into a valid one that schemathesis still expects refused.
    if model and isinstance(body, dict) and isinstance(body.get("model"), str) and _rng.random() < 0.875:
        body["model"] = model
    return body
