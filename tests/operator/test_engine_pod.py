"""The loop closed: the Deployment the operator renders for manifests/examples/tiny-cpu-demo.yaml
is run for real, and what the engine measures comes back into the resource's status.

A LocalKubelet (tests/cluster/testcluster/local_kubelet.py) owns one node of the test cluster and
runs that pod's container exactly as rendered — command, args, env, the ConfigMap mounted at its
path, its probes — as a process on a loopback address that it reports as the pod's IP. The image's
demo pair (/opt/specdeploy/demo in Dockerfile.engine) is a pair built here with the example's exact
config.json. The operator runs as `specdeploy operator`, scrapes the pod's /metrics, and
`kubectl get sdd` shows the accept length and tok/s; killing the engine turns the resource
Degraded, and the kubelet's restart makes it Ready again.
"""

from __future__ import annotations

import copy
import threading
import time
from pathlib import Path

import httpx
import pytest
from demo_pair import IMAGE_DEMO_DIR, TINY_CPU_DEMO
from testcluster import wait_for


class Traffic:
    """Completions sent to the engine pod's address in a loop, so that its throughput gauge moves."""

    def __init__(self, base_url: str, model: str):
        self.base_url, self.model = base_url, model
        self.done = threading.Event()
        self.completed = 0
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=60) as client:
            while not self.done.is_set():
                try:
                    r = client.post(f"{self.base_url}/v1/completions",
                                    json={"model": self.model, "prompt": "def fibonacci(n):", "max_tokens": 48})
                    self.completed += r.status_code == 200
                except httpx.TransportError:
                    time.sleep(0.2)

    def __enter__(self) -> Traffic:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.done.set()
        self.thread.join(90)


def test_the_rendered_engine_pod_runs_and_reports_into_status(
    kube_cluster, kube_namespace, local_kubelet, operator_process, sdd_of, example, demo_pair, capsys,
):
    operator = operator_process(metrics_interval_s=2)
    kube_cluster.apply(TINY_CPU_DEMO.read_text(), namespace=kube_namespace)
    sdd = sdd_of("tiny-cpu-demo")
    deployment = wait_for(sdd.deployment, timeout_s=60, what="the engine Deployment")
    template = deployment["spec"]["template"]["spec"]
    (container,) = template["containers"]

    pod = wait_for(lambda: [p for p in sdd.pods() if p["spec"].get("nodeName") == local_kubelet.node_name
                            and p["status"].get("podIP")], timeout_s=60, what="the engine pod on the local node")[0]
    runner = local_kubelet.runner(kube_namespace, pod["metadata"]["name"])
    ip = pod["status"]["podIP"]
    assert ip.startswith("127.") and ip != "127.0.0.1"

    # Exactly the rendered container: its command and args, with the image's and the volumes'
    # paths moved to where they are on this machine and 0.0.0.0 meaning the pod's own address.
    (engine,) = runner.containers
    config_dir = next(Path(a).parent for a in engine.argv if a.endswith("/plan.json"))
    expected = [*container["command"], *container["args"]]
    mapped = {"0.0.0.0": ip}
    for arg in expected:
        if arg.startswith(IMAGE_DEMO_DIR):
            mapped[arg] = str(demo_pair) + arg[len(IMAGE_DEMO_DIR):]
        elif arg.startswith("/etc/specdeploy/"):
            mapped[arg] = str(config_dir / arg.rsplit("/", 1)[1])
    assert engine.argv[1:] == [mapped.get(a, a) for a in expected[1:]]
    assert Path(engine.argv[0]).name == container["command"][0]
    # The ConfigMap's files, as mounted: the plan the engine allocates is the one in status.
    (config_map,) = [c for c in sdd.owned("configmaps") if c["metadata"]["name"] == "tiny-cpu-demo-engine"]
    for key, text in config_map["data"].items():
        assert (config_dir / key).read_text() == text
    # Its env, exactly (the model cache mount mapped too), and nothing of this process's but PATH,
    # HOME, LANG and thread counts; the apiserver's Service variables, as a kubelet sets them.
    volumes = {m["mountPath"]: str(runner.dir / "volumes" / m["name"]) for m in container["volumeMounts"]}
    for var in container["env"]:
        assert engine.env[var["name"]] == volumes.get(var.get("value"), var.get("value", ""))
    assert set(engine.env) - {v["name"] for v in container["env"]} <= {
        "PATH", "HOME", "LANG", "LC_ALL", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "TMPDIR", "HOSTNAME", "PYTHONPATH",
        "KUBERNETES_SERVICE_HOST", "KUBERNETES_SERVICE_PORT", "KUBERNETES_SERVICE_PORT_HTTPS"}
    assert {k: p.spec for k, p in engine.probes.items()} == {
        k: container[k] for k in ("startupProbe", "livenessProbe", "readinessProbe")}

    status = sdd.wait_ready(timeout_s=180)
    assert status["serving"]["readyReplicas"] == 1
    base_url = f"http://{ip}:8000"
    assert httpx.get(f"{base_url}/ready").status_code == 200

    # The engine serves its --target as the model id: here the mapped path of the image's demo pair.
    (model,) = [m["id"] for m in httpx.get(f"{base_url}/v1/models").json()["data"]]
    assert model == str(demo_pair / "target")
    with Traffic(base_url, model) as traffic:
        try:
            serving = wait_for(
                lambda: (s := sdd.status().get("serving") or {}).get("meanAcceptLength", 0) > 1
                and s.get("tokensPerSecond", 0) > 0 and s,
                timeout_s=90, what="the scraped accept length and tok/s in status.serving",
            )
        except TimeoutError as err:
            metrics = httpx.get(f"{base_url}/metrics").text
            pytest.fail(f"{err}\nstatus.serving: {sdd.status().get('serving')}\ncompleted: {traffic.completed}\n"
                        f"engine metrics: {[m for m in metrics.splitlines() if 'spec_decode_num' in m or 'per_second' in m]}\n"
                        f"operator log:\n{operator.logs()[-4000:]}")
    assert traffic.completed > 0
    table = kube_cluster.kubectl("get", "sdd", "-n", kube_namespace).stdout
    with capsys.disabled():
        print("\n" + table)
    header, row = table.strip().splitlines()
    columns = dict(zip(["NAME", "READY", "PHASE", "GPUS", "MAX", "ACCEPT", "TOK/S"], row.split()))
    assert "ACCEPT LENGTH" in header and "TOK/S" in header
    assert columns["READY"] == "True" and columns["GPUS"] == "0"
    assert float(columns["ACCEPT"]) > 1 and float(columns["TOK/S"]) > 0
    assert float(columns["ACCEPT"]) == pytest.approx(serving["meanAcceptLength"], abs=0.5)

    # The engine dies: the pod is no longer ready, the resource is Degraded ...
    pid = runner.kill()
    degraded = wait_for(
        lambda: sdd.condition("Degraded").get("status") == "True" and sdd.condition("Degraded"),
        timeout_s=30, what="Degraded after the engine was killed",
    )
    # The pod says why (the kubelet's crash-loop back-off), else the counts do.
    assert degraded["reason"] in ("CrashLoopBackOff", "ReplicasUnavailable")
    assert sdd.condition("Ready")["status"] == "False"
    # ... and the kubelet restarts it (crash-loop back-off), which makes it Ready again.
    wait_for(lambda: engine.proc is not None and engine.proc.pid != pid, timeout_s=30, what="the restart")
    sdd.wait_ready(timeout_s=120)
    assert sdd.condition("Degraded")["status"] == "False"
    restarted = kube_cluster.kubectl_json("get", "pod", pod["metadata"]["name"], "-n", kube_namespace)
    assert restarted["status"]["containerStatuses"][0]["restartCount"] == 1
    assert restarted["status"]["containerStatuses"][0]["lastState"]["terminated"]["exitCode"] != 0
    assert "Traceback" not in operator.logs()


def test_model_cache_claim_keeps_downloaded_weights_for_restarts_and_new_replicas(
    kube_cluster, kube_namespace, local_kubelet, operator_process, sdd_of, example, demo_pair,
):
    """spec.modelCache: the operator's claim (bound here to a PersistentVolume the test makes, as
    a provisioner would) holds HF_HOME; the first pod downloads the weights from the hub, a
    restarted pod and a second replica find them there."""
    from model_hub import FakeHub  # tests/support/model_hub.py

    hub = FakeHub({"org/tiny": demo_pair / "target", "org/tiny-eagle": demo_pair / "draft"}, token="cache-token")
    try:
        kube_cluster.apply([
            {"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": f"cache-{kube_namespace}"},
             "spec": {"capacity": {"storage": "10Gi"}, "accessModes": ["ReadWriteOnce"], "storageClassName": "local-test",
                      "persistentVolumeReclaimPolicy": "Delete",
                      "claimRef": {"namespace": kube_namespace, "name": "tiny-model-cache"},
                      "hostPath": {"path": f"/tmp/unused-{kube_namespace}"}}},
            {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "hub-token", "namespace": kube_namespace},
             "stringData": {"token": "cache-token"}},
        ])
        resource = copy.deepcopy(example)
        resource["metadata"]["name"] = "tiny"
        resource["spec"]["target"]["model"] = "org/tiny"
        resource["spec"]["draft"]["model"] = "org/tiny-eagle"
        resource["spec"]["hub"] = {"endpoint": hub.url, "tokenSecretRef": {"name": "hub-token"}}
        resource["spec"]["modelCache"] = {"storageClassName": "local-test"}
        # The resource names its own hub and a token: the operator must be told to trust it.
        operator_process(metrics_interval_s=0, trusted_hub_endpoints=(hub.url,))
        kube_cluster.apply(resource, namespace=kube_namespace)
        sdd = sdd_of("tiny")
        status = sdd.wait_ready(timeout_s=180)

        claim = kube_cluster.kubectl_json("get", "pvc", "tiny-model-cache", "-n", kube_namespace)
        assert claim["metadata"]["ownerReferences"][0]["name"] == "tiny"
        assert claim["spec"]["storageClassName"] == "local-test" and claim["status"]["phase"] == "Bound"
        assert claim["spec"]["resources"]["requests"]["storage"] == status["modelCache"]["size"] == "3Gi"
        assert status["modelCache"]["volume"] == "PersistentVolumeClaim"
        assert status["modelCache"]["claimName"] == "tiny-model-cache" and status["modelCache"]["managed"] is True
        assert [(w["role"], w["source"], w["endpoint"]) for w in status["modelCache"]["weights"]] == [
            ("target", "Hub", hub.url), ("draft", "Hub", hub.url)]

        def weight_downloads() -> int:
            return sum(r.endswith(".safetensors") for r in hub.requests)

        assert weight_downloads() == 2  # target and draft, once each
        (first,) = local_kubelet.running(kube_namespace)
        cache_dir = local_kubelet.workdir / "volumes" / kube_namespace / "tiny-model-cache"
        assert first.containers[0].env["HF_HOME"] == str(cache_dir)
        assert list(cache_dir.glob("hub/models--org--tiny/snapshots/*/model.safetensors"))

        # A restarted pod (deleted; the Deployment makes a new one) and a second replica.
        kube_cluster.kubectl("delete", "pod", first.name, "-n", kube_namespace, "--wait=false")
        kube_cluster.kubectl("patch", "sdd", "tiny", "-n", kube_namespace, "--type=merge", "-p", '{"spec":{"replicas":2}}')
        wait_for(lambda: (s := sdd.status()).get("phase") == "Ready" and s["serving"]["readyReplicas"] == 2
                 and first.name not in {r.name for r in local_kubelet.running(kube_namespace)},
                 timeout_s=180, what="two new replicas Ready")
        assert len(local_kubelet.running(kube_namespace)) == 2
        assert weight_downloads() == 2, hub.requests  # both started from the cache
    finally:
        hub.close()
        kube_cluster.kubectl("delete", "pv", f"cache-{kube_namespace}", "--wait=false", check=False)
