"""Status and conditions as pure functions (no cluster)."""

from __future__ import annotations

from specdeploy.operator.desired import status as st

T0, T1, T2 = "2026-01-01T00:00:00Z", "2026-01-01T00:01:00Z", "2026-01-01T00:02:00Z"
PLAN = {
    "tensor_parallel_size": 2,
    "max_total_tokens": 458231,
    "spec_hidden_size": 8192,
    "draft_input_hidden_size": 24576,
    "target": {"weight_bytes": 100, "kv_cache_bytes_per_token": 10},
    "draft": {"weight_bytes": 7, "kv_cache_bytes_per_token": 3},
    "memory_per_gpu": {"kv_cache_budget_bytes": 5},
}


def deployment(*, replicas=2, ready=2, updated=2, available=2, total=2, generation=3, observed=3, hash_="h1", conditions=()):
    return {
        "metadata": {"name": "llama", "generation": generation, "annotations": {"specdeploy.dev/config-hash": hash_}},
        "spec": {"replicas": replicas, "selector": {"matchLabels": {"app.kubernetes.io/name": "specdeploy-engine", "app.kubernetes.io/instance": "llama"}}},
        "status": {
            "observedGeneration": observed, "replicas": total, "readyReplicas": ready,
            "updatedReplicas": updated, "availableReplicas": available, "conditions": list(conditions),
        },
    }


def conditions(status):
    return {c["type"]: (c["status"], c["reason"]) for c in status["conditions"]}


def planned_status(generation=1, now=T0):
    return st.plan_ready({}, generation=generation, plan=PLAN, config_hash="h1", message="TP 2", now=now)


def test_status_plan_is_a_camel_case_summary_with_totals():
    plan = planned_status()["plan"]
    assert plan["tensorParallelSize"] == 2 and plan["maxTotalTokens"] == 458231
    assert plan["gpusPerReplica"] == 2
    assert plan["specHiddenSize"] == 8192 and plan["draftInputHiddenSize"] == 24576
    assert plan["weightBytes"] == 107 and plan["kvBytesPerToken"] == 13
    # Memory in GiB, no byte-level terms (those are the ConfigMap's plan.json), nothing nested deeper.
    assert set(plan["memoryPerGpuGiB"]) >= {"total", "weights", "kvCache", "reserve"}
    assert all(not isinstance(v, (dict, list)) for k, v in plan.items() if k not in ("memoryPerGpuGiB", "notes"))


def test_describe_of_a_real_plan_is_short():
    """`kubectl describe` of status.plan: a screenful, not one line per byte-level term."""
    import json
    from pathlib import Path

    import yaml

    from specdeploy.engine.planner.plan import GPUS, Limits, SpecSettings, plan_from_configs

    models = Path(__file__).resolve().parents[3] / "manifests" / "models"
    load = lambda n: json.loads((models / n / "config.json").read_text())  # noqa: E731
    full = plan_from_configs(load("llama-3.1-8b-instruct"), load("eagle3-llama3.1-instruct-8b"),
                             SpecSettings("EAGLE3", 3, 1, 4), GPUS["h200"], Limits()).to_dict()
    summary = st.status_plan(full)
    assert len(yaml.safe_dump(summary).splitlines()) <= 40 < len(yaml.safe_dump(full).splitlines())
    assert "14.96 GiB of weights" in summary["target"] and "953189 token slots" in summary["kvCacheTokens"]


def test_rollout_in_progress_then_ready():
    status = st.serving(planned_status(), deployment(ready=0, available=0), generation=1, now=T1)
    assert conditions(status) == {
        "PlanReady": ("True", "Planned"),
        "Ready": ("False", "ReplicasNotReady"),
        "Progressing": ("True", "RollingOut"),
        "Degraded": ("False", "AsExpected"),
    }
    assert status["phase"] == "Deploying"
    assert status["serving"]["readyReplicas"] == 0
    status = st.serving(status, deployment(), generation=1, now=T2)
    assert conditions(status)["Ready"] == ("True", "AllReplicasReady")
    assert conditions(status)["Progressing"] == ("False", "RolloutComplete")
    assert status["phase"] == "Ready"
    assert status["serving"] == {
        "deployment": "llama", "replicas": 2, "readyReplicas": 2, "updatedReplicas": 2,
        "selector": "app.kubernetes.io/instance=llama,app.kubernetes.io/name=specdeploy-engine",
    }
    ready = st.get_condition(status, "Ready")
    assert ready["lastTransitionTime"] == T2 and ready["observedGeneration"] == 1 and ready["message"].startswith("2/2")


def test_transition_time_moves_only_on_flips():
    status = st.serving(planned_status(), deployment(), generation=1, now=T1)
    again = st.serving(status, deployment(), generation=1, now=T2)
    assert st.get_condition(again, "Ready")["lastTransitionTime"] == T1
    assert st.get_condition(again, "PlanReady")["lastTransitionTime"] == T0


def test_deployment_of_an_older_spec_is_not_ready():
    status = st.serving(planned_status(), deployment(hash_="old"), generation=1, now=T1)
    assert conditions(status)["Ready"] == ("False", "RolloutPending")
    assert status["phase"] == "Deploying"


def test_new_generation_not_yet_planned_leaves_conditions_alone():
    status = st.serving(planned_status(generation=1), deployment(), generation=1, now=T1)
    later = st.serving(status, deployment(ready=1), generation=2, now=T2)
    assert conditions(later)["Ready"] == ("True", "AllReplicasReady")  # judged by the reconciler next
    assert later["serving"]["readyReplicas"] == 1


def test_stalled_rollout_and_lost_replicas_are_degraded():
    stalled = deployment(ready=0, available=0, conditions=[{"type": "Progressing", "status": "False", "reason": "ProgressDeadlineExceeded"}])
    status = st.serving(planned_status(), stalled, generation=1, now=T1)
    assert conditions(status)["Degraded"] == ("True", "ProgressDeadlineExceeded")
    assert conditions(status)["Progressing"] == ("False", "ProgressDeadlineExceeded")
    starting = st.serving(planned_status(), deployment(ready=1, available=1), generation=1, now=T1)
    assert conditions(starting)["Degraded"] == ("False", "AsExpected")
    ready = st.serving(planned_status(), deployment(), generation=1, now=T1)
    lost = st.serving(ready, deployment(ready=1, available=1), generation=1, now=T2)
    assert conditions(lost)["Ready"] == ("False", "ReplicasNotReady")
    assert conditions(lost)["Degraded"] == ("True", "ReplicasUnavailable")
    assert lost["phase"] == "Deploying"


def test_permanent_failure_drops_plan_and_engine():
    status = st.serving(planned_status(), deployment(), generation=1, now=T1)
    failed = st.plan_failed(status, generation=2, reason="InsufficientGPUMemory", message="needs 217.2 GiB but has 140.4 GiB", transient=False, engine_kept=False, now=T2)
    assert failed["phase"] == "Failed"
    assert "plan" not in failed and "configHash" not in failed
    assert failed["observedGeneration"] == 2
    assert conditions(failed) == {
        "PlanReady": ("False", "InsufficientGPUMemory"),
        "Ready": ("False", "InsufficientGPUMemory"),
        "Progressing": ("False", "InsufficientGPUMemory"),
        "Degraded": ("False", "InsufficientGPUMemory"),
    }
    assert "217.2 GiB" in st.get_condition(failed, "PlanReady")["message"]
    # A Deployment event arriving afterwards does not resurrect Ready.
    after = st.serving(failed, None, generation=2, now=T2)
    assert conditions(after)["Ready"] == ("False", "InsufficientGPUMemory") and after["phase"] == "Failed"


def test_transient_failure_keeps_serving_and_is_degraded():
    status = st.serving(planned_status(), deployment(), generation=1, now=T1)
    pending = st.plan_failed(status, generation=2, reason="HubUnreachable", message="GET http://hub/x: 503", transient=True, engine_kept=True, now=T2)
    assert pending["phase"] == "Pending"
    assert conditions(pending)["Degraded"] == ("True", "HubUnreachable")
    assert conditions(pending)["Ready"] == ("True", "AllReplicasReady")
    assert pending["plan"]["tensorParallelSize"] == 2


def test_paused_keeps_conditions_and_phase_sticks():
    status = st.serving(planned_status(), deployment(), generation=1, now=T1)
    paused = st.paused(status, generation=1, now=T2)
    assert paused["phase"] == "Paused"
    after = st.serving(paused, deployment(ready=0, available=0), generation=1, now=T2)
    assert after["phase"] == "Paused" and after["serving"]["readyReplicas"] == 0


def test_kopf_bookkeeping_is_never_written_back():
    assert "kopf" not in st.planning({"kopf": {"progress": {}}}, generation=1, now=T0)


def test_camel_case():
    assert st.camel_case("kv_cache_bytes_per_token") == "kvCacheBytesPerToken"
    assert st.camel_case("gpu") == "gpu"


def test_blocked_apply_keeps_the_plan_and_says_why():
    blocked = st.apply_blocked(planned_status(), generation=1, reason="ChildConflict", message="Deployment ns/x is owned by no controller", now=T1)
    assert blocked["phase"] == "Pending" and blocked["plan"]["tensorParallelSize"] == 2
    assert conditions(blocked) == {
        "PlanReady": ("True", "Planned"),
        "Ready": ("False", "ChildConflict"),
        "Progressing": ("False", "ChildConflict"),
        "Degraded": ("True", "ChildConflict"),
    }


def test_cpu_mode_plans_no_gpus_per_replica():
    plan = st.status_plan({**PLAN, "gpu": "cpu", "tensor_parallel_size": 1})
    assert plan["gpusPerReplica"] == 0 and plan["tensorParallelSize"] == 1


def test_status_plan_says_the_nodes():
    assert st.status_plan({**PLAN, "nodes": 2, "tensor_parallel_size": 16})["nodes"] == 2
    assert st.status_plan({**PLAN})["nodes"] == 1  # a plan written before nodes existed
