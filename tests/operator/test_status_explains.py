"""While not Ready, the resource says why, in the words of its engine pods: `kubectl get sdd`'s
Message column and the Ready condition (desired/pods.py through the operator's pod watch)."""

from __future__ import annotations

import json

from testcluster import wait_for


def ready_condition(sdd) -> dict:
    return sdd.condition("Ready") or {}


def test_an_unschedulable_engine_shows_the_schedulers_message(kube_cluster, kube_namespace, operator, hub_secret,
                                                              manifest, sdd_of):
    # No L40S node in the test cluster: the pod's node selector matches none of the 4 nodes.
    kube_cluster.apply(manifest("nofit", gpu={"product": "l40s"}, replicas=1), namespace=kube_namespace)
    sdd = sdd_of("nofit")
    cond = wait_for(lambda: ready_condition(sdd).get("reason") == "Unschedulable" and ready_condition(sdd),
                    timeout_s=60, what="Ready=False Unschedulable")
    assert "nodes are available" in cond["message"] and "0/1 replicas ready" in cond["message"]
    assert sdd.condition("Degraded")["reason"] == "Unschedulable"
    assert sdd.status()["phase"] == "Deploying"
    row = kube_cluster.kubectl("get", "sdd", "nofit", "-n", kube_namespace).stdout.splitlines()
    assert row[0].split()[-1] == "MESSAGE" and "nodes are available" in row[1]
    # The Deployment's deadline is sized from the plan's weights (70B + head: more than the default 600 s).
    assert sdd.deployment()["spec"]["progressDeadlineSeconds"] > 600


def test_a_crash_looping_engine_shows_its_exit_code_and_last_lines(kube_cluster, kube_namespace, operator,
                                                                   hub_secret, manifest, sdd_of):
    kube_cluster.apply(manifest("crashy", replicas=1), namespace=kube_namespace)
    sdd = sdd_of("crashy")
    sdd.wait_ready()
    (pod,) = sdd.items("pods", "-l", "app.kubernetes.io/instance=crashy")
    name = pod["metadata"]["name"]
    kube_cluster.set_pod_log(kube_namespace, name, [
        "INFO specdeploy.engine: loading target", "ERROR specdeploy.engine: engine serve: out of memory while loading"])
    # What a kubelet reports for an engine that exits 2 on start (kwok's fake node runs no process).
    status = {"status": {"conditions": [{"type": "Ready", "status": "False"}],
                         "containerStatuses": [{
                             "name": "engine", "ready": False, "restartCount": 3, "image": pod["spec"]["containers"][0]["image"],
                             "imageID": "", "started": False,
                             "state": {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 40s restarting"}},
                             "lastState": {"terminated": {"exitCode": 2, "reason": "Error",
                                                          "startedAt": "2026-01-01T00:00:00Z",
                                                          "finishedAt": "2026-01-01T00:00:05Z"}}}]}}

    def crash_looping():
        # A kubelet keeps reporting the back-off; kwok's pod stages may rewrite a status patched
        # once (its ready stage matches the pod again), so the report is repeated until seen.
        cond = ready_condition(sdd)
        if cond.get("reason") == "CrashLoopBackOff":
            return cond
        now = json.loads(kube_cluster.kubectl("get", "pod", name, "-n", kube_namespace, "-o", "json").stdout)
        waiting = [c.get("state", {}).get("waiting", {}).get("reason")
                   for c in now.get("status", {}).get("containerStatuses", [])]
        if waiting != ["CrashLoopBackOff"]:
            kube_cluster.kubectl("patch", "pod", name, "-n", kube_namespace, "--subresource=status", "--type=merge",
                                 "-p", json.dumps(status))
        return None

    cond = wait_for(crash_looping, timeout_s=60, what="Ready=False CrashLoopBackOff")
    assert "exited with code 2" in cond["message"] and "3 restart(s)" in cond["message"]
    assert "out of memory while loading" in cond["message"]
    assert sdd.status()["blockedBy"]["reason"] == "CrashLoopBackOff"


def test_an_engine_still_loading_says_so_with_the_plans_weights(kube_cluster, kube_namespace, operator_process,
                                                                hub_secret, manifest, sdd_of):
    operator_process(metrics_interval_s=1)
    kube_cluster.apply(manifest("slow", replicas=1), namespace=kube_namespace)
    sdd = sdd_of("slow")
    sdd.wait_ready()
    (pod,) = sdd.items("pods", "-l", "app.kubernetes.io/instance=slow")
    # What a kubelet reports while the engine loads: running, /ready not yet 200.
    status = {"status": {"conditions": [{"type": "Ready", "status": "False"}, {"type": "ContainersReady", "status": "False"}],
                         "containerStatuses": [{
                             "name": "engine", "ready": False, "restartCount": 0, "image": pod["spec"]["containers"][0]["image"],
                             "imageID": "", "started": True, "state": {"running": {"startedAt": "2026-01-01T00:00:00Z"}}}]}}
    kube_cluster.kubectl("patch", "pod", pod["metadata"]["name"], "-n", kube_namespace, "--subresource=status",
                         "--type=merge", "-p", json.dumps(status))
    cond = wait_for(lambda: ready_condition(sdd).get("reason") == "EngineLoading" and ready_condition(sdd),
                    timeout_s=60, what="Ready=False EngineLoading")
    assert "GiB of weights" in cond["message"] and "running since 2026-01-01T00:00:00Z" in cond["message"]
    assert sdd.condition("Progressing")["status"] == "True" and sdd.condition("Degraded")["status"] == "False"
