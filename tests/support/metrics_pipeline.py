"""A real metrics pipeline for the HorizontalPodAutoscaler on the test cluster: Prometheus scraping
the engine pods' /metrics, and prometheus-adapter serving what it scrapes as custom.metrics.k8s.io
through the apiserver's aggregation layer.

- Prometheus: Debian's package (`prometheus` on PATH). Its 2.42 is built without Kubernetes
  discovery, so the targets come from a file (file_sd) that `PodTargets` keeps to the selector's
  running pods, each with the `namespace` and `pod` labels Kubernetes discovery would give them
  (what manifests/autoscaling/prometheus-adapter-rules.yaml asks for).
- prometheus-adapter: built by hack/build-prometheus-adapter.sh, with those rules, its lister and
  delegated authentication/authorization on the cluster's admin kubeconfig, and a serving
  certificate from the cluster CA. It listens at an address of this machine that the apiserver
  reaches and an EndpointSlice may hold (the host side of the pod network: loopback addresses are
  refused there); a selector-less Service, that EndpointSlice and the APIServices
  v1beta1/v1beta2.custom.metrics.k8s.io register it (the apiserver routes to the endpoint itself:
  `--enable-aggregator-routing`). `stop()` deletes the APIServices again, so the rest of a session
  sees a cluster without a custom metrics API.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

REPO = Path(__file__).resolve().parents[2]
ADAPTER_RULES = REPO / "manifests" / "autoscaling" / "prometheus-adapter-rules.yaml"
CUSTOM_METRICS_GROUP = "custom.metrics.k8s.io"
CUSTOM_METRICS_VERSIONS = ("v1beta1", "v1beta2")
ADAPTER_SERVICE = "custom-metrics-adapter"
ENGINE_PORT = 8000


def prometheus_binary() -> Path | None:
    found = shutil.which("prometheus")
    return Path(found) if found else None


def adapter_binary() -> Path:
    """Where hack/build-prometheus-adapter.sh puts the adapter (it may not be built)."""
    return Path(subprocess.run([str(REPO / "hack" / "build-prometheus-adapter.sh"), "--print-path"],
                               capture_output=True, text=True, check=True).stdout.strip())


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def _stop(proc: subprocess.Popen | None, grace_s: float = 10) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


class Prometheus:
    """Prometheus on 127.0.0.1, scraping the targets of one file every `scrape_interval_s`."""

    def __init__(self, binary: Path, workdir: Path, scrape_interval_s: int = 1):
        self.binary, self.workdir, self.interval = binary, workdir, scrape_interval_s
        self.targets_file = workdir / "engine-targets.json"
        self.log_path = workdir / "prometheus.log"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def config(self) -> dict[str, Any]:
        every = f"{self.interval}s"
        return {
            "global": {"scrape_interval": every, "scrape_timeout": every, "evaluation_interval": every},
            "scrape_configs": [{
                "job_name": "specdeploy-engines",
                "metrics_path": "/metrics",
                "file_sd_configs": [{"files": [str(self.targets_file)], "refresh_interval": every}],
            }],
        }

    def set_targets(self, targets: list[dict[str, Any]]) -> None:
        """file_sd's format: [{"targets": ["ip:port"], "labels": {...}}]; replaced atomically."""
        tmp = self.targets_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(targets))
        os.replace(tmp, self.targets_file)

    def start(self, timeout_s: float = 60) -> Prometheus:
        self.workdir.mkdir(parents=True, exist_ok=True)
        config = self.workdir / "prometheus.yml"
        config.write_text(yaml.safe_dump(self.config(), sort_keys=False))
        self.set_targets([])
        self.log = self.log_path.open("ab")
        self.proc = subprocess.Popen(
            [str(self.binary), f"--config.file={config}", f"--storage.tsdb.path={self.workdir / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--storage.tsdb.retention.time=1h"],
            stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=self.workdir)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited {self.proc.returncode}:\n{_tail(self.log_path)}")
            try:
                if httpx.get(f"{self.url}/-/ready", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise TimeoutError(f"prometheus not ready after {timeout_s:.0f}s:\n{_tail(self.log_path)}")

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query's result vector."""
        body = httpx.get(f"{self.url}/api/v1/query", params={"query": expr}, timeout=10).json()
        assert body["status"] == "success", body
        return body["data"]["result"]

    def active_targets(self) -> list[dict[str, Any]]:
        return httpx.get(f"{self.url}/api/v1/targets", timeout=10).json()["data"]["activeTargets"]

    def stop(self) -> None:
        _stop(self.proc)
        if self.proc is not None:
            self.log.close()


class PodTargets:
    """Keeps Prometheus' target file to the running pods of a label selector (their IP, port
    8000), labelled `namespace` and `pod`, re-reading the pods every `interval_s`."""

    def __init__(self, cluster, namespace: str, selector: dict[str, str], prometheus: Prometheus,
                 interval_s: float = 0.5):
        self.cluster, self.namespace, self.prometheus, self.interval = cluster, namespace, prometheus, interval_s
        self.selector = ",".join(f"{k}={v}" for k, v in selector.items())
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, name="prometheus-targets", daemon=True)
        self.written: list[dict[str, Any]] | None = None

    def targets(self) -> list[dict[str, Any]]:
        pods = self.cluster.kubectl_json("get", "pods", "-n", self.namespace, "-l", self.selector)["items"]
        return [{"targets": [f"{p['status']['podIP']}:{ENGINE_PORT}"],
                 "labels": {"namespace": self.namespace, "pod": p["metadata"]["name"]}}
                for p in sorted(pods, key=lambda p: p["metadata"]["name"])
                if p["status"].get("phase") == "Running" and p["status"].get("podIP")
                and not p["metadata"].get("deletionTimestamp")]

    def _run(self) -> None:
        while not self.done.is_set():
            try:
                targets = self.targets()
                if targets != self.written:
                    self.prometheus.set_targets(targets)
                    self.written = targets
            except Exception:  # noqa: BLE001 - the next read
                pass
            self.done.wait(self.interval)

    def __enter__(self) -> PodTargets:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.done.set()
        self.thread.join(10)


class MetricsAdapter:
    """prometheus-adapter serving `rules` from `prometheus_url`, registered as the cluster's
    custom metrics API; it listens on `address`:PORT, which must not be a loopback address."""

    def __init__(self, binary: Path, cluster, workdir: Path, address: str, namespace: str, prometheus_url: str,
                 rules: Path = ADAPTER_RULES, relist_interval_s: int = 2):
        self.binary, self.cluster, self.workdir, self.address = binary, cluster, workdir, address
        self.namespace, self.prometheus_url, self.rules, self.relist = namespace, prometheus_url, rules, relist_interval_s
        self.port = free_port(address)
        self.log_path = workdir / "adapter.log"
        self.proc: subprocess.Popen | None = None
        self.registered: list[str] = []

    def _serving_cert(self) -> tuple[Path, Path]:
        from specdeploy.localcluster.pki import issue_serving_cert

        pki = self.cluster.pki_dir
        # The aggregator dials the endpoint's IP and checks the certificate for the Service's name.
        cert, key = issue_serving_cert((pki / "ca.crt").read_bytes(), (pki / "ca.key").read_bytes(), ADAPTER_SERVICE,
                                       [self.address], [f"{ADAPTER_SERVICE}.{self.namespace}.svc"])
        cert_path, key_path = self.workdir / "adapter.crt", self.workdir / "adapter.key"
        key_path.touch(mode=0o600)
        key_path.write_bytes(key)
        cert_path.write_bytes(cert)
        return cert_path, key_path

    def command(self, cert: Path, key: Path) -> list[str]:
        kubeconfig = str(self.cluster.kubeconfig)
        return [
            str(self.binary), f"--config={self.rules}", f"--prometheus-url={self.prometheus_url}/",
            f"--metrics-relist-interval={self.relist}s",
            f"--bind-address={self.address}", f"--secure-port={self.port}",
            f"--tls-cert-file={cert}", f"--tls-private-key-file={key}",
            f"--lister-kubeconfig={kubeconfig}", f"--authentication-kubeconfig={kubeconfig}",
            f"--authorization-kubeconfig={kubeconfig}", "--v=2",
        ]

    def registration(self) -> list[dict[str, Any]]:
        """The selector-less Service, its EndpointSlice (this process's address) and the APIServices."""
        ca_bundle = base64.b64encode((self.cluster.pki_dir / "ca.crt").read_bytes()).decode()
        service = {
            "apiVersion": "v1", "kind": "Service",
            "metadata": {"name": ADAPTER_SERVICE, "namespace": self.namespace},
            "spec": {"ports": [{"name": "https", "port": 443, "targetPort": self.port, "protocol": "TCP"}]},
        }
        endpoints = {
            "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"name": ADAPTER_SERVICE, "namespace": self.namespace,
                         "labels": {"kubernetes.io/service-name": ADAPTER_SERVICE,
                                    "endpointslice.kubernetes.io/managed-by": "tests.specdeploy.dev"}},
            "addressType": "IPv4",
            "endpoints": [{"addresses": [self.address], "conditions": {"ready": True}}],
            "ports": [{"name": "https", "port": self.port, "protocol": "TCP"}],
        }
        services = [{
            "apiVersion": "apiregistration.k8s.io/v1", "kind": "APIService",
            "metadata": {"name": f"{version}.{CUSTOM_METRICS_GROUP}"},
            "spec": {"group": CUSTOM_METRICS_GROUP, "version": version, "caBundle": ca_bundle,
                     "service": {"name": ADAPTER_SERVICE, "namespace": self.namespace, "port": 443},
                     "groupPriorityMinimum": 100, "versionPriority": 200 if version == "v1beta2" else 100},
        } for version in CUSTOM_METRICS_VERSIONS]
        return [service, endpoints, *services]

    def available(self) -> bool:
        for name in self.registered:
            got = self.cluster.kubectl_json("get", "apiservice", name)
            if not any(c["type"] == "Available" and c["status"] == "True" for c in got["status"].get("conditions") or []):
                return False
        return bool(self.registered)

    def start(self, timeout_s: float = 90) -> MetricsAdapter:
        self.workdir.mkdir(parents=True, exist_ok=True)
        cert, key = self._serving_cert()
        self.log = self.log_path.open("ab")
        self.proc = subprocess.Popen(self.command(cert, key), stdout=self.log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, cwd=self.workdir)
        objs = self.registration()
        self.cluster.apply(objs)
        self.registered = [o["metadata"]["name"] for o in objs if o["kind"] == "APIService"]
        deadline = time.monotonic() + timeout_s
        last = ""
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus-adapter exited {self.proc.returncode}:\n{_tail(self.log_path)}")
            try:
                if self.available():
                    return self
            except Exception as err:  # noqa: BLE001 - reported on timeout
                last = repr(err)
            time.sleep(0.5)
        conditions = [self.cluster.kubectl("get", "apiservice", n, "-o", "jsonpath={.status.conditions}",
                                           check=False).stdout for n in self.registered]
        raise TimeoutError(f"custom metrics APIServices not Available after {timeout_s:.0f}s: {conditions} {last}\n"
                           f"{_tail(self.log_path)}")

    def stop(self) -> None:
        if self.registered:
            self.cluster.kubectl("delete", "apiservice", *self.registered, "--ignore-not-found", check=False)
        _stop(self.proc)
        if self.proc is not None:
            self.log.close()

    def logs(self) -> str:
        return _tail(self.log_path, 40)
