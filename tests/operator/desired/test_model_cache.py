"""spec.modelCache rendered: the pod's hub-cache volume, the claim the operator makes (sized from
the plan), an existing claim by name, and status.modelCache saying where the weights come from."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specdeploy.operator.desired import render
from specdeploy.operator.desired.planning import plan_engine

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
DEFAULTS = render.EngineDefaults(image="registry.local/specdeploy-engine:test", hub_endpoint="https://hub.local")


def config(name: str) -> dict:
    return json.loads((CONFIGS / f"{name}.json").read_text())


def sdd(**spec_overrides) -> dict:
    spec = {
        "target": {"model": "meta-llama/Llama-3.1-8B-Instruct"},
        "draft": {"model": "/models/eagle3", "revision": "main"},
        "speculative": {"algorithm": "EAGLE3", "numSteps": 3, "topk": 1, "numDraftTokens": 4},
        "gpu": {"product": "h200"},
        **spec_overrides,
    }
    return {"apiVersion": "specdeploy.dev/v1alpha1", "kind": "SpecDecodeDeployment",
            "metadata": {"name": "llama8b", "namespace": "serving", "uid": "u-1", "generation": 1}, "spec": spec}


def render_for(resource: dict) -> render.Children:
    planned = plan_engine(resource["spec"], config("llama-3.1-8b-instruct"), config("eagle3-llama3.1-instruct-8b"))
    return render.render_children(resource, planned, DEFAULTS)


def pod_spec(children: render.Children) -> dict:
    return children.deployment["spec"]["template"]["spec"]


def cache_volume(children: render.Children) -> dict:
    (volume,) = [v for v in pod_spec(children)["volumes"] if v["name"] == "model-cache"]
    (mount,) = [m for m in pod_spec(children)["containers"][0]["volumeMounts"] if m["name"] == "model-cache"]
    assert mount["mountPath"] == render.MODEL_CACHE_PATH
    env = {e["name"]: e.get("value") for e in pod_spec(children)["containers"][0]["env"]}
    assert env["HF_HOME"] == render.MODEL_CACHE_PATH  # the engine's hub cache lives on that volume
    return volume


def test_without_model_cache_an_empty_dir_and_status_says_so():
    children = render_for(sdd())
    assert cache_volume(children) == {"name": "model-cache", "emptyDir": {}}
    assert children.model_cache_claim is None
    assert [c["kind"] for c in children.all()] == ["ConfigMap", "Deployment", "Service"]
    assert children.model_cache["volume"] == "EmptyDir" and "downloaded again" in children.model_cache["message"]


def test_a_claim_of_its_own_sized_from_the_plan():
    children = render_for(sdd(modelCache={}))
    claim = children.model_cache_claim
    assert claim["kind"] == "PersistentVolumeClaim" and claim["metadata"]["name"] == "llama8b-model-cache"
    assert claim["metadata"]["ownerReferences"][0]["uid"] == "u-1"  # deleted with the resource
    assert claim["metadata"]["namespace"] == "serving"
    # Applied before the Deployment whose pods mount it.
    kinds = [c["kind"] for c in children.all()]
    assert kinds.index("PersistentVolumeClaim") < kinds.index("Deployment")
    assert cache_volume(children) == {"name": "model-cache", "persistentVolumeClaim": {"claimName": "llama8b-model-cache"}}
    plan = json.loads(children.config_map["data"]["plan.json"])
    weights = plan["target"]["weight_bytes"] + plan["draft"]["weight_bytes"]
    size_gib = int(claim["spec"]["resources"]["requests"]["storage"].removesuffix("Gi"))
    # Llama-3.1-8B (16 GB in bf16) + an EAGLE-3 head: weights with 25 % headroom + 2 GiB, whole GiB.
    assert size_gib == -(-int(weights * 1.25 + (2 << 30)) // (1 << 30))
    assert 15 < weights / (1 << 30) < size_gib < 25
    assert claim["spec"]["accessModes"] == ["ReadWriteOnce"] and "storageClassName" not in claim["spec"]
    assert children.model_cache == {"volume": "PersistentVolumeClaim", "claimName": "llama8b-model-cache",
                                    "managed": True, "size": f"{size_gib}Gi", "mountPath": render.MODEL_CACHE_PATH,
                                    "weights": children.model_cache["weights"]}


def test_size_storage_class_and_access_modes_are_the_users():
    children = render_for(sdd(modelCache={"size": "500Gi", "storageClassName": "fast-nvme",
                                          "accessModes": ["ReadWriteMany"]}, replicas=4))
    spec = children.model_cache_claim["spec"]
    assert spec == {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "500Gi"}},
                    "storageClassName": "fast-nvme"}


def test_an_existing_claim_by_name_is_mounted_not_created():
    children = render_for(sdd(modelCache={"claimName": "shared-weights"}))
    assert children.model_cache_claim is None
    assert cache_volume(children) == {"name": "model-cache", "persistentVolumeClaim": {"claimName": "shared-weights"}}
    assert children.model_cache["managed"] is False and children.model_cache["claimName"] == "shared-weights"


@pytest.mark.parametrize("cache", [None, {}, {"claimName": "x"}])
def test_status_says_where_each_models_weights_come_from(cache):
    resource = sdd() if cache is None else sdd(modelCache=cache)
    resource["spec"]["hub"] = {"endpoint": "https://mirror.internal"}
    weights = render_for(resource).model_cache["weights"]
    assert weights == [
        {"role": "target", "model": "meta-llama/Llama-3.1-8B-Instruct", "source": "Hub",
         "endpoint": "https://mirror.internal", "revision": "main"},
        {"role": "draft", "model": "/models/eagle3", "source": "Path"},
    ]


def test_model_cache_with_disaggregation_is_refused_by_the_crd():
    """The prefill and decode roles keep an emptyDir: the CRD says so instead of ignoring the field."""
    import yaml

    crd = yaml.safe_load((Path(__file__).resolve().parents[3] / "manifests/crd/specdeploy.dev_specdecodedeployments.yaml").read_text())
    rules = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["x-kubernetes-validations"]
    (rule,) = [r for r in rules if "modelCache" in r["rule"]]
    assert rule["rule"] == "!has(self.modelCache) || !has(self.disaggregation)" and "not supported" in rule["message"]
