"""Scaling through the resource's scale subresource, with real engine pods and nothing lost.

manifests/examples/tiny-cpu-demo.yaml at two replicas, both run for real by a LocalKubelet. A
client sends a bounded load to the ready endpoints of the resource's Service (its pods that are
Ready and not terminating, as the endpoints controller picks them); meanwhile the resource is scaled
through /scale, the endpoint an autoscaler writes (`kubectl scale` calls the same): up to three,
then down to one. Every request is answered, and the pods that go drain: the engine exits 0
after its SIGTERM drain, having finished what it had."""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml
from demo_pair import IMAGE_DEMO_DIR, build_demo_pair
from testcluster import wait_for
from testcluster.local_kubelet import LocalKubelet

TINY_CPU_DEMO = Path(__file__).resolve().parents[2] / "manifests" / "examples" / "tiny-cpu-demo.yaml"


@pytest.fixture(scope="module")
def demo_pair(tmp_path_factory) -> Path:
    return build_demo_pair(tmp_path_factory.mktemp("image") / "demo", yaml.safe_load(TINY_CPU_DEMO.read_text()))


@pytest.fixture
def local_kubelet(kube_cluster, demo_pair, tmp_path):
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    kubelet = LocalKubelet(kube_cluster, tmp_path / "kubelet", image_paths={IMAGE_DEMO_DIR: demo_pair}, path=path)
    kubelet.start()
    cordoned = kubelet.cordon_others()
    try:
        yield kubelet
    finally:
        kubelet.uncordon(cordoned)
        kubelet.stop()


class Load:
    """Completions to the Service's ready endpoints from a few clients, until stopped."""

    def __init__(self, cluster, namespace: str, selector: dict[str, str], model: str, clients: int = 3):
        self.cluster, self.namespace, self.selector, self.model = cluster, namespace, selector, model
        self.done = threading.Event()
        self.results: list[tuple[str, int | str]] = []  # (endpoint, status code or error)
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(clients)]
        self.lock = threading.Lock()
        self.endpoints: list[str] = []
        self.watcher = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        # The Service's endpoints as its EndpointSlice controller picks them: pods of its selector
        # that are Ready and not terminating. (The controller itself leaves out the local node's
        # loopback pod IPs, which no EndpointSlice may hold, so they are read from the pods.)
        selector = ",".join(f"{k}={v}" for k, v in self.selector.items())
        while not self.done.is_set():
            try:
                pods = self.cluster.kubectl_json("get", "pods", "-n", self.namespace, "-l", selector)["items"]
                ready = [p["status"]["podIP"] for p in pods if not p["metadata"].get("deletionTimestamp")
                         and p["status"].get("podIP")
                         and any(c["type"] == "Ready" and c["status"] == "True" for c in p["status"].get("conditions") or [])]
                with self.lock:
                    self.endpoints = ready
            except Exception:  # noqa: BLE001 - the next read
                pass
            time.sleep(0.2)

    def _run(self) -> None:
        turn = 0
        with httpx.Client(timeout=120) as client:
            while not self.done.is_set():
                with self.lock:
                    endpoints = list(self.endpoints)
                if not endpoints:
                    time.sleep(0.1)
                    continue
                ip = endpoints[turn % len(endpoints)]
                turn += 1
                try:
                    r = client.post(f"http://{ip}:8000/v1/completions",
                                    json={"model": self.model, "prompt": "def fibonacci(n):", "max_tokens": 32})
                    self.results.append((ip, r.status_code))
                except httpx.HTTPError as err:
                    self.results.append((ip, type(err).__name__))

    def __enter__(self) -> Load:
        self.watcher.start()
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.done.set()
        for t in self.threads:
            t.join(150)
        self.watcher.join(10)


def test_scale_up_and_down_through_the_scale_subresource_loses_nothing(
    kube_cluster, kube_namespace, local_kubelet, operator_process, sdd_of, demo_pair, capsys,
):
    operator_process(metrics_interval_s=0)
    resource = yaml.safe_load(TINY_CPU_DEMO.read_text())
    resource["spec"]["replicas"] = 2
    kube_cluster.apply(resource, namespace=kube_namespace)
    sdd = sdd_of("tiny-cpu-demo")
    wait_for(lambda: sdd.status().get("phase") == "Ready" and sdd.status()["serving"]["readyReplicas"] == 2,
             timeout_s=240, what="2 replicas Ready")
    (budget,) = sdd.owned("poddisruptionbudgets")
    assert budget["spec"]["maxUnavailable"] == 1

    def scale(replicas: int) -> None:
        kube_cluster.kubectl("scale", "sdd", "tiny-cpu-demo", "-n", kube_namespace, f"--replicas={replicas}")

    model = str(demo_pair / "target")
    (service,) = sdd.owned("services")
    with Load(kube_cluster, kube_namespace, service["spec"]["selector"], model) as load:
        wait_for(lambda: len(load.results) >= 6, timeout_s=120, what="requests before scaling")
        scale(3)
        wait_for(lambda: sdd.status()["serving"].get("readyReplicas") == 3, timeout_s=240, what="3 replicas Ready")
        first = {r.name: r for r in local_kubelet.running(kube_namespace)}
        served_by = wait_for(lambda: len({ip for ip, _ in load.results}) == 3 and {ip for ip, _ in load.results},
                             timeout_s=120, what="all three replicas serving")
        assert len(served_by) == 3
        before = len(load.results)
        scale(1)
        wait_for(lambda: len(local_kubelet.running(kube_namespace)) == 1 and sdd.status()["serving"].get("replicas") == 1,
                 timeout_s=240, what="down to one replica")
        wait_for(lambda: len(load.results) >= before + 6, timeout_s=120, what="requests after scaling down")

    failures = [r for r in load.results if r[1] != 200]
    with capsys.disabled():
        print(f"\nscale 2 -> 3 -> 1 under load: {len(load.results)} requests, {len(failures)} not answered;"
              f" {before} before the scale-down, {len(load.results) - before} during and after it")
    assert not failures, f"{len(failures)} of {len(load.results)} requests not answered: {failures[:10]}"
    # The removed pods' engines drained: SIGTERM, their requests finished, exit 0.
    (kept,) = local_kubelet.running(kube_namespace)
    removed = [r for name, r in first.items() if name != kept.name]
    assert len(removed) == 2
    for runner in removed:
        runner.join(150)  # preStop, SIGTERM, the drain
        assert not runner.is_alive()
        (engine,) = runner.containers
        assert engine.proc is not None and engine.proc.returncode == 0, (runner.name, engine.proc and engine.proc.returncode)
    assert sdd.get()["spec"]["replicas"] == 1 and sdd.status()["phase"] == "Ready"
