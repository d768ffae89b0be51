"""What blocks an engine, read from its pods (desired/pods.py), and how the status says it."""

from __future__ import annotations

from specdeploy.operator.desired import pods
from specdeploy.operator.desired import status as st


def pod(name="llama-abc", *, state=None, last=None, ready=False, restarts=0, scheduled=None, limit=None):
    container = {"name": "engine", "ready": ready, "restartCount": restarts, "image": "registry/engine:1",
                 "state": state or {}, "lastState": last or {}}
    conditions = [scheduled] if scheduled else []
    resources = {"limits": {"memory": limit}} if limit else {}
    return {"metadata": {"name": name}, "spec": {"containers": [{"name": "engine", "resources": resources}]},
            "status": {"conditions": conditions, "containerStatuses": [container] if state or last or ready else []}}


UNSCHEDULABLE = {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                 "message": "0/4 nodes are available: 1 node(s) didn't match Pod's node affinity/selector."}


def test_unschedulable_carries_the_schedulers_message():
    b = pods.blocked([pod(scheduled=UNSCHEDULABLE)])
    assert b.reason == "Unschedulable" and "0/4 nodes are available" in b.message and "llama-abc" in b.message


def test_image_pull():
    b = pods.blocked([pod(state={"waiting": {"reason": "ImagePullBackOff", "message": "Back-off pulling image"}})])
    assert b.reason == "ImagePullBackOff" and "registry/engine:1" in b.message and "Back-off" in b.message


def test_crash_loop_says_the_exit_code_and_the_last_lines():
    p = pod(state={"waiting": {"reason": "CrashLoopBackOff"}}, last={"terminated": {"exitCode": 2, "reason": "Error"}},
            restarts=4)
    assert pods.needs_logs(p)
    b = pods.blocked([p], {"llama-abc": ["INFO loading", "", "ERROR engine serve: DraftIncompatible: hidden_size 4096 vs 8192"]})
    assert b.reason == "CrashLoopBackOff" and "code 2" in b.message and "4 restart(s)" in b.message
    assert b.message.endswith("INFO loading | ERROR engine serve: DraftIncompatible: hidden_size 4096 vs 8192")


def test_oom_killed_names_the_limit():
    b = pods.blocked([pod(state={"waiting": {"reason": "CrashLoopBackOff"}},
                          last={"terminated": {"exitCode": 137, "reason": "OOMKilled"}}, limit="16Gi")])
    assert b.reason == "OOMKilled" and "16Gi" in b.message


def test_loading_says_the_plans_weights_or_the_engines_progress():
    running = pod(state={"running": {"startedAt": "2026-01-01T00:00:00Z"}})
    b = pods.blocked([running], weight_bytes=141 * 2**30)
    assert b.reason == "EngineLoading" and "141.0 GiB" in b.message and "2026-01-01T00:00:00Z" in b.message
    b = pods.blocked([running], progress={"llama-abc": {"loaded_bytes": 2**30, "total_bytes": 4 * 2**30}})
    assert "1.0 GiB of 4.0 GiB of weights loaded" in b.message


def test_the_most_urgent_pod_speaks_and_ready_pods_block_nothing():
    assert pods.blocked([pod(ready=True, state={"running": {}}), pod("fresh")]) is None
    crash = pod("b", state={"waiting": {"reason": "CrashLoopBackOff"}}, last={"terminated": {"exitCode": 1}})
    b = pods.blocked([pod("a", scheduled=UNSCHEDULABLE), crash, pod("c", scheduled=UNSCHEDULABLE)])
    assert b.reason == "CrashLoopBackOff" and b.pod == "b"
    b = pods.blocked([pod("a", scheduled=UNSCHEDULABLE), pod("c", scheduled=UNSCHEDULABLE)])
    assert b.message.endswith("(and 1 more pod(s) alike)")


PLAN = {"tensor_parallel_size": 1, "max_total_tokens": 10, "target": {"weight_bytes": 1}}


def deployment(ready=0):
    return {"metadata": {"name": "llama", "generation": 1, "annotations": {"specdeploy.dev/config-hash": "h"}},
            "spec": {"replicas": 1, "selector": {"matchLabels": {"a": "b"}}},
            "status": {"observedGeneration": 1, "replicas": 1, "readyReplicas": ready, "updatedReplicas": 1,
                       "availableReplicas": ready}}


def test_status_says_what_blocks_until_ready():
    planned = st.plan_ready({}, generation=1, plan=PLAN, config_hash="h", message="m", now="t0")
    blocked = pods.blocked([pod(scheduled=UNSCHEDULABLE)]).to_dict()
    status = st.engine_pods(planned, deployment(), blocked, generation=1, now="t1")
    ready = st.get_condition(status, "Ready")
    assert ready["reason"] == "Unschedulable" and "0/4 nodes" in ready["message"] and "0/1 replicas ready" in ready["message"]
    assert st.get_condition(status, "Degraded")["reason"] == "Unschedulable"
    # A Deployment event keeps the pods' word until the engine is ready.
    again = st.serving(status, deployment(), generation=1, now="t2")
    assert st.get_condition(again, "Ready")["reason"] == "Unschedulable"
    done = st.serving(again, deployment(ready=1), generation=1, now="t3")
    assert st.get_condition(done, "Ready")["reason"] == "AllReplicasReady" and "blockedBy" not in done
    loading = st.engine_pods(planned, deployment(), {"reason": "EngineLoading", "message": "pod x: loading"},
                             generation=1, now="t1")
    assert st.get_condition(loading, "Progressing")["status"] == "True"
    assert st.get_condition(loading, "Degraded")["status"] == "False"
