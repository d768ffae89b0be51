"""The HPA loop for real: kube-controller-manager's HPA controller scales a resource through its
scale subresource on the engines' own saturation, read from a real metrics pipeline.

    engine pods (LocalKubelet: real processes)  --/metrics-->  Prometheus (Debian's, kubernetes_sd)
      --> prometheus-adapter (manifests/autoscaling/prometheus-adapter-rules.yaml), registered as
          the custom.metrics.k8s.io APIService  --> the HPA the operator renders  --> /scale

manifests/examples/tiny-cpu-demo.yaml (maxRunningRequests 4) with spec.autoscaling on Saturation,
target 0.5, 1..2 replicas, no scale-down window. Six clients keep a single replica at saturation
1.5: the HPA adds the second; when the load stops it goes back to one. Every request is answered.

Needs `prometheus` on PATH and prometheus-adapter in the tools cache (hack/build-tools.sh); the
test cluster's apiserver routes aggregated APIs to their endpoints (testcluster/cluster.py).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from demo_pair import IMAGE_DEMO_DIR, build_demo_pair
from load import Load
from testcluster import wait_for
from specdeploy.localcluster.kubelet import LocalKubelet
from specdeploy.localcluster.tools import read_versions, tools_dir

REPO = Path(__file__).resolve().parents[2]
TINY_CPU_DEMO = REPO / "manifests" / "examples" / "tiny-cpu-demo.yaml"
ADAPTER_RULES = REPO / "manifests" / "autoscaling" / "prometheus-adapter-rules.yaml"
ADAPTER = tools_dir() / f"prometheus-adapter-{read_versions()['PROMETHEUS_ADAPTER_VERSION']}" / "adapter"
APISERVICE = "v1beta1.custom.metrics.k8s.io"

pytestmark = pytest.mark.skipif(not shutil.which("prometheus") or not ADAPTER.is_file(),
                                reason="needs prometheus (apt-get install prometheus) and prometheus-adapter (hack/build-tools.sh)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def host_address() -> str:
    """This machine's address on its default route: an aggregated API's endpoint may not be loopback."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(("192.0.2.1", 9))  # no packet is sent
        return s.getsockname()[0]


class Process:
    def __init__(self, argv: list[str], log: Path):
        self.log_path = log
        self.log = log.open("wb")
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()

    def tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:]


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


@pytest.fixture
def metrics_pipeline(kube_cluster, kube_namespace, tmp_path):
    """Prometheus scraping the namespace's engine pods, prometheus-adapter serving the custom
    metrics API from it; -> the Prometheus URL."""
    prom_port, adapter_port, host = free_port(), free_port(), host_address()
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "scrape_configs": [{
            "job_name": "specdeploy-engines",
            "kubernetes_sd_configs": [{"role": "pod", "kubeconfig_file": str(kube_cluster.kubeconfig),
                                       "namespaces": {"names": [kube_namespace]}}],
            "relabel_configs": [
                {"source_labels": ["__meta_kubernetes_pod_label_app_kubernetes_io_name"], "regex": "specdeploy-engine",
                 "action": "keep"},
                {"source_labels": ["__meta_kubernetes_pod_ip"], "regex": "(.+)", "replacement": "${1}:8000",
                 "target_label": "__address__"},
                {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
                {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
            ],
        }],
    }
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    prometheus = Process(["prometheus", f"--config.file={tmp_path / 'prometheus.yml'}",
                          f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address=127.0.0.1:{prom_port}"],
                         tmp_path / "prometheus.log")
    ca = Path(yaml.safe_load(kube_cluster.kubeconfig.read_text())["clusters"][0]["cluster"]["certificate-authority"])
    kubeconfig = str(kube_cluster.kubeconfig)
    adapter = Process([str(ADAPTER), f"--secure-port={adapter_port}", f"--bind-address={host}",
                       f"--cert-dir={tmp_path / 'adapter-certs'}", f"--lister-kubeconfig={kubeconfig}",
                       f"--authentication-kubeconfig={kubeconfig}", f"--authorization-kubeconfig={kubeconfig}",
                       f"--client-ca-file={ca}", f"--prometheus-url=http://127.0.0.1:{prom_port}",
                       f"--config={ADAPTER_RULES}", "--metrics-relist-interval=2s"],
                      tmp_path / "adapter.log")
    # Registered as the cluster's custom metrics API, at this machine's address.
    kube_cluster.apply([
        {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "custom-metrics", "namespace": kube_namespace},
         "spec": {"ports": [{"name": "https", "port": 443, "targetPort": adapter_port}]}},
        {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
         "metadata": {"name": "custom-metrics", "namespace": kube_namespace,
                      "labels": {"kubernetes.io/service-name": "custom-metrics"}},
         "addressType": "IPv4", "ports": [{"name": "https", "port": adapter_port, "protocol": "TCP"}],
         "endpoints": [{"addresses": [host], "conditions": {"ready": True}}]},
        {"apiVersion": "apiregistration.k8s.io/v1", "kind": "APIService", "metadata": {"name": APISERVICE},
         "spec": {"group": "custom.metrics.k8s.io", "version": "v1beta1", "insecureSkipTLSVerify": True,
                  "groupPriorityMinimum": 100, "versionPriority": 100,
                  "service": {"namespace": kube_namespace, "name": "custom-metrics", "port": 443}}},
    ])
    try:
        wait_for(lambda: kube_cluster.kubectl("get", "--raw", "/apis/custom.metrics.k8s.io/v1beta1", check=False).returncode == 0,
                 timeout_s=90, what=f"the custom metrics API\n{adapter.tail()}")
        yield f"http://127.0.0.1:{prom_port}"
    finally:
        kube_cluster.kubectl("delete", "apiservice", APISERVICE, "--ignore-not-found", check=False)
        adapter.stop()
        prometheus.stop()


def test_the_hpa_scales_on_saturation_up_and_back_down(kube_cluster, kube_namespace, local_kubelet, metrics_pipeline,
                                                       operator_process, sdd_of, demo_pair, capsys):
    operator_process(metrics_interval_s=2)
    resource = yaml.safe_load(TINY_CPU_DEMO.read_text())
    resource["spec"]["autoscaling"] = {"metric": "Saturation", "targetValue": "0.5", "minReplicas": 1, "maxReplicas": 2,
                                       "scaleDownStabilizationSeconds": 0}
    kube_cluster.apply(resource, namespace=kube_namespace)
    sdd = sdd_of("tiny-cpu-demo")
    sdd.wait_ready(timeout_s=240)

    def replicas() -> tuple[int, int]:
        serving = sdd.status().get("serving") or {}
        return sdd.get()["spec"]["replicas"], serving.get("readyReplicas", 0)

    (service,) = sdd.owned("services")
    t0 = time.monotonic()
    with Load(kube_cluster, kube_namespace, service["spec"]["selector"], str(demo_pair / "target"), clients=6) as load:
        wait_for(lambda: replicas() == (2, 2), timeout_s=240, interval_s=1, what="the HPA scaling up to 2 ready replicas")
        up_s = time.monotonic() - t0
        wait_for(lambda: len({ip for ip, _ in load.results}) == 2, timeout_s=120, what="both replicas serving")
    t1 = time.monotonic()
    wait_for(lambda: replicas() == (1, 1) and len(local_kubelet.running(kube_namespace)) == 1,
             timeout_s=240, interval_s=1, what="the HPA scaling back down to 1")
    down_s = time.monotonic() - t1
    failures = [r for r in load.results if r[1] != 200]
    hpa = kube_cluster.kubectl_json("get", "hpa", "tiny-cpu-demo", "-n", kube_namespace)
    with capsys.disabled():
        print(f"\nHPA on Saturation 0.5: 1 -> 2 replicas {up_s:.0f} s after the load began, 2 -> 1 {down_s:.0f} s"
              f" after it ended; {len(load.results)} requests, {len(failures)} not answered")
    assert not failures, failures[:10]
    assert sdd.condition("Autoscaling")["status"] == "True"
    assert {c["type"]: c["status"] for c in hpa["status"]["conditions"]}["ScalingActive"] == "True"
