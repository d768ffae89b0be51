"""The autoscaling loop closed on the test cluster: kube-controller-manager's HPA controller scales
a SpecDecodeDeployment through its scale subresource on `specdeploy_saturation`, read from a real
metrics pipeline (tests/support/metrics_pipeline.py): Prometheus scraping the engine pods that a
LocalKubelet runs for real (each in a network namespace of its own), prometheus-adapter with the
shipped rules (manifests/autoscaling/prometheus-adapter-rules.yaml) behind the apiserver's
aggregation layer, and the HorizontalPodAutoscaler the operator renders from spec.autoscaling.

manifests/examples/tiny-cpu-demo.yaml (maxRunningRequests 4) at one replica, autoscaled between
one and two on Saturation with a target of 0.3 per replica and a 5 s scale-down window. One client
sends completions to the ready endpoints the whole time; three more for a bounded burst drive the
replica's saturation to about 1, and the HPA adds the second replica; once the burst is over the
one client's load is far below the target and the HPA removes a replica again, which drains.
Every request is answered. Needs Prometheus (Debian's `prometheus`), prometheus-adapter (`make
tools`) and root for the pod network; it skips and says which is missing."""

from __future__ import annotations

import json
import os
import time
import uuid
from pathlib import Path

import httpx
import pytest
import yaml
from local_node import local_node
from demo_pair import TINY_CPU_DEMO
from load import Load
from metrics_pipeline import MetricsAdapter, PodTargets, Prometheus, adapter_binary, prometheus_binary
from testcluster import wait_for

from specdeploy.localcluster import netns

METRIC = "specdeploy_saturation"
AUTOSCALING = {"metric": "Saturation", "minReplicas": 1, "maxReplicas": 2, "targetValue": "0.3",
               "scaleDownStabilizationSeconds": 5}


# Session-scoped and the test's first argument, so that a missing piece skips before a cluster starts.
@pytest.fixture(scope="session")
def pipeline_binaries() -> tuple[Path, Path]:
    prometheus, adapter = prometheus_binary(), adapter_binary()
    if prometheus is None:
        pytest.skip("no `prometheus` on PATH (Debian: apt-get install prometheus)")
    if not os.access(adapter, os.X_OK):
        pytest.skip(f"prometheus-adapter is not built ({adapter} missing): run `make tools`")
    why = netns.available()
    if why:
        pytest.skip(f"the engine pods' network: {why}")
    return prometheus, adapter


@pytest.fixture
def pod_network(pipeline_binaries):
    network = netns.NamespaceNetwork(f"h{uuid.uuid4().hex[:4]}").setup()
    try:
        yield network
    finally:
        netns.teardown(network.tag)


@pytest.fixture
def local_kubelet(kube_cluster, demo_pair, pod_network, tmp_path):
    """conftest's local node, its pods each in a network namespace of their own."""
    with local_node(kube_cluster, tmp_path / "kubelet", demo_pair, network=pod_network) as kubelet:
        yield kubelet


@pytest.fixture
def prometheus(pipeline_binaries, tmp_path):
    server = Prometheus(pipeline_binaries[0], tmp_path / "prometheus").start()
    yield server
    server.stop()


@pytest.fixture
def adapter(pipeline_binaries, kube_cluster, kube_namespace, pod_network, prometheus, tmp_path):
    server = MetricsAdapter(pipeline_binaries[1], kube_cluster, tmp_path / "adapter", pod_network.node_ip,
                            kube_namespace, prometheus.url)
    try:
        yield server.start()
    finally:
        server.stop()


def test_the_hpa_scales_on_saturation_from_prometheus_and_back_losing_nothing(
    pipeline_binaries, kube_cluster, kube_namespace, local_kubelet, operator_process, sdd_of, demo_pair, prometheus, adapter, capsys,
):
    operator_process(metrics_interval_s=0)
    resource = yaml.safe_load(TINY_CPU_DEMO.read_text())
    resource["spec"]["autoscaling"] = AUTOSCALING
    kube_cluster.apply(resource, namespace=kube_namespace)
    sdd = sdd_of("tiny-cpu-demo")
    wait_for(lambda: sdd.status().get("phase") == "Ready" and sdd.status()["serving"].get("readyReplicas") == 1,
             timeout_s=180, what="1 replica Ready")
    (hpa,) = sdd.owned("horizontalpodautoscalers")
    assert hpa["spec"]["behavior"]["scaleDown"]["stabilizationWindowSeconds"] == 5
    (service,) = sdd.owned("services")
    selector = service["spec"]["selector"]

    def hpa_status() -> dict:
        return kube_cluster.kubectl_json("get", "hpa", "tiny-cpu-demo", "-n", kube_namespace).get("status") or {}

    def saturation(status: dict) -> str | None:
        for m in status.get("currentMetrics") or []:
            if m.get("type") == "Pods" and m["pods"]["metric"]["name"] == METRIC:
                return m["pods"]["current"]["averageValue"]
        return None

    def diagnostics() -> str:
        return (f"targets: {[(t['labels'], t['health'], t.get('lastError')) for t in prometheus.active_targets()]}\n"
                f"prometheus {METRIC}: {prometheus.query(METRIC)}\n"
                f"custom metrics API: {kube_cluster.kubectl('get', '--raw', custom_metrics_path, check=False)}\n"
                f"hpa status: {hpa_status()}\nadapter log:\n{adapter.logs()}")

    custom_metrics_path = f"/apis/custom.metrics.k8s.io/v1beta1/namespaces/{kube_namespace}/pods/*/{METRIC}"
    # The name the engine serves its target under (the image's path, as the pod's args give it).
    (pod,) = sdd.pods()
    model = httpx.get(f"http://{pod['status']['podIP']}:8000/v1/models", timeout=10).json()["data"][0]["id"]
    with PodTargets(kube_cluster, kube_namespace, selector, prometheus):
        # The whole chain before any load: the pod scraped, the series in Prometheus with the
        # namespace and pod labels, the adapter serving it, the HPA reading it (ScalingActive).
        try:
            scraped = wait_for(lambda: prometheus.query(METRIC), timeout_s=60, what=f"{METRIC} in Prometheus")
            assert {r["metric"]["namespace"] for r in scraped} == {kube_namespace}
            wait_for(lambda: json.loads(kube_cluster.kubectl("get", "--raw", custom_metrics_path).stdout)["items"],
                     timeout_s=60, what=f"{METRIC} in the custom metrics API")
            wait_for(lambda: saturation(hpa_status()) is not None, timeout_s=60, what="the HPA reading the metric")
        except TimeoutError as err:
            raise AssertionError(f"{err}\n{diagnostics()}") from None
        assert hpa_status()["currentReplicas"] == 1

        with Load(kube_cluster, kube_namespace, selector, model, clients=1) as steady:
            wait_for(lambda: len(steady.results) >= 3, timeout_s=60, what="the steady client's first requests")
            t0 = time.monotonic()
            with Load(kube_cluster, kube_namespace, selector, model, clients=3) as burst:
                try:
                    wait_for(lambda: sdd.get()["spec"]["replicas"] == 2, timeout_s=90, interval_s=1,
                             what="the HPA scaling to 2")
                except TimeoutError as err:
                    raise AssertionError(f"{err}\n{diagnostics()}") from None
                up_s = time.monotonic() - t0
                # What the first replica reported while the HPA decided, as Prometheus scraped it.
                (peak,) = prometheus.query(f'max(max_over_time({METRIC}{{namespace="{kube_namespace}"}}'
                                           f'[{int(up_s) + 1}s]))')
                wait_for(lambda: sdd.status()["serving"].get("readyReplicas") == 2, timeout_s=180, what="2 replicas Ready")
                ready_s = time.monotonic() - t0 - up_s
                first = {r.name: r for r in local_kubelet.running(kube_namespace)}
                before_second = len(steady.results) + len(burst.results)
                wait_for(lambda: len({ip for ip, _ in steady.results + burst.results}) == 2, timeout_s=60,
                         what="both replicas serving")
            burst_requests, t1 = len(burst.results), time.monotonic()
            try:
                wait_for(lambda: sdd.get()["spec"]["replicas"] == 1, timeout_s=90, interval_s=1,
                         what="the HPA scaling back to 1")
            except TimeoutError as err:
                raise AssertionError(f"{err}\n{diagnostics()}") from None
            down_s = time.monotonic() - t1
            wait_for(lambda: len(local_kubelet.running(kube_namespace)) == 1, timeout_s=120, what="one engine left")
            after = len(steady.results)
            wait_for(lambda: len(steady.results) >= after + 3, timeout_s=60, what="requests after the scale-down")

    results = steady.results + burst.results
    failures = [r for r in results if r[1] != 200]
    with capsys.disabled():
        print(f"\nHPA on {METRIC} (target 0.3, 1..2 replicas): scaled 1 -> 2 {up_s:.1f}s after the burst began"
              f" (the replica's saturation up to {float(peak['value'][1]):.2f}), the second replica Ready {ready_s:.1f}s later; 2 -> 1 {down_s:.1f}s after"
              f" the burst ended; {len(results)} requests ({burst_requests} of the burst, {len(steady.results)} of the"
              f" steady client), {len(failures)} not answered; {len(results) - before_second} after the second"
              f" replica was Ready")
    assert not failures, f"{len(failures)} of {len(results)} requests not answered: {failures[:10]}"
    # The removed pod's engine drained: SIGTERM, its requests finished, exit 0.
    (kept,) = local_kubelet.running(kube_namespace)
    (removed,) = [r for name, r in first.items() if name != kept.name]
    removed.join(150)
    assert not removed.is_alive()
    (engine,) = removed.containers
    assert engine.proc is not None and engine.proc.returncode == 0, (removed.name, engine.proc and engine.proc.returncode)
    assert sdd.status()["phase"] == "Ready"

