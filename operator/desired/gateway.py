"""spec.inferencePool -> an InferencePool (inference.networking.k8s.io/v1, the Gateway API
Inference Extension) over the pods that serve the OpenAI API (pure).

An InferencePool names a set of model-server pods, their target port and the endpoint picker
(EPP) that chooses one per request from their /metrics (queue, KV use, prefix; the engine serves
the protocol's names, docs/engine.md); a Gateway's HTTPRoute then routes to the pool instead of a
Service. The pool selects the engine pods of an aggregated resource, or the decode pods of a
disaggregated one: those hold the KV and the queue the picker weighs (the router, which only
forwards, would hide them). The endpoint picker is the user's (llm-d's, KServe's or the
extension's reference EPP): spec.inferencePool.endpointPickerRef is passed on as the API takes it.
"""

from __future__ import annotations

import copy
from typing import Any

from specdeploy.operator.desired.render import ENGINE_PORT, common_labels, selector_labels
from specdeploy.operator.desired.roles import is_disaggregated, role_selector

INFERENCE_POOL_API = ("inference.networking.k8s.io/v1", "InferencePool")


def inference_pool(sdd: dict[str, Any]) -> dict[str, Any] | None:
    spec, name = sdd["spec"], sdd["metadata"]["name"]
    wanted = spec.get("inferencePool")
    if not wanted:
        return None
    selector = role_selector(name, "decode") if is_disaggregated(spec) else selector_labels(name)
    pool_spec: dict[str, Any] = {
        "selector": {"matchLabels": dict(selector)},
        "targetPorts": [{"number": ENGINE_PORT}],
        "endpointPickerRef": copy.deepcopy(wanted["endpointPickerRef"]),
    }
    if wanted.get("appProtocol"):
        pool_spec["appProtocol"] = wanted["appProtocol"]
    return {
        "apiVersion": INFERENCE_POOL_API[0], "kind": INFERENCE_POOL_API[1],
        "metadata": {"name": wanted.get("name") or name, "labels": common_labels(name)},
        "spec": pool_spec,
    }
