"""The control plane: a Kubernetes cluster on this machine's loopback, from the cached binaries.

kwokctl's binary runtime starts real etcd, kube-apiserver, kube-controller-manager and
kube-scheduler processes, plus kwok's controller, which plays the kubelet for fake nodes (GPU
nodes that exist only in the API: it marks them Ready, moves pods bound to them to Running/Ready
and serves `kubectl logs` from files). Nodes that really run pods are `kubelet.LocalKubelet`'s.
Everything lives under one directory (a temporary one for tests, the state directory for
`specdeploy cluster up`) and is removed, with every process started for it, by `KubeCluster.stop()`.

The apiserver reaches kubelets as a real one does: at the node's InternalIP and its
daemonEndpoints port, over TLS, verifying the kubelet's serving certificate against the cluster CA
(`--kubelet-certificate-authority`) and presenting its kubelet client certificate
(`--kubelet-client-certificate`), which the local kubelet checks.

The aggregation layer is on: the apiserver proxies an APIService's requests (prometheus-adapter's
custom.metrics.k8s.io) with a front-proxy client certificate of its own CA (`pki.write_front_proxy`)
straight to the Service's endpoint (`--enable-aggregator-routing`: there is no kube-proxy).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Iterable, TypeVar

import yaml

from .pki import FRONT_PROXY_CLIENT, front_proxy_paths, write_front_proxy
from .tools import Tools

log = logging.getLogger("specdeploy.localcluster")

T = TypeVar("T")

LOOPBACK = "127.0.0.1"
# kwok's CRDs that tests may create at run time (per-pod `Logs` wins over the cluster-wide default).
KWOK_CRDS = ("Logs", "ClusterLogs")
DEFAULT_LOG_LINE = "fake container started by the kwok test cluster"
# kwok's controller manages only nodes carrying this annotation (see _config).
FAKE_NODE_ANNOTATION = "kwok.x-k8s.io/node"


@dataclass(frozen=True)
class FakeNode:
    """A node that exists only in the API; kwok keeps it Ready and runs its pods on paper."""

    name: str
    gpu_product: str
    gpu_memory_mib: int
    gpu_count: int = 8
    cpu: str = "192"
    memory: str = "2048Gi"
    pods: str = "110"
    extra_labels: tuple[tuple[str, str], ...] = ()
    taints: tuple[tuple[str, str, str], ...] = ()  # (key, value, effect)

    @property
    def labels(self) -> dict[str, str]:
        return {
            **dict(self.extra_labels),
            "kubernetes.io/hostname": self.name,
            "kubernetes.io/os": "linux",
            "kubernetes.io/arch": "amd64",
            "type": "kwok",
            "nvidia.com/gpu.present": "true",
            "nvidia.com/gpu.product": self.gpu_product,
            "nvidia.com/gpu.memory": str(self.gpu_memory_mib),
            "nvidia.com/gpu.count": str(self.gpu_count),
        }

    @property
    def capacity(self) -> dict[str, str]:
        return {
            "cpu": self.cpu,
            "memory": self.memory,
            "pods": self.pods,
            "ephemeral-storage": "1Ti",
            "nvidia.com/gpu": str(self.gpu_count),
        }

    def manifest(self) -> dict[str, Any]:
        return {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": self.name,
                "labels": self.labels,
                # kwok's controller manages only nodes carrying this annotation.
                "annotations": {FAKE_NODE_ANNOTATION: "fake", "node.alpha.kubernetes.io/ttl": "0"},
            },
            "spec": {"taints": [{"key": k, "value": v, "effect": e} for k, v, e in self.taints]} if self.taints else {},
            "status": {
                "capacity": self.capacity,
                "allocatable": self.capacity,
                "nodeInfo": {
                    "architecture": "amd64",
                    "operatingSystem": "linux",
                    "kubeletVersion": "fake",
                    "kubeProxyVersion": "fake",
                },
            },
        }


# Two 8 x H200 nodes, and one 8 x H100 node so that node affinity on the GPU product can be tested.
DEFAULT_NODES: tuple[FakeNode, ...] = (
    FakeNode("gpu-h200-0", "NVIDIA-H200", 143771),
    FakeNode("gpu-h200-1", "NVIDIA-H200", 143771),
    FakeNode("gpu-h100-0", "NVIDIA-H100-80GB-HBM3", 81559),
)


WORKDIR_PREFIX = "specdeploy-kube-"
OWNER_FILE = "owner.pid"


def _pids_mentioning(path: Path) -> list[int]:
    """PIDs of live (non-zombie) processes whose command line contains `path`, or whose working
    directory is under it (a local node's containers run in their pod's directory)."""
    marker = str(path).encode()
    prefix = str(path).rstrip("/") + "/"
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        try:
            cwd = os.readlink(entry / "cwd") + "/"
        except OSError:
            cwd = ""
        # Zombies (state Z) have already exited; they hold no port.
        if (marker in cmdline or cwd.startswith(prefix)) and stat.rsplit(")", 1)[-1].split()[0] != "Z":
            pids.append(int(entry.name))
    return pids


def _alive(pid: int) -> bool:
    """True while any thread of process `pid` has not exited.

    The thread-group leader turns zombie as soon as it exits, while the process's other threads
    (a Go binary has many) may still be tearing down and holding its sockets, so look at each."""
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return False
    for task in tasks:
        try:
            if (task / "stat").read_text().rsplit(")", 1)[-1].split()[0] not in ("Z", "X"):
                return True
        except OSError:
            continue
    return False


def _terminate(pids_of: Callable[[], list[int]], grace_s: float = 5.0) -> list[int]:
    """SIGTERM, then SIGKILL, the processes `pids_of()` names until none is left; returns those signalled."""
    signalled: list[int] = []
    seen = set(pids_of())
    for sig in (signal.SIGTERM, signal.SIGKILL):
        pids = pids_of()
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, sig)
                signalled.append(pid)
            except ProcessLookupError:
                pass
        seen.update(pids)
        deadline = time.monotonic() + grace_s
        while pids_of() and time.monotonic() < deadline:
            time.sleep(0.1)
    # An exiting process may show an empty command line (so pids_of() no longer names it) while it
    # still holds its sockets: wait until every PID seen is really gone.
    deadline = time.monotonic() + grace_s
    while any(_alive(p) for p in seen) and time.monotonic() < deadline:
        time.sleep(0.05)
    return sorted(set(signalled))


def reap_orphans(base_dir: Path | None = None) -> None:
    """Stop clusters left behind by test sessions that were killed before their teardown ran."""
    base = Path(base_dir or tempfile.gettempdir())
    for workdir in base.glob(WORKDIR_PREFIX + "*"):
        try:
            owner = int((workdir / OWNER_FILE).read_text())
        except (OSError, ValueError):
            continue
        if Path(f"/proc/{owner}").exists():
            continue  # its session is still running
        killed = _terminate(lambda: _pids_mentioning(workdir))
        log.warning("removed orphaned test cluster %s (owner pid %d gone; stopped %s)", workdir, owner, killed)
        shutil.rmtree(workdir, ignore_errors=True)


class KubectlError(RuntimeError):
    """kubectl (or helm) exited non-zero; the message carries its command line and stderr."""

    def __init__(self, cmd: list[str], result: subprocess.CompletedProcess[str]):
        self.cmd = cmd
        self.returncode = result.returncode
        self.stdout = result.stdout
        self.stderr = result.stderr
        super().__init__(
            f"{' '.join(cmd)} exited {result.returncode}:\n{(result.stderr or result.stdout).strip()}"
        )


def wait_for(
    predicate: Callable[[], T],
    timeout_s: float = 30.0,
    interval_s: float = 0.25,
    what: str = "condition",
) -> T:
    """Call `predicate` until it returns something truthy and return that value.

    Exceptions raised by the predicate count as "not yet"; if the deadline passes, TimeoutError
    names `what` and the last value or exception seen, so a failing test says what it waited for.
    """
    deadline = time.monotonic() + timeout_s
    last: object = None
    while True:
        try:
            value = predicate()
            if value:
                return value
            last = value
        except Exception as exc:  # noqa: BLE001 - reported below if the wait times out
            last = exc
        if time.monotonic() >= deadline:
            raise TimeoutError(f"timed out after {timeout_s:.0f}s waiting for {what}; last result: {last!r}")
        time.sleep(interval_s)


def _free_ports(n: int) -> list[int]:
    """`n` distinct loopback ports that are free right now (the kernel picks them)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((LOOPBACK, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def listening_ports() -> dict[int, str]:
    """TCP ports in LISTEN state on this host (IPv4 and IPv6), mapped to their local address in hex."""
    ports: dict[int, str] = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == "0A":  # TCP_LISTEN
                addr, port = fields[1].rsplit(":", 1)
                ports[int(port, 16)] = addr
    return ports


def _cri_log(lines: Iterable[str]) -> str:
    """Lines in the CRI container-log format that kwok's log server parses."""
    now = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    return "".join(f"{now} stdout F {line}\n" for line in lines)


@dataclass
class KubeCluster:
    """A running test cluster. Create with `KubeCluster.start(tools)`; always `stop()` it."""

    name: str
    tools: Tools
    workdir: Path
    nodes: tuple[FakeNode, ...]
    # A fixed kube-apiserver port (`cluster up`'s --port); None: one picked free at start.
    apiserver_port: int | None = None
    # Seconds without a heartbeat before the node lifecycle controller marks a node NotReady
    # (kube-controller-manager's --node-monitor-grace-period); None: its default (50 s).
    node_grace_s: int | None = None
    # Extra names in the apiserver's certificate (the local node's address, which pods dial).
    apiserver_sans: tuple[str, ...] = ()
    # Seconds between the HPA controller's passes (kube-controller-manager's
    # --horizontal-pod-autoscaler-sync-period); None: its default (15 s).
    hpa_sync_period_s: int | None = None
    kubeconfig: Path = field(init=False)
    server: str = field(init=False, default="")
    ports: list[int] = field(init=False, default_factory=list)
    _stopped: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        self.kubeconfig = self.cluster_dir / "kubeconfig.yaml"

    # ---- lifecycle -------------------------------------------------------------------------

    @classmethod
    def start(
        cls,
        tools: Tools,
        nodes: Iterable[FakeNode] = DEFAULT_NODES,
        base_dir: Path | None = None,
        timeout_s: float = 120.0,
        *,
        workdir: Path | None = None,
        name: str | None = None,
        apiserver_port: int | None = None,
        node_grace_s: int | None = None,
        apiserver_sans: tuple[str, ...] = (),
        hpa_sync_period_s: int | None = None,
    ) -> "KubeCluster":
        """Start a cluster. Tests: a fresh temporary directory owned by this process (reaped when
        the process is gone). `cluster up`: `workdir` and `name` given, owned by the caller."""
        t0 = time.monotonic()
        if workdir is None:
            reap_orphans(base_dir)
            workdir = Path(tempfile.mkdtemp(prefix=WORKDIR_PREFIX, dir=base_dir))
            (workdir / OWNER_FILE).write_text(str(os.getpid()))
        else:
            workdir.mkdir(parents=True, exist_ok=True)
        name = name or f"sd-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        cluster = cls(name=name, tools=tools, workdir=workdir, nodes=tuple(nodes),
                      apiserver_port=apiserver_port, node_grace_s=node_grace_s,
                      apiserver_sans=tuple(apiserver_sans), hpa_sync_period_s=hpa_sync_period_s)
        try:
            cluster._create(timeout_s)
            log.info("cluster %s: control plane up after %.1fs", name, time.monotonic() - t0)
            cluster._add_nodes()
            cluster._install_default_logs()
            cluster.wait_for_default_service_account("default", timeout_s=60)
        except BaseException:
            diagnostics = cluster.component_logs_tail()
            cluster.stop()
            if diagnostics:
                log.error("cluster %s failed to start; component logs:\n%s", name, diagnostics)
            raise
        log.info("cluster %s ready in %.1fs (kubeconfig %s)", name, time.monotonic() - t0, cluster.kubeconfig)
        return cluster

    @property
    def cluster_dir(self) -> Path:
        return self.workdir / "clusters" / self.name

    @property
    def pki_dir(self) -> Path:
        """kwokctl's PKI: ca.crt/ca.key (the cluster CA) and admin.crt/admin.key, the one
        certificate kwokctl gives every component, which the apiserver also presents to kubelets."""
        return self.cluster_dir / "pki"

    @property
    def front_proxy_dir(self) -> Path:
        """The aggregation layer's front-proxy CA and the apiserver's client certificate from it."""
        return self.workdir / "front-proxy"

    def _kwokctl_env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            {
                "KWOK_WORKDIR": str(self.workdir),
                "KWOK_RUNTIME": "binary",
                "KWOK_KUBE_VERSION": self.tools.kube_version,
                "KWOK_KUBE_APISERVER_BINARY": str(self.tools.kube_apiserver),
                "KWOK_KUBE_CONTROLLER_MANAGER_BINARY": str(self.tools.kube_controller_manager),
                "KWOK_KUBE_SCHEDULER_BINARY": str(self.tools.kube_scheduler),
                "KWOK_KUBECTL_BINARY": str(self.tools.kubectl),
                "KWOK_CONTROLLER_BINARY": str(self.tools.kwok),
                "KWOK_ETCD_BINARY": str(self.tools.etcd),
            }
        )
        env.pop("KUBECONFIG", None)
        return env

    def _kwokctl(self, *args: str, timeout_s: float = 120.0) -> subprocess.CompletedProcess[str]:
        cmd = [str(self.tools.kwokctl), "--name", self.name, *args]
        log.debug("run %s", " ".join(cmd))
        return subprocess.run(
            cmd,
            env=self._kwokctl_env(),
            capture_output=True,
            text=True,
            timeout=timeout_s,
            stdin=subprocess.DEVNULL,
        )

    def _config(self) -> dict[str, Any]:
        """kwokctl configuration: ports picked here, and every listener bound to 127.0.0.1 only
        (kwokctl's binary runtime would otherwise listen on all interfaces)."""
        names = ["kube-apiserver", "etcd", "etcd-peer", "kube-controller-manager", "kube-scheduler", "kwok-controller"]
        port = dict(zip(names, _free_ports(len(names))))
        if self.apiserver_port:
            port["kube-apiserver"] = self.apiserver_port
        self.ports = sorted(port.values())
        front_proxy_ca, front_proxy_cert, front_proxy_key = front_proxy_paths(self.front_proxy_dir)
        etcd = f"http://{LOOPBACK}:{port['etcd']}"
        peer = f"http://{LOOPBACK}:{port['etcd-peer']}"

        def patch(component: str, **args: str) -> dict[str, Any]:
            return {"name": component, "extraArgs": [{"key": k.replace("_", "-"), "value": v} for k, v in args.items()]}

        return {
            "apiVersion": "config.kwok.x-k8s.io/v1alpha1",
            "kind": "KwokctlConfiguration",
            "options": {
                "kubeApiserverPort": port["kube-apiserver"],
                "etcdPort": port["etcd"],
                "etcdPeerPort": port["etcd-peer"],
                "kubeControllerManagerPort": port["kube-controller-manager"],
                "kubeSchedulerPort": port["kube-scheduler"],
                "kwokControllerPort": port["kwok-controller"],
                "enableCRDs": list(KWOK_CRDS),
                **({"kubeApiserverCertSANs": list(self.apiserver_sans)} if self.apiserver_sans else {}),
            },
            "componentsPatches": [
                patch(
                    "etcd",
                    listen_client_urls=etcd,
                    advertise_client_urls=etcd,
                    listen_peer_urls=peer,
                    initial_advertise_peer_urls=peer,
                    initial_cluster=f"node0={peer}",
                ),
                patch("kube-apiserver", bind_address=LOOPBACK,
                      # A local node's Hostname (local-0) resolves nowhere: its InternalIP first. kwok's
                      # fake nodes report only the Hostname `localhost`, where kwok serves their logs.
                      kubelet_preferred_address_types="InternalIP,Hostname",
                      kubelet_certificate_authority=str(self.pki_dir / "ca.crt"),
                      kubelet_client_certificate=str(self.pki_dir / "admin.crt"),
                      kubelet_client_key=str(self.pki_dir / "admin.key"),
                      # The aggregation layer (kwokctl passes admin.crt as the proxy's certificate
                      # and no request-header CA; the later flags win).
                      requestheader_client_ca_file=str(front_proxy_ca),
                      requestheader_allowed_names=FRONT_PROXY_CLIENT,
                      requestheader_username_headers="X-Remote-User",
                      requestheader_group_headers="X-Remote-Group",
                      requestheader_extra_headers_prefix="X-Remote-Extra-",
                      proxy_client_cert_file=str(front_proxy_cert),
                      proxy_client_key_file=str(front_proxy_key),
                      enable_aggregator_routing="true"),
                patch("kube-controller-manager", bind_address=LOOPBACK,
                      **({"node_monitor_grace_period": f"{self.node_grace_s}s", "node_monitor_period": "2s"}
                         if self.node_grace_s else {}),
                      **({"horizontal_pod_autoscaler_sync_period": f"{self.hpa_sync_period_s}s"}
                         if self.hpa_sync_period_s else {})),
                patch("kube-scheduler", bind_address=LOOPBACK),
                # kwokctl's binary runtime starts kwok with --manage-all-nodes=true (only its kind
                # runtime passes the annotation selector), so kwok would also take the local
                # kubelet's node whenever it grabbed that node's Lease first; the later flag wins.
                patch("kwok-controller", server_address=f"{LOOPBACK}:{port['kwok-controller']}",
                      manage_all_nodes="false", manage_nodes_with_annotation_selector=f"{FAKE_NODE_ANNOTATION}=fake"),
            ],
        }

    def _create(self, timeout_s: float, attempts: int = 3) -> None:
        config_file = self.workdir / "kwokctl-config.yaml"
        write_front_proxy(self.front_proxy_dir)
        for attempt in range(1, attempts + 1):
            config_file.write_text(yaml.safe_dump(self._config(), sort_keys=False))
            result = self._kwokctl(
                "--config", str(config_file),
                "create", "cluster",
                "--runtime", "binary",
                # kwokctl would otherwise also write the context into ~/.kube/config.
                "--kubeconfig", str(self.workdir / "merged-kubeconfig.yaml"),
                "--wait", f"{int(timeout_s)}s",
                "--timeout", f"{int(timeout_s)}s",
                timeout_s=timeout_s + 30,
            )
            if result.returncode == 0:
                break
            error = result.stderr.strip()[-4000:]
            # Another process may have taken one of the picked ports between picking and binding.
            retry = attempt < attempts and "address already in use" in (error + self.component_logs_tail())
            log.warning("kwokctl create cluster %s failed (attempt %d)%s", self.name, attempt, "; retrying" if retry else "")
            if not retry:
                raise RuntimeError(f"kwokctl create cluster {self.name} failed (exit {result.returncode}):\n{error}")
            self._kwokctl("delete", "cluster", "--kubeconfig", str(self.workdir / "merged-kubeconfig.yaml"), timeout_s=60)
            self._kill_leftovers()
        if not self.kubeconfig.exists():
            raise RuntimeError(f"kwokctl did not write {self.kubeconfig}")
        kubeconfig = yaml.safe_load(self.kubeconfig.read_text())
        self.server = kubeconfig["clusters"][0]["cluster"]["server"]
        wait_for(
            lambda: self.kubectl("get", "--raw", "/readyz", check=False).stdout.strip() == "ok",
            timeout_s=60,
            what=f"kube-apiserver {self.server}/readyz",
        )

    def _add_nodes(self) -> None:
        if not self.nodes:
            return
        self.apply([n.manifest() for n in self.nodes])

        def all_ready() -> bool:
            items = self.kubectl_json("get", "nodes")["items"]
            ready = {
                n["metadata"]["name"]
                for n in items
                if any(c["type"] == "Ready" and c["status"] == "True" for c in n.get("status", {}).get("conditions", []))
            }
            return {n.name for n in self.nodes} <= ready

        wait_for(all_ready, timeout_s=60, what="fake nodes to become Ready")

    def add_fake_nodes(self, nodes: Iterable[FakeNode], timeout_s: float = 60) -> list[FakeNode]:
        """More kwok nodes for one test (remove them with delete_nodes); returns them once Ready."""
        nodes = list(nodes)
        self.apply([n.manifest() for n in nodes])
        names = {n.name for n in nodes}

        def ready() -> bool:
            items = self.kubectl_json("get", "nodes")["items"]
            return names <= {n["metadata"]["name"] for n in items
                             if any(c["type"] == "Ready" and c["status"] == "True"
                                    for c in n.get("status", {}).get("conditions", []))}

        wait_for(ready, timeout_s=timeout_s, what=f"fake nodes {sorted(names)} Ready")
        return nodes

    def delete_nodes(self, names: Iterable[str]) -> None:
        names = list(names)
        if names:
            self.kubectl("delete", "node", *names, "--ignore-not-found", "--wait=false", check=False)

    def _install_default_logs(self) -> None:
        """Every pod's `kubectl logs` returns one line unless a test sets its own with set_pod_log."""
        default_log = self.workdir / "default-container.log"
        default_log.write_text(_cri_log([DEFAULT_LOG_LINE]))
        self.apply(
            {
                "apiVersion": "kwok.x-k8s.io/v1alpha1",
                "kind": "ClusterLogs",
                "metadata": {"name": "default"},
                "spec": {"logs": [{"logsFile": str(default_log)}]},
            }
        )

    def stop(self) -> None:
        """Delete the cluster: stop every process started for it, free its ports, remove its files."""
        if self._stopped:
            return
        self._stopped = True
        started = self.processes()
        try:
            result = self._kwokctl("delete", "cluster", "--kubeconfig", str(self.workdir / "merged-kubeconfig.yaml"), timeout_s=60)
            if result.returncode != 0:
                log.warning("kwokctl delete cluster %s exited %d: %s", self.name, result.returncode, result.stderr.strip())
        except subprocess.TimeoutExpired:
            log.warning("kwokctl delete cluster %s timed out; killing its processes", self.name)
        leftovers = self._kill_leftovers()
        if leftovers:
            log.warning("cluster %s: killed leftover processes %s", self.name, leftovers)
        # A process that is exiting may already show an empty command line while it still holds its
        # sockets: wait for the PIDs seen before the delete to be gone, then for the ports to close.
        try:
            wait_for(lambda: not [p for p in started if _alive(p)], timeout_s=10, interval_s=0.05, what="cluster processes to exit")
            wait_for(lambda: not self.bound_ports(), timeout_s=5, interval_s=0.05, what="cluster ports to close")
        except TimeoutError as exc:
            log.warning("cluster %s: %s", self.name, exc)
        if os.environ.get("SPECDEPLOY_KEEP_CLUSTER") == "1":
            log.warning("cluster %s: keeping %s (SPECDEPLOY_KEEP_CLUSTER=1)", self.name, self.workdir)
        else:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def processes(self) -> list[int]:
        """PIDs of live processes whose command line mentions this cluster's directory."""
        return _pids_mentioning(self.workdir)

    def _kill_leftovers(self) -> list[int]:
        return _terminate(self.processes)

    def bound_ports(self) -> list[int]:
        """Those of the cluster's ports on which some process still listens."""
        listening = listening_ports()
        return [p for p in self.ports if p in listening]

    def component_logs_tail(self, lines: int = 30) -> str:
        logs_dir = self.cluster_dir / "logs"
        if not logs_dir.is_dir():
            return ""
        out = []
        for f in sorted(logs_dir.glob("*.log")):
            tail = f.read_text(errors="replace").splitlines()[-lines:]
            out.append(f"--- {f.name}\n" + "\n".join(tail))
        return "\n".join(out)

    # ---- helpers for tests ----------------------------------------------------------------

    @property
    def kubectl_path(self) -> Path:
        return self.tools.kubectl

    @property
    def helm_path(self) -> Path:
        return self.tools.helm

    @property
    def gpu_nodes(self) -> list[FakeNode]:
        return [n for n in self.nodes if n.gpu_count > 0]

    @property
    def env(self) -> dict[str, str]:
        """Environment for a subprocess (kubectl, helm, an operator) that should talk to this cluster."""
        env = dict(os.environ)
        env["KUBECONFIG"] = str(self.kubeconfig)
        helm_home = self.workdir / "helm"
        env["HELM_CACHE_HOME"] = str(helm_home / "cache")
        env["HELM_CONFIG_HOME"] = str(helm_home / "config")
        env["HELM_DATA_HOME"] = str(helm_home / "data")
        return env

    def _run(self, cmd: list[str], input: str | None, check: bool, timeout_s: float) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(
            cmd,
            input=input,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            stdin=None if input is not None else subprocess.DEVNULL,
        )
        if check and result.returncode != 0:
            raise KubectlError(cmd, result)
        return result

    def kubectl(
        self, *args: str, input: str | None = None, check: bool = True, timeout_s: float = 60.0
    ) -> subprocess.CompletedProcess[str]:
        """Run kubectl against this cluster; raises KubectlError on failure when `check`."""
        return self._run([str(self.tools.kubectl), "--kubeconfig", str(self.kubeconfig), *args], input, check, timeout_s)

    def kubectl_json(self, *args: str, timeout_s: float = 60.0) -> Any:
        """`kubectl <args> -o json`, parsed."""
        return json.loads(self.kubectl(*args, "-o", "json", timeout_s=timeout_s).stdout)

    def helm(
        self, *args: str, input: str | None = None, check: bool = True, timeout_s: float = 300.0
    ) -> subprocess.CompletedProcess[str]:
        """Run helm against this cluster (its cache/config/data live in the cluster's temp dir)."""
        return self._run([str(self.tools.helm), "--kubeconfig", str(self.kubeconfig), *args], input, check, timeout_s)

    def apply(self, objs: dict[str, Any] | list[dict[str, Any]] | str, namespace: str | None = None) -> str:
        """`kubectl apply` a manifest: YAML text, one object, or a list of objects."""
        if isinstance(objs, str):
            text = objs
        else:
            docs = objs if isinstance(objs, list) else [objs]
            text = yaml.safe_dump_all(docs, sort_keys=False)
        args = ["apply", "-f", "-"]
        if namespace:
            args += ["-n", namespace]
        return self.kubectl(*args, input=text).stdout

    def api_client(self):  # -> kubernetes.client.ApiClient
        """A new kubernetes python ApiClient for this cluster (close it when done)."""
        from kubernetes import config

        return config.new_client_from_config(config_file=str(self.kubeconfig))

    def wait_for_default_service_account(self, namespace: str, timeout_s: float = 30.0) -> None:
        """Pods cannot be created in a namespace until kube-controller-manager has made its `default` ServiceAccount."""
        wait_for(
            lambda: self.kubectl("get", "serviceaccount", "default", "-n", namespace, check=False).returncode == 0,
            timeout_s=timeout_s,
            what=f"ServiceAccount default in namespace {namespace}",
        )

    def set_pod_log(self, namespace: str, pod: str, lines: Iterable[str] | str, container: str | None = None) -> Path:
        """Make `kubectl logs <pod>` (optionally for one container) return `lines`.

        Creates kwok's namespaced `Logs` object named after the pod, which takes precedence over the
        cluster-wide default. Returns the log file, which a test may append to (CRI log format).
        """
        if isinstance(lines, str):
            lines = lines.splitlines()
        log_dir = self.workdir / "pod-logs"
        log_dir.mkdir(exist_ok=True)
        path = log_dir / f"{namespace}_{pod}_{container or 'all'}.log"
        path.write_text(_cri_log(lines))
        entry: dict[str, Any] = {"logsFile": str(path)}
        if container:
            entry["containers"] = [container]
        self.apply(
            {
                "apiVersion": "kwok.x-k8s.io/v1alpha1",
                "kind": "Logs",
                "metadata": {"name": pod, "namespace": namespace},
                "spec": {"logs": [entry]},
            }
        )
        return path
