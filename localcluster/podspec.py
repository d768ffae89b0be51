"""What a pod spec means on a local node, without running anything: variable expansion, where a
container path lives on this machine, the command of an image that names none, probe settings,
the crash-loop back-off, and the Node object's status.

The process side (starting, probing, stopping) is `kubelet.py`; this module is pure.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

LOCAL_NODE_LABEL = "specdeploy.dev/local-kubelet"
# The kubelet's crash-loop back-off: 10 s, doubling, at most 5 minutes.
BACKOFF_INITIAL_S = 10.0
BACKOFF_MAX_S = 300.0
# All a container sees of the node's environment (besides its own env and the Service variables).
# PYTHONPATH: a container's `specdeploy` is the code under test, also where that is importable only
# through PYTHONPATH (a checkout beside another one's editable install).
PASSED_ENV = ("PATH", "HOME", "LANG", "LC_ALL", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "TMPDIR", "PYTHONPATH")
# Where a container finds its ServiceAccount's token, CA and namespace (client libraries read
# this path literally, so it is really mounted there: `sandbox.py`).
SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
# The project's images run `specdeploy` (Dockerfile.operator, Dockerfile.engine ENTRYPOINT): on a
# local node that is the `specdeploy` of the node's own Python environment.
DEFAULT_ENTRYPOINTS = {"ghcr.io/specdeploy/": ["specdeploy"]}
# The `kubernetes` Service's port: in-cluster clients (kopf among them) dial kubernetes.default.svc:443.
APISERVER_SERVICE_PORT = 443
APISERVER_SERVICE_NAMES = ("kubernetes", "kubernetes.default", "kubernetes.default.svc", "kubernetes.default.svc.cluster.local")
_VAR_REF = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)|\$\$")


def expand_vars(value: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion: defined names are replaced, undefined ones kept, $$ is $."""
    def sub(match: re.Match) -> str:
        if match.group(0) == "$$":
            return "$"
        return env.get(match.group(1), match.group(0))

    return _VAR_REF.sub(sub, value)


def map_path(value: str, mounts: list[tuple[str, Path]]) -> str:
    """`value` with a leading container path (or the value of a `--flag=PATH`) moved onto the host
    directory it is mounted from; `mounts` longest path first."""
    if "=" in value and value.startswith("-"):
        flag, _, rest = value.partition("=")
        return f"{flag}={map_path(rest, mounts)}"
    for container_path, host_dir in mounts:
        if value == container_path or value.startswith(container_path.rstrip("/") + "/"):
            return str(host_dir) + value[len(container_path.rstrip("/")):]
    return value


def under_run(path: str) -> str | None:
    """The part below /run of a container path under /run or /var/run (mounted for real), else None."""
    for root in ("/var/run/", "/run/"):
        if path.startswith(root):
            return path[len(root):].strip("/")
    return None


def command_of(container: dict[str, Any], entrypoints: dict[str, list[str]]) -> list[str]:
    """command + args; an image's own ENTRYPOINT where the container names no command (known only
    for images in `entrypoints`, by prefix). ValueError when neither says what to run."""
    command = list(container.get("command") or [])
    if not command:
        image = container.get("image", "")
        command = next((list(cmd) for prefix, cmd in entrypoints.items() if image.startswith(prefix)), [])
        if not command:
            raise ValueError(f"container {container['name']}: no command, and the entrypoint of image "
                             f"{image!r} is not known on this node (--entrypoint IMAGE_PREFIX=COMMAND)")
    return command + list(container.get("args") or [])


def pod_hosts_file(pod_ip: str, pod_name: str, apiserver_ip: str) -> str:
    """The pod's /etc/hosts, as a kubelet writes it, plus the apiserver's Service names (there is
    no cluster DNS here)."""
    return (f"# Kubernetes-managed hosts file (local node).\n127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n"
            f"{pod_ip}\t{pod_name}\n{apiserver_ip}\t{' '.join(APISERVER_SERVICE_NAMES)}\n")


def next_backoff(current_s: float) -> float:
    return min(current_s * 2, BACKOFF_MAX_S)


@dataclass
class Probe:
    spec: dict[str, Any]
    failures: int = 0
    successes: int = 0
    next_at: float = 0.0

    @property
    def period_s(self) -> float:
        return float(self.spec.get("periodSeconds", 10))

    @property
    def timeout_s(self) -> float:
        return float(self.spec.get("timeoutSeconds", 1))

    @property
    def failure_threshold(self) -> int:
        return int(self.spec.get("failureThreshold", 3))

    @property
    def success_threshold(self) -> int:
        return int(self.spec.get("successThreshold", 1))

    def arm(self, now: float) -> None:
        self.failures = self.successes = 0
        self.next_at = now + float(self.spec.get("initialDelaySeconds", 0))


def node_status(*, now: str, since: str, node_ip: str, hostname: str, kubelet_port: int, cpu: str, memory: str,
                kernel: str) -> dict[str, Any]:
    """A Ready node's status. Only the InternalIP is an address the apiserver can dial (it is told
    --kubelet-preferred-address-types=InternalIP); the kubelet API listens at kubelet_port there."""
    capacity = {"cpu": cpu, "memory": memory, "pods": "20", "ephemeral-storage": "100Gi"}
    ok = [("Ready", "True", "KubeletReady", "local kubelet is posting ready status"),
          ("MemoryPressure", "False", "KubeletHasSufficientMemory", ""),
          ("DiskPressure", "False", "KubeletHasNoDiskPressure", ""),
          ("PIDPressure", "False", "KubeletHasSufficientPID", "")]
    return {
        "capacity": capacity, "allocatable": capacity,
        "conditions": [{"type": t, "status": s, "reason": r, "message": m, "lastHeartbeatTime": now,
                        "lastTransitionTime": since} for t, s, r, m in ok],
        "addresses": [{"type": "InternalIP", "address": node_ip}, {"type": "Hostname", "address": hostname}],
        "daemonEndpoints": {"kubeletEndpoint": {"Port": kubelet_port}},
        "nodeInfo": {"architecture": "amd64", "operatingSystem": "linux", "kubeletVersion": "local",
                     "kubeProxyVersion": "local", "containerRuntimeVersion": "local://processes",
                     "osImage": "", "kernelVersion": kernel, "machineID": "", "systemUUID": "", "bootID": ""},
    }
