"""A disaggregated SpecDecodeDeployment (the 8B target, its EAGLE-3 head, prefill, decode and the
router), its plan and the renderer's defaults, for the tests of the split roles' rendering."""

from __future__ import annotations

import json
from pathlib import Path

from specdeploy.operator.desired import render
from specdeploy.operator.desired.planning import plan_engine

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
DEFAULTS = render.EngineDefaults(image="registry.local/specdeploy-engine:test", hub_endpoint="https://hub.local")


def config(name: str) -> dict:
    return json.loads((CONFIGS / f"{name}.json").read_text())


def make_sdd(**disaggregation) -> dict:
    return {
        "apiVersion": "specdeploy.dev/v1alpha1",
        "kind": "SpecDecodeDeployment",
        "metadata": {"name": "llama8b", "namespace": "serving", "uid": "0000-uid", "generation": 1},
        "spec": {
            "target": {"model": "meta-llama/Llama-3.1-8B-Instruct"},
            "draft": {"model": "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B"},
            "speculative": {"algorithm": "EAGLE3", "numSteps": 3, "topk": 1, "numDraftTokens": 4},
            "engine": {"maxRunningRequests": 32, "contextLength": 8192,
                       "resources": {"requests": {"cpu": "8", "memory": "64Gi"}}},
            "gpu": {"product": "h200"},
            "disaggregation": {"prefill": {"replicas": 1}, "decode": {"replicas": 3},
                               "router": {"replicas": 2, "resources": {"requests": {"cpu": "1"}}},
                               **disaggregation},
        },
    }


def planned(sdd):
    return plan_engine(sdd["spec"], config("llama-3.1-8b-instruct"), config("eagle3-llama3.1-instruct-8b"))


def by_name(children, kind):
    return {o["metadata"]["name"]: o for o in children.all() if o["kind"] == kind}
