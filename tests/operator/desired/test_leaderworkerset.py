"""A plan of more than one node rendered as a LeaderWorkerSet (pure, no cluster): the group's
shape, leader and worker templates against the single-node pod, the Service, the model cache,
and the group's status read as a Deployment's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specdeploy.operator import api
from specdeploy.operator.desired import leaderworkerset as lws
from specdeploy.operator.desired import render, status
from specdeploy.operator.desired.planning import PlanningError, plan_engine, plan_summary

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
DEFAULTS = render.EngineDefaults(image="registry.local/specdeploy-engine:test", hub_endpoint="https://hub.local")


def config(name: str) -> dict:
    return json.loads((CONFIGS / f"{name}.json").read_text())


def make_sdd(**spec_overrides) -> dict:
    spec = {
        "target": {"model": "meta-llama/Llama-3.1-405B-Instruct"},
        "draft": {"model": "/models/eagle3-llama3.1-instruct-405b"},
        "speculative": {"algorithm": "EAGLE3", "numSteps": 3, "topk": 1, "numDraftTokens": 4},
        "engine": {"maxRunningRequests": 32, "contextLength": 8192},
        "gpu": {"product": "h100", "perNode": 8, "maxNodes": 2},
        "replicas": 3,
    }
    spec.update(spec_overrides)
    return {
        "apiVersion": "specdeploy.dev/v1alpha1", "kind": "SpecDecodeDeployment",
        "metadata": {"name": "llama405b", "namespace": "serving", "uid": "0000-uid", "generation": 1},
        "spec": spec,
    }


def planned_for(sdd):
    return plan_engine(sdd["spec"], config("llama-3.1-405b-instruct"), config("eagle3-llama3.1-instruct-405b"))


@pytest.fixture
def sdd():
    return make_sdd()


@pytest.fixture
def planned(sdd):
    return planned_for(sdd)


@pytest.fixture
def group(sdd, planned):
    return lws.render_group(sdd, planned, DEFAULTS)


def container(template):
    return template["spec"]["containers"][0]


@pytest.mark.parametrize(("gpu", "tp", "nodes"), [
    ({"product": "h100", "perNode": 8, "maxNodes": 2}, 16, 2),
    ({"product": "h100", "perNode": 8, "maxNodes": 4}, 16, 2),
    ({"product": "h100", "perNode": 4, "maxNodes": 4}, 16, 4),
    ({"product": "h200", "perNode": 8, "maxNodes": 2}, 8, 1),
])
def test_planned_nodes(gpu, tp, nodes):
    planned = planned_for(make_sdd(gpu=gpu))
    assert (planned.tensor_parallel_size, planned.nodes) == (tp, nodes)
    assert planned.plan["nodes"] == nodes


def test_one_node_without_max_nodes_is_refused():
    with pytest.raises(PlanningError) as err:
        planned_for(make_sdd(gpu={"product": "h100", "perNode": 8}))
    assert err.value.reason == "InsufficientGPUMemory"
    assert "tried up to max_nodes 1" in err.value.message


def test_cpu_nodes_is_the_group_size():
    sdd = make_sdd(cpu={"memoryGiB": 4, "nodes": 2}, gpu=None, draft=None,
                   speculative={"algorithm": "NONE"}, engine={"maxRunningRequests": 2, "contextLength": 64})
    del sdd["spec"]["gpu"]
    planned = plan_engine(sdd["spec"], config("qwen3-8b") | {"num_hidden_layers": 1, "hidden_size": 256,
                                                              "intermediate_size": 512, "num_attention_heads": 4,
                                                              "num_key_value_heads": 2, "head_dim": 64,
                                                              "vocab_size": 1024}, None)
    assert (planned.tensor_parallel_size, planned.nodes, planned.cpu) == (2, 2, True)
    group = lws.render_group(sdd, planned, DEFAULTS).deployment
    leader = group["spec"]["leaderWorkerTemplate"]["leaderTemplate"]
    assert "nvidia.com/gpu" not in container(leader)["resources"]["requests"]
    assert "affinity" not in leader["spec"]
    assert {"name": "CUDA_VISIBLE_DEVICES", "value": ""} in container(leader)["env"]


def test_group_shape(sdd, group):
    obj = group.deployment
    assert obj["apiVersion"] == "leaderworkerset.x-k8s.io/v1" and obj["kind"] == "LeaderWorkerSet"
    assert obj["metadata"]["name"] == "llama405b" and obj["metadata"]["namespace"] == "serving"
    assert obj["metadata"]["ownerReferences"][0]["uid"] == "0000-uid"
    assert obj["metadata"]["annotations"][api.CONFIG_HASH_ANNOTATION] == group.config_hash
    spec = obj["spec"]
    assert spec["replicas"] == 3  # replicas count groups
    assert spec["startupPolicy"] == "LeaderCreated"
    template = spec["leaderWorkerTemplate"]
    assert template["size"] == 2
    assert template["restartPolicy"] == "RecreateGroupOnPodRestart"


def test_leader_is_the_single_node_pod_with_one_nodes_gpus(sdd, planned, group):
    single = render.render_children(sdd, planned, DEFAULTS).deployment["spec"]["template"]
    leader = group.deployment["spec"]["leaderWorkerTemplate"]["leaderTemplate"]
    c, s = container(leader), container(single)
    assert c["resources"]["requests"]["nvidia.com/gpu"] == c["resources"]["limits"]["nvidia.com/gpu"] == 8
    assert s["resources"]["requests"]["nvidia.com/gpu"] == 16  # what one pod would have asked
    for key in ("command", "args", "image", "ports", "startupProbe", "livenessProbe", "readinessProbe",
                "volumeMounts", "lifecycle"):
        assert c[key] == s[key], key
    assert c["env"] == s["env"] + [lws.NODE_NAME_ENV]
    assert leader["spec"]["affinity"] == single["spec"]["affinity"]  # H100 nodes
    assert leader["spec"]["tolerations"] == single["spec"]["tolerations"]
    assert leader["metadata"] == single["metadata"]  # labels and the config hash
    shm = next(v for v in leader["spec"]["volumes"] if v["name"] == "dshm")
    assert shm["emptyDir"]["sizeLimit"] == "8Gi"
    assert "--plan" in c["args"]  # the same plan.json: every rank sizes its pools from it


def test_worker_runs_the_same_command_without_probes(group):
    template = group.deployment["spec"]["leaderWorkerTemplate"]
    leader, worker = container(template["leaderTemplate"]), container(template["workerTemplate"])
    assert worker["args"] == leader["args"] and worker["command"] == leader["command"]
    assert worker["resources"] == leader["resources"]
    for probe in lws.PROBES:
        assert probe not in worker
    assert template["workerTemplate"]["spec"]["affinity"] == template["leaderTemplate"]["spec"]["affinity"]


def test_service_selects_leaders(group):
    assert group.service["spec"]["selector"] == {
        "app.kubernetes.io/name": "specdeploy-engine", "app.kubernetes.io/instance": "llama405b",
        "leaderworkerset.sigs.k8s.io/worker-index": "0"}
    assert group.config_map["metadata"]["name"] == "llama405b-engine"
    assert json.loads(group.config_map["data"]["plan.json"])["nodes"] == 2


def test_default_model_cache_is_an_empty_dir_per_pod(group):
    template = group.deployment["spec"]["leaderWorkerTemplate"]
    assert "volumeClaimTemplates" not in template
    volumes = {v["name"]: v for v in template["workerTemplate"]["spec"]["volumes"]}
    assert volumes["model-cache"] == {"name": "model-cache", "emptyDir": {}}


def test_managed_model_cache_is_a_claim_per_pod():
    sdd = make_sdd(modelCache={"size": "1000Gi"})
    group = lws.render_group(sdd, planned_for(sdd), DEFAULTS)
    template = group.deployment["spec"]["leaderWorkerTemplate"]
    assert group.model_cache_claim is None  # no single claim shared across nodes
    [claim] = template["volumeClaimTemplates"]
    assert claim["metadata"]["name"] == "model-cache"
    assert claim["spec"]["resources"]["requests"]["storage"] == "1000Gi"
    for pod in ("leaderTemplate", "workerTemplate"):
        assert "model-cache" not in {v["name"] for v in template[pod]["spec"]["volumes"]}
        assert {"name": "model-cache", "mountPath": render.MODEL_CACHE_PATH} in container(template[pod])["volumeMounts"]
    assert template["persistentVolumeClaimRetentionPolicy"] == {"whenDeleted": "Delete", "whenScaled": "Retain"}
    assert group.model_cache["perPod"] is True and group.model_cache["managed"] is True


def test_existing_claim_is_mounted_by_every_pod():
    sdd = make_sdd(modelCache={"claimName": "shared-weights"})
    group = lws.render_group(sdd, planned_for(sdd), DEFAULTS)
    template = group.deployment["spec"]["leaderWorkerTemplate"]
    assert "volumeClaimTemplates" not in template
    for pod in ("leaderTemplate", "workerTemplate"):
        volumes = {v["name"]: v for v in template[pod]["spec"]["volumes"]}
        assert volumes["model-cache"]["persistentVolumeClaim"] == {"claimName": "shared-weights"}


def test_a_one_node_plan_is_not_a_group(sdd):
    planned = planned_for(make_sdd(gpu={"product": "h200", "perNode": 8, "maxNodes": 2}))
    with pytest.raises(ValueError):
        lws.render_group(sdd, planned, DEFAULTS)


def test_plan_summary_names_the_nodes(planned):
    assert plan_summary(planned).startswith("TP 16 x h100 on 2 nodes, max_total_tokens")


@pytest.mark.parametrize(("lws_status", "generation", "phase", "ready", "reason"), [
    ({}, 1, "Deploying", "False", "ReplicasNotReady"),
    ({"observedGeneration": 1, "replicas": 3, "readyReplicas": 1, "updatedReplicas": 3}, 1, "Deploying", "False",
     "ReplicasNotReady"),
    ({"observedGeneration": 1, "replicas": 3, "readyReplicas": 3, "updatedReplicas": 3}, 1, "Ready", "True",
     "AllReplicasReady"),
    ({"observedGeneration": 1, "replicas": 3, "readyReplicas": 3, "updatedReplicas": 3}, 2, "Deploying", "False",
     "ReplicasNotReady"),  # the group has not seen its new generation yet
])
def test_group_status_folds_into_serving(group, lws_status, generation, phase, ready, reason):
    obj = {**group.deployment, "metadata": {**group.deployment["metadata"], "generation": generation},
           "status": lws_status}
    st = status.plan_ready({}, generation=1, plan=json.loads(group.config_map["data"]["plan.json"]),
                           config_hash=group.config_hash, message="planned", now="2026-01-01T00:00:00Z")
    st = status.serving(st, lws.deployment_view(obj), generation=1, now="2026-01-01T00:00:00Z")
    assert st["phase"] == phase
    assert status.get_condition(st, api.READY)["status"] == ready
    assert status.get_condition(st, api.READY)["reason"] == reason
    assert st["serving"]["selector"] == ("app.kubernetes.io/instance=llama405b,app.kubernetes.io/name=specdeploy-engine,"
                                         "leaderworkerset.sigs.k8s.io/worker-index=0")
    assert st["serving"]["replicas"] == lws_status.get("replicas", 0)
    assert st["plan"]["nodes"] == 2 and st["plan"]["gpusPerReplica"] == 16


def test_no_group_yet_reads_as_missing():
    assert lws.deployment_view(None) is None
