"""The operator end to end on the real control plane: kube-apiserver, controller-manager (garbage
collection, Deployments -> ReplicaSets -> Pods), scheduler, and kwok playing the kubelet on fake
H200/H100 nodes. The operator runs in-process, or as a `specdeploy operator` process that gets
SIGKILLed."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import httpx
import yaml

from testcluster import wait_for

EAGLE3_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "eagle3-llama3.3-instruct-70b.json"

TINY_CPU_DEMO = Path(__file__).resolve().parents[2] / "manifests" / "examples" / "tiny-cpu-demo.yaml"

HASH = "specdeploy.dev/config-hash"


def gpu_request(deployment: dict) -> int:
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == container["resources"]["requests"]["nvidia.com/gpu"]
    return int(container["resources"]["requests"]["nvidia.com/gpu"])


def template_hash(deployment: dict) -> str:
    return deployment["spec"]["template"]["metadata"]["annotations"][HASH]


def reasons(sdd) -> set[str]:
    return {e["reason"] for e in sdd.events()}


def test_apply_to_ready(kube_cluster, kube_namespace, operator, hub_secret, manifest, sdd_of, capsys):
    kube_cluster.apply(manifest("llama70b"), namespace=kube_namespace)
    sdd = sdd_of("llama70b")

    deployment = wait_for(sdd.deployment, timeout_s=30, what="engine Deployment")
    # 70B in bf16 with an EAGLE-3 head does not fit one H200: the plan picks TP 2.
    assert gpu_request(deployment) == 2
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[:6] == ["--target", "meta-llama/Llama-3.3-70B-Instruct", "--draft", "yuhuili/EAGLE3-LLaMA3.3-Instruct-70B", "--algorithm", "EAGLE3"]
    pods = wait_for(lambda: len(running := [p for p in sdd.pods() if p["status"].get("phase") == "Running"]) == 2 and running,
                    timeout_s=60, what="2 engine pods Running")
    h200_nodes = {n.name for n in kube_cluster.gpu_nodes if n.gpu_product == "NVIDIA-H200"}
    assert {p["spec"]["nodeName"] for p in pods} <= h200_nodes

    status = sdd.wait_ready()
    assert status["serving"]["readyReplicas"] == 2
    assert status["plan"]["tensorParallelSize"] == 2
    assert status["plan"]["specHiddenSize"] == 8192 and status["plan"]["draftInputHiddenSize"] == 3 * 8192
    assert status["plan"]["maxTotalTokens"] >= 32 * 8192
    assert {c["type"]: c["status"] for c in status["conditions"]} == {
        "PlanReady": "True", "Ready": "True", "Progressing": "False", "Degraded": "False",
    }
    # The ConfigMap's plan.json is the plan the status reports.
    (config_map,) = [c for c in sdd.owned("configmaps") if c["metadata"]["name"] == "llama70b-engine"]
    plan = json.loads(config_map["data"]["plan.json"])
    assert plan["max_total_tokens"] == status["plan"]["maxTotalTokens"]
    (service,) = sdd.owned("services")
    assert service["spec"]["ports"][0]["port"] == 8000 and service["spec"]["ports"][0]["name"] == "http"
    assert {"Planned", "Applied"} <= reasons(sdd)
    assert {e["source"].get("component") or e.get("reportingComponent") for e in sdd.events()} == {"specdeploy-operator"}
    # No finalizer: deleting the resource never waits for the operator.
    assert not sdd.get()["metadata"].get("finalizers")

    table = kube_cluster.kubectl("get", "sdd", "-n", kube_namespace).stdout
    with capsys.disabled():
        print("\n" + table)
    header, row = table.strip().splitlines()
    assert header.split()[:5] == ["NAME", "READY", "PHASE", "GPUS", "MAX"]
    assert row.split()[:5] == ["llama70b", "True", "Ready", "2", str(status["plan"]["maxTotalTokens"])]


def test_tiny_cpu_demo_example_becomes_ready_without_a_gpu(kube_cluster, kube_namespace, operator, sdd_of):
    """manifests/examples/tiny-cpu-demo.yaml as shipped: CPU mode (spec.cpu), inline configs."""
    (example,) = [d for d in yaml.safe_load_all(TINY_CPU_DEMO.read_text()) if d]
    kube_cluster.apply(example, namespace=kube_namespace)
    sdd = sdd_of("tiny-cpu-demo")

    status = sdd.wait_ready()
    assert status["plan"]["tensorParallelSize"] == 1 and status["plan"]["gpu"] == "cpu"
    assert status["plan"]["gpusPerReplica"] == 0
    assert status["serving"]["readyReplicas"] == 1
    # `kubectl get sdd` shows no GPUs for a CPU-mode resource.
    table = kube_cluster.kubectl("get", "sdd", "tiny-cpu-demo", "-n", kube_namespace).stdout
    assert table.strip().splitlines()[1].split()[:4] == ["tiny-cpu-demo", "True", "Ready", "0"]
    deployment = sdd.deployment()
    pod_spec = deployment["spec"]["template"]["spec"]
    container = pod_spec["containers"][0]
    assert container["resources"] == {"requests": {"cpu": "2", "memory": "3Gi"}, "limits": {"memory": "3Gi"}}
    assert "affinity" not in pod_spec and "tolerations" not in pod_spec
    assert "nvidia.com/gpu" not in json.dumps(deployment["spec"])
    env = {e["name"]: e.get("value", "") for e in container["env"]}  # the API drops an empty value
    assert env["CUDA_VISIBLE_DEVICES"] == "" and env["NVIDIA_VISIBLE_DEVICES"] == "void"
    args = container["args"]
    assert args[:6] == ["--target", "/opt/specdeploy/demo/target", "--draft", "/opt/specdeploy/demo/draft", "--algorithm", "EAGLE"]
    (pod,) = [p for p in sdd.pods() if p["status"].get("phase") == "Running"]
    assert "nvidia.com/gpu" not in json.dumps(pod["spec"]["containers"][0]["resources"])


def test_spec_update_rolls_out(kube_cluster, kube_namespace, operator, hub_secret, manifest, sdd_of):
    kube_cluster.apply(manifest("roll", replicas=1), namespace=kube_namespace)
    sdd = sdd_of("roll")
    before = sdd.wait_ready()
    old_hash = template_hash(sdd.deployment())

    kube_cluster.kubectl(
        "patch", "sdd", "roll", "-n", kube_namespace, "--type=merge",
        "-p", json.dumps({"spec": {"engine": {"maxRunningRequests": 64}, "replicas": 2}}),
    )
    after = sdd.wait_ready()
    deployment = sdd.deployment()
    assert template_hash(deployment) != old_hash
    assert after["configHash"] == template_hash(deployment)
    assert after["observedGeneration"] == before["observedGeneration"] + 1
    assert after["plan"]["maxRunningRequests"] == 64
    assert "--max-running-requests" in (args := deployment["spec"]["template"]["spec"]["containers"][0]["args"])
    assert args[args.index("--max-running-requests") + 1] == "64"
    assert after["serving"]["readyReplicas"] == 2
    # Every running pod runs the new spec.
    wait_for(lambda: {p["metadata"]["annotations"][HASH] for p in sdd.pods() if not p["metadata"].get("deletionTimestamp")} == {after["configHash"]},
             timeout_s=30, what="only new pods")

    # The scale subresource: `kubectl scale` changes replicas without a rollout.
    kube_cluster.kubectl("scale", "sdd", "roll", "-n", kube_namespace, "--replicas=3")
    wait_for(lambda: sdd.status()["serving"]["readyReplicas"] == 3 and sdd.status()["phase"] == "Ready", timeout_s=60, what="3 ready")
    assert template_hash(sdd.deployment()) == after["configHash"]
    scale = json.loads(kube_cluster.kubectl("get", "--raw", f"/apis/specdeploy.dev/v1alpha1/namespaces/{kube_namespace}/specdecodedeployments/roll/scale").stdout)
    assert scale["status"]["replicas"] == 3
    assert scale["status"]["selector"] == "app.kubernetes.io/instance=roll,app.kubernetes.io/name=specdeploy-engine"


def test_unfittable_spec_gets_a_reason_and_no_deployment(kube_cluster, kube_namespace, operator, hub_secret, manifest, sdd_of):
    kube_cluster.apply(manifest("toobig", gpu={"product": "h100", "perNode": 1}), namespace=kube_namespace)
    sdd = sdd_of("toobig")
    plan_ready = wait_for(lambda: sdd.condition("PlanReady").get("reason") == "InsufficientGPUMemory" and sdd.condition("PlanReady"),
                          timeout_s=30, what="PlanReady=False InsufficientGPUMemory")
    assert plan_ready["status"] == "False"
    assert "GiB" in plan_ready["message"] and "h100" in plan_ready["message"]
    assert sdd.status()["phase"] == "Failed"
    assert sdd.deployment() is None
    wait_for(lambda: "InsufficientGPUMemory" in reasons(sdd), timeout_s=10, what="warning event")

    # Made to fit: served.
    kube_cluster.kubectl("patch", "sdd", "toobig", "-n", kube_namespace, "--type=merge", "-p", '{"spec":{"gpu":{"perNode":8}}}')
    status = sdd.wait_ready()
    assert status["plan"]["tensorParallelSize"] == 4  # 70B + head on 80 GB parts
    assert gpu_request(sdd.deployment()) == 4

    # An update that no longer fits takes the engine down rather than leave the old spec serving.
    kube_cluster.kubectl("patch", "sdd", "toobig", "-n", kube_namespace, "--type=merge", "-p", '{"spec":{"gpu":{"perNode":2}}}')
    wait_for(lambda: sdd.deployment() is None, timeout_s=30, what="Deployment removed")
    wait_for(lambda: sdd.status().get("phase") == "Failed", timeout_s=10, what="phase Failed")
    assert sdd.condition("Ready")["status"] == "False"
    assert "plan" not in sdd.status()


def test_plan_file_prints_the_plan_the_operator_writes(kube_cluster, kube_namespace, operator, hub_url, hub_secret,
                                                        manifest, sdd_of, tmp_path, capsys):
    """`specdeploy plan -f` of the applied file (with the token Secret beside it) reads the same hub
    files and gives the ConfigMap's plan.json, byte for byte as JSON."""
    from specdeploy.cli import main

    resource = manifest("planfile", replicas=1)
    kube_cluster.apply(resource, namespace=kube_namespace)
    sdd_of("planfile").wait_ready()
    (config_map,) = [c for c in sdd_of("planfile").owned("configmaps") if c["metadata"]["name"] == "planfile-engine"]
    path = tmp_path / "planfile.yaml"
    secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "hub-token"},
              "stringData": {"token": "hf_test_token"}}   # conftest.token_secret, as hub_secret applied it
    path.write_text(yaml.safe_dump_all([resource, secret]))
    capsys.readouterr()
    assert main(["plan", "-f", str(path), "--hub-endpoint", hub_url, "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == json.loads(config_map["data"]["plan.json"])


def test_a_mismatched_pair_is_refused_before_any_child_exists(kube_cluster, kube_namespace, operator, hub_secret,
                                                               manifest, sdd_of):
    """The 70B target with the 8B model's EAGLE-3 head (hidden 8192 vs 4096): PlanReady=False
    DraftIncompatible naming both numbers, phase Failed, no ConfigMap, Deployment or Service."""
    kube_cluster.apply(manifest("mismatch", draft={"model": "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B"}),
                       namespace=kube_namespace)
    sdd = sdd_of("mismatch")
    cond = wait_for(lambda: sdd.condition("PlanReady").get("reason") == "DraftIncompatible" and sdd.condition("PlanReady"),
                    timeout_s=30, what="DraftIncompatible")
    assert cond["status"] == "False" and "8192" in cond["message"] and "4096" in cond["message"]
    assert sdd.status()["phase"] == "Failed"
    assert sdd.deployment() is None
    assert sdd.owned("configmaps") == [] and sdd.owned("services") == []


def test_config_problems_name_the_url_or_field(kube_cluster, kube_namespace, operator, hub_url, hub_secret, manifest, sdd_of):
    kube_cluster.apply(manifest("nohub", target={"model": "meta-llama/Nope", "revision": "v9"}), namespace=kube_namespace)
    sdd = sdd_of("nohub")
    cond = wait_for(lambda: sdd.condition("PlanReady").get("reason") == "ConfigNotFound" and sdd.condition("PlanReady"),
                    timeout_s=30, what="ConfigNotFound")
    assert f"{hub_url}/meta-llama/Nope/resolve/v9/config.json" in cond["message"]
    assert sdd.deployment() is None

    # A missing ConfigMap is retried: creating it later is enough.
    draft = {"model": "/models/eagle3", "configMapRef": {"name": "eagle3-config"}}
    kube_cluster.apply(manifest("later", draft=draft, replicas=1), namespace=kube_namespace)
    later = sdd_of("later")
    cond = wait_for(lambda: later.condition("PlanReady").get("reason") == "ConfigNotFound" and later.condition("PlanReady"),
                    timeout_s=30, what="ConfigNotFound for the ConfigMap")
    assert "spec.draft.configMapRef" in cond["message"] and later.status()["phase"] == "Pending"
    kube_cluster.apply(
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "eagle3-config"},
         "data": {"config.json": EAGLE3_CONFIG.read_text()}},
        namespace=kube_namespace,
    )
    later.wait_ready()

    # Unparsable config: the reason names the field.
    kube_cluster.apply(manifest("badcfg", draft={"model": "/models/x", "config": {"model_type": "llama"}}), namespace=kube_namespace)
    bad = sdd_of("badcfg")
    cond = wait_for(lambda: bad.condition("PlanReady").get("reason") == "ConfigInvalid" and bad.condition("PlanReady"),
                    timeout_s=30, what="ConfigInvalid")
    assert cond["message"].startswith("spec.draft config.json:")


def test_paused_resource_is_left_alone(kube_cluster, kube_namespace, operator, hub_secret, manifest, sdd_of):
    paused_new = manifest("frozen")
    paused_new["metadata"]["annotations"] = {"specdeploy.dev/paused": "true"}
    kube_cluster.apply(paused_new, namespace=kube_namespace)
    frozen = sdd_of("frozen")
    wait_for(lambda: frozen.status().get("phase") == "Paused", timeout_s=30, what="phase Paused")
    assert frozen.deployment() is None and frozen.owned("configmaps") == []

    kube_cluster.apply(manifest("live", replicas=1), namespace=kube_namespace)
    live = sdd_of("live")
    live.wait_ready()
    old = live.deployment()
    kube_cluster.kubectl("annotate", "sdd", "live", "-n", kube_namespace, "specdeploy.dev/paused=true")
    wait_for(lambda: live.status().get("phase") == "Paused", timeout_s=30, what="phase Paused")
    kube_cluster.kubectl("patch", "sdd", "live", "-n", kube_namespace, "--type=merge", "-p", '{"spec":{"replicas":3,"engine":{"contextLength":4096}}}')
    kube_cluster.kubectl("wait", "sdd/live", "-n", kube_namespace, "--for=jsonpath={.status.phase}=Paused", "--timeout=10s")
    unchanged = live.deployment()
    assert unchanged["metadata"]["generation"] == old["metadata"]["generation"]
    assert unchanged["spec"]["replicas"] == 1 and template_hash(unchanged) == template_hash(old)

    kube_cluster.kubectl("annotate", "sdd", "live", "-n", kube_namespace, "specdeploy.dev/paused-")
    status = live.wait_ready()
    assert status["serving"]["readyReplicas"] == 3
    assert template_hash(live.deployment()) != template_hash(old)


def test_deleted_deployment_returns_and_delete_collects_the_children(kube_cluster, kube_namespace, operator, hub_secret, manifest, sdd_of):
    kube_cluster.apply(manifest("gone", replicas=1), namespace=kube_namespace)
    sdd = sdd_of("gone")
    sdd.wait_ready()

    # A Deployment deleted from outside comes back.
    first_uid = sdd.deployment()["metadata"]["uid"]
    kube_cluster.kubectl("delete", "deployment", "gone", "-n", kube_namespace)
    wait_for(lambda: (d := sdd.deployment()) and d["metadata"]["uid"] != first_uid, timeout_s=30, what="Deployment re-applied")
    sdd.wait_ready()
    assert "DeploymentDeleted" in reasons(sdd)

    kube_cluster.kubectl("delete", "sdd", "gone", "-n", kube_namespace)
    wait_for(
        lambda: not any(sdd.owned(kind) for kind in ("deployments", "services", "configmaps", "pods")),
        timeout_s=60, what="children garbage-collected",
    )


def test_operator_killed_mid_way_leaves_no_duplicates_or_orphans(kube_cluster, kube_namespace, operator_process, hub_secret, manifest, sdd_of):
    first = operator_process()
    kube_cluster.apply(manifest("phoenix", replicas=2), namespace=kube_namespace)
    sdd = sdd_of("phoenix")
    # Kill as soon as the Deployment exists: the rollout and status are unfinished.
    wait_for(sdd.deployment, timeout_s=60, what="Deployment from the first operator")
    first.kill()

    # While no operator runs, the spec changes.
    kube_cluster.kubectl("patch", "sdd", "phoenix", "-n", kube_namespace, "--type=merge", "-p", '{"spec":{"engine":{"contextLength":4096}}}')

    liveness_port = free_port()
    second = operator_process(liveness_port=liveness_port)
    healthz = wait_for(lambda: httpx.get(f"http://127.0.0.1:{liveness_port}/healthz", timeout=2), timeout_s=60, what="liveness endpoint")
    assert healthz.status_code == 200
    try:
        status = sdd.wait_ready(timeout_s=90)
    except TimeoutError as err:
        raise AssertionError(f"{err}\nfirst operator:\n{first.logs()}\nsecond operator:\n{second.logs()}") from None
    assert status["plan"]["contextLength"] == 4096
    assert [d["metadata"]["name"] for d in sdd.owned("deployments")] == ["phoenix"]
    assert [s["metadata"]["name"] for s in sdd.owned("services")] == ["phoenix"]
    assert [c["metadata"]["name"] for c in sdd.owned("configmaps")] == ["phoenix-engine"]
    uid = sdd.get()["metadata"]["uid"]
    for kind in ("deployments", "services", "configmaps"):
        for obj in sdd.owned(kind):
            assert [r["uid"] for r in obj["metadata"]["ownerReferences"]] == [uid]
    # Two pods, both of the new spec; none orphaned from the killed operator's rollout.
    wait_for(
        lambda: sorted(p["metadata"]["annotations"][HASH] for p in sdd.pods() if not p["metadata"].get("deletionTimestamp"))
        == [status["configHash"]] * 2,
        timeout_s=30, what="exactly 2 pods of the new spec",
    )
    # Plain lines for `kubectl logs`, each decision prefixed by the resource; routine noise dropped.
    logs = second.logs().splitlines()
    prefix = f"[{kube_namespace}/phoenix] "
    assert any(line.startswith(prefix + "planned from ") for line in logs), logs
    assert any(line.startswith(prefix + "applied ConfigMap, Deployment (2 x 2 GPU") for line in logs), logs
    assert not any("Handler 'engine-deployment' succeeded" in line for line in logs)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_foreign_objects_are_never_taken_over_or_deleted(kube_cluster, kube_namespace, operator, hub_secret, manifest, sdd_of):
    foreign = {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": "taken", "labels": {"app": "someone-else"}},
        "spec": {
            "replicas": 0,
            "selector": {"matchLabels": {"app": "someone-else"}},
            "template": {"metadata": {"labels": {"app": "someone-else"}}, "spec": {"containers": [{"name": "c", "image": "nginx"}]}},
        },
    }
    kube_cluster.apply(foreign, namespace=kube_namespace)
    before = kube_cluster.kubectl_json("get", "deployment", "taken", "-n", kube_namespace)
    kube_cluster.apply(manifest("taken", replicas=1), namespace=kube_namespace)
    sdd = sdd_of("taken")
    ready = wait_for(lambda: sdd.condition("Ready").get("reason") == "ChildConflict" and sdd.condition("Ready"),
                     timeout_s=30, what="Ready=False ChildConflict")
    assert "Deployment" in ready["message"] and "taken" in ready["message"]
    assert sdd.status()["phase"] == "Pending"

    # Unfittable now: the engine would be removed, but this Deployment is not the engine.
    kube_cluster.kubectl("patch", "sdd", "taken", "-n", kube_namespace, "--type=merge", "-p", '{"spec":{"gpu":{"product":"l40s","perNode":1}}}')
    wait_for(lambda: sdd.status().get("phase") == "Failed", timeout_s=30, what="phase Failed")
    after = kube_cluster.kubectl_json("get", "deployment", "taken", "-n", kube_namespace)
    assert after["metadata"]["uid"] == before["metadata"]["uid"]
    assert after["metadata"]["generation"] == before["metadata"]["generation"]
    assert not after["metadata"].get("ownerReferences")

    # A foreign Service is found before anything is applied: no Deployment (GPU pods without a
    # Service) and no ConfigMap are left behind while the status says ChildConflict.
    kube_cluster.apply(
        {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "clash"},
         "spec": {"selector": {"app": "someone-else"}, "ports": [{"port": 80}]}},
        namespace=kube_namespace,
    )
    kube_cluster.apply(manifest("clash", replicas=1), namespace=kube_namespace)
    clash = sdd_of("clash")
    ready = wait_for(lambda: clash.condition("Ready").get("reason") == "ChildConflict" and clash.condition("Ready"),
                     timeout_s=30, what="Ready=False ChildConflict (Service)")
    assert "Service" in ready["message"] and "clash" in ready["message"]
    assert clash.deployment() is None
    assert clash.items("configmaps", "--field-selector", "metadata.name=clash-engine") == []


def test_fp8_checkpoint_counted_from_its_headers(kube_cluster, kube_namespace, operator, hub_url, hub_secret,
                                                 manifest, sdd_of):
    """Llama-3.3-70B as an FP8 checkpoint on the hub, with an FP8 KV cache: the operator reads its
    index and safetensors headers (range requests; nothing else), counts about 71 GB instead of
    the 141 GB of bf16, and the plan fits one H200 per replica where bf16 needed two."""
    model = "RedHatAI/Llama-3.3-70B-Instruct-FP8-dynamic"  # conftest.FP8_70B
    engine = {"maxRunningRequests": 32, "contextLength": 8192, "kvCacheDtype": "fp8_e4m3"}
    kube_cluster.apply(manifest("fp8", target={"model": model}, engine=engine), namespace=kube_namespace)
    sdd = sdd_of("fp8")
    deployment = wait_for(sdd.deployment, timeout_s=30, what="engine Deployment")
    assert gpu_request(deployment) == 1
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--kv-cache-dtype") + 1] == "fp8_e4m3"
    plan = wait_for(lambda: (sdd.status() or {}).get("plan"), timeout_s=30, what="status.plan")
    index = httpx.get(f"{hub_url}/{model}/resolve/main/model.safetensors.index.json",
                      headers={"Authorization": "Bearer hf_test_token"}).json()
    assert plan["weightsSource"] == "headers" and plan["gpusPerReplica"] == 1
    (config_map,) = [c for c in sdd.owned("configmaps") if c["metadata"]["name"] == "fp8-engine"]
    full = json.loads(config_map["data"]["plan.json"])   # status.plan is its summary
    assert full["target"]["weight_bytes"] == index["metadata"]["total_size"] < 75e9
    assert full["target"]["kv_cache_dtype"] == "fp8_e4m3"
