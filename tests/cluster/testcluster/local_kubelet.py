"""A kubelet for one node of the test cluster that really runs its pods' containers, as local
processes.

kwok plays the kubelet for the fake GPU nodes and runs nothing. `LocalKubelet` registers one more
node, which kwok does not manage (no `kwok.x-k8s.io/node` annotation), keeps it Ready (node status
and its Lease in kube-node-lease, as a kubelet does), and for every pod the scheduler binds to it:

- runs each container's `command` + `args` with `$(VAR)` expanded, its `env` (values, and
  `valueFrom` Secret/ConfigMap keys and pod fields) and nothing else of this process's environment
  but PATH, HOME, LANG and the thread-count variables;
- materialises its volumes: a ConfigMap's (or Secret's) data as files in a directory, an emptyDir
  as an empty one, a PersistentVolumeClaim as a directory per claim that outlives the pod (a new
  pod of the same claim sees the same files, as with a real volume);
- maps each volume's mountPath, and each path of `image_paths` (what the image would hold), onto
  those directories wherever a path appears in the command, the args or the env;
- gives the pod its own loopback address (127.x.y.z) as its pod IP: the container listens there
  where it asked for every interface (0.0.0.0), which is what its own network namespace would give;
- runs the startup, liveness and readiness probes (httpGet, tcpSocket, exec) with their own
  periods and thresholds against that address, restarts containers that exit or fail liveness
  (restartPolicy, with the kubelet's doubling back-off), and writes the pod's status: phase, podIP,
  conditions and containerStatuses;
- on deletion runs the preStop sleep, sends SIGTERM, waits out the grace period, kills, and removes
  the pod.

Images are not pulled: the container runs from this machine's filesystem and Python environment,
which is why `image_paths` says where the image's files live here.
"""

from __future__ import annotations

import copy
import logging
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import httpx

log = logging.getLogger("specdeploy.tests.local_kubelet")

LOCAL_NODE_LABEL = "specdeploy.dev/local-kubelet"
HEARTBEAT_S = 5.0
POLL_S = 0.25
# The kubelet's crash-loop back-off: 10 s, doubling, at most 5 minutes.
BACKOFF_INITIAL_S = 10.0
BACKOFF_MAX_S = 300.0
PASSED_ENV = ("PATH", "HOME", "LANG", "LC_ALL", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "TMPDIR")
_VAR_REF = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)|\$\$")


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _now_micro() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


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


@dataclass
class Container:
    spec: dict[str, Any]
    argv: list[str]
    env: dict[str, str]
    log_path: Path
    proc: subprocess.Popen | None = None
    started: bool = False
    ready: bool = False
    restart_count: int = 0
    started_at: str | None = None
    next_start: float = 0.0
    backoff_s: float = BACKOFF_INITIAL_S
    state: dict[str, Any] = field(default_factory=lambda: {"waiting": {"reason": "ContainerCreating"}})
    last_state: dict[str, Any] = field(default_factory=dict)
    probes: dict[str, Probe] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.spec["name"]


class PodRunner(threading.Thread):
    """One pod: its containers' processes, probes and status, until the pod is deleted."""

    def __init__(self, kubelet: LocalKubelet, pod: dict[str, Any], ip: str):
        meta = pod["metadata"]
        super().__init__(name=f"pod-{meta['namespace']}-{meta['name']}", daemon=True)
        self.kubelet = kubelet
        self.pod = pod
        self.namespace, self.name, self.uid = meta["namespace"], meta["name"], meta["uid"]
        self.ip = ip
        self.dir = kubelet.workdir / "pods" / f"{self.namespace}_{self.name}_{self.uid[:8]}"
        self.deleting = threading.Event()
        self.gone = threading.Event()  # the pod left the API: stop at once
        self.containers: list[Container] = []
        self.conditions: dict[str, tuple[str, str]] = {}  # type -> (status, lastTransitionTime)
        self.start_time = _now()
        self.lock = threading.Lock()

    # ---- set-up ------------------------------------------------------------------------------

    def _volume_dirs(self) -> dict[str, Path]:
        dirs: dict[str, Path] = {}
        core = self.kubelet.core
        for volume in self.pod["spec"].get("volumes") or []:
            name = volume["name"]
            if "persistentVolumeClaim" in volume:
                claim = volume["persistentVolumeClaim"]["claimName"]
                path = self.kubelet.workdir / "volumes" / self.namespace / claim
            elif "hostPath" in volume:
                path = Path(volume["hostPath"]["path"])
            else:
                path = self.dir / "volumes" / name
            path.mkdir(parents=True, exist_ok=True)
            data: dict[str, str] = {}
            if "configMap" in volume:
                cm = core.read_namespaced_config_map(volume["configMap"]["name"], self.namespace)
                data = dict(cm.data or {})
                items = volume["configMap"].get("items")
            elif "secret" in volume:
                import base64

                secret = core.read_namespaced_secret(volume["secret"]["secretName"], self.namespace)
                data = {k: base64.b64decode(v).decode() for k, v in (secret.data or {}).items()}
                items = volume["secret"].get("items")
            else:
                items = None
            for item in items or [{"key": k, "path": k} for k in data]:
                target = path / item["path"]
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_text(data[item["key"]])
            dirs[name] = path
        return dirs

    def _env_value(self, var: dict[str, Any]) -> str | None:
        source = var.get("valueFrom")
        if not source:  # the API omits an empty value: the variable is set, to ""
            return var.get("value", "")
        core = self.kubelet.core
        if "secretKeyRef" in source:
            import base64

            ref = source["secretKeyRef"]
            secret = core.read_namespaced_secret(ref["name"], self.namespace)
            return base64.b64decode((secret.data or {})[ref["key"]]).decode()
        if "configMapKeyRef" in source:
            ref = source["configMapKeyRef"]
            return (core.read_namespaced_config_map(ref["name"], self.namespace).data or {})[ref["key"]]
        if "fieldRef" in source:
            fields = {"metadata.name": self.name, "metadata.namespace": self.namespace,
                      "metadata.uid": self.uid, "status.podIP": self.ip, "status.hostIP": "127.0.0.1",
                      "spec.nodeName": self.kubelet.node_name}
            return fields.get(source["fieldRef"]["fieldPath"], "")
        return None  # resourceFieldRef: not known here

    def _container(self, spec: dict[str, Any], mounts: list[tuple[str, Path]]) -> Container:
        env: dict[str, str] = {}
        for var in spec.get("env") or []:
            value = self._env_value(var)
            if value is not None:
                env[var["name"]] = map_path(expand_vars(value, env), mounts)
        argv = [expand_vars(a, env) for a in (spec.get("command") or []) + (spec.get("args") or [])]
        if not argv:
            raise ValueError(f"container {spec['name']}: no command (images' entrypoints are not known here)")
        argv = [self.ip if a == "0.0.0.0" else map_path(a, mounts) for a in argv]
        resolved = shutil.which(argv[0], path=self.kubelet.path)
        if resolved is None:
            raise FileNotFoundError(f"container {spec['name']}: {argv[0]} not found on {self.kubelet.path}")
        argv[0] = resolved
        base = {k: os.environ[k] for k in PASSED_ENV if k in os.environ}
        base["PATH"] = self.kubelet.path
        base["HOSTNAME"] = self.name
        container = Container(spec, argv, {**base, **env}, self.dir / f"{spec['name']}.log")
        for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
            if spec.get(kind):
                container.probes[kind] = Probe(spec[kind])
        return container

    def setup(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        volume_dirs = self._volume_dirs()
        for spec in self.pod["spec"]["containers"]:
            mounts = [(m["mountPath"], volume_dirs[m["name"]] / m.get("subPath", ""))
                      for m in spec.get("volumeMounts") or [] if m["name"] in volume_dirs]
            mounts += [(p, Path(h)) for p, h in self.kubelet.image_paths.items()]
            mounts.sort(key=lambda m: len(m[0]), reverse=True)
            self.containers.append(self._container(spec, mounts))

    # ---- the lifecycle -----------------------------------------------------------------------

    def _start(self, c: Container, now: float) -> None:
        log_file = c.log_path.open("ab")
        c.proc = subprocess.Popen(c.argv, env=c.env, cwd=self.dir, stdout=log_file, stderr=subprocess.STDOUT,
                                  stdin=subprocess.DEVNULL, start_new_session=True)
        log_file.close()
        c.started_at = _now()
        c.state = {"running": {"startedAt": c.started_at}}
        c.started = "startupProbe" not in c.probes
        c.ready = False
        for probe in c.probes.values():
            probe.arm(now)
        log.info("%s/%s: started %s (pid %d) on %s", self.namespace, self.name, c.name, c.proc.pid, self.ip)

    def _exited(self, c: Container, now: float, reason: str | None = None) -> None:
        code = c.proc.returncode
        c.last_state = {"terminated": {"exitCode": code, "reason": reason or ("Completed" if code == 0 else "Error"),
                                       "startedAt": c.started_at, "finishedAt": _now()}}
        c.proc, c.started, c.ready = None, False, False
        policy = self.pod["spec"].get("restartPolicy", "Always")
        if policy == "Always" or (policy == "OnFailure" and code != 0):
            c.state = {"waiting": {"reason": "CrashLoopBackOff",
                                   "message": f"back-off {c.backoff_s:.0f}s restarting failed container"}}
            c.next_start = now + c.backoff_s
            c.backoff_s = min(c.backoff_s * 2, BACKOFF_MAX_S)
            c.restart_count += 1
        else:
            c.state = c.last_state
            c.next_start = float("inf")
        log.info("%s/%s: %s exited %s", self.namespace, self.name, c.name, code)

    def _probe(self, c: Container, spec: dict[str, Any], timeout_s: float) -> bool:
        def port_of(port: Any) -> int:
            if isinstance(port, int) or str(port).isdigit():
                return int(port)
            return next(p["containerPort"] for p in c.spec.get("ports") or [] if p.get("name") == port)

        try:
            if "httpGet" in spec:
                get = spec["httpGet"]
                scheme = get.get("scheme", "HTTP").lower()
                url = f"{scheme}://{get.get('host') or self.ip}:{port_of(get['port'])}{get.get('path', '/')}"
                headers = {h["name"]: h["value"] for h in get.get("httpHeaders") or []}
                status = httpx.get(url, timeout=timeout_s, headers=headers, verify=False).status_code
                return 200 <= status < 400
            if "tcpSocket" in spec:
                with socket.create_connection((self.ip, port_of(spec["tcpSocket"]["port"])), timeout=timeout_s):
                    return True
            if "exec" in spec:
                return subprocess.run(spec["exec"]["command"], env=c.env, cwd=self.dir, timeout=timeout_s,
                                      capture_output=True, check=False).returncode == 0
        except Exception:  # noqa: BLE001 - any failure to get an answer is a failed probe
            return False
        return False

    def _run_probes(self, c: Container, now: float) -> None:
        order = ("startupProbe",) if not c.started else ("livenessProbe", "readinessProbe")
        for kind in order:
            probe = c.probes.get(kind)
            if probe is None or now < probe.next_at:
                continue
            ok = self._probe(c, probe.spec, probe.timeout_s)
            probe.next_at = time.monotonic() + probe.period_s
            if ok:
                probe.failures, probe.successes = 0, probe.successes + 1
            else:
                probe.failures, probe.successes = probe.failures + 1, 0
            if kind == "startupProbe":
                if ok:
                    c.started = True
                    for other in ("livenessProbe", "readinessProbe"):
                        if other in c.probes:
                            c.probes[other].next_at = time.monotonic()
                elif probe.failures >= probe.failure_threshold:
                    self._kill(c, "startup probe failed")
            elif kind == "livenessProbe" and not ok and probe.failures >= probe.failure_threshold:
                self._kill(c, "liveness probe failed")
                return
            elif kind == "readinessProbe":
                if ok and probe.successes >= probe.success_threshold:
                    c.ready = True
                elif not ok and probe.failures >= probe.failure_threshold:
                    c.ready = False
        if c.started and "readinessProbe" not in c.probes:
            c.ready = True

    def _kill(self, c: Container, why: str, grace_s: float = 30.0) -> None:
        if c.proc is None:
            return
        log.info("%s/%s: stopping %s: %s", self.namespace, self.name, c.name, why)
        _stop_process(c.proc, grace_s)
        self._exited(c, time.monotonic(), reason=why)

    def run(self) -> None:
        try:
            self.setup()
        except Exception as err:  # noqa: BLE001 - reported in the pod's status, as a kubelet does
            log.warning("%s/%s: cannot start: %s", self.namespace, self.name, err)
            self._write_status(error=f"{type(err).__name__}: {err}")
            self.deleting.wait()
            self._finish()
            return
        last_status: Any = None
        while not self.deleting.is_set() and not self.gone.is_set():
            now = time.monotonic()
            for c in self.containers:
                with self.lock:
                    if c.proc is None and now >= c.next_start:
                        self._start(c, now)
                    elif c.proc is not None and c.proc.poll() is not None:
                        self._exited(c, now)
                    if c.proc is not None:
                        self._run_probes(c, now)
            status = self._status()
            if status != last_status:
                try:
                    self.kubelet.core.patch_namespaced_pod_status(self.name, self.namespace, {"status": status})
                    last_status = status
                except Exception as err:  # noqa: BLE001 - the pod may be going; retried next round
                    log.debug("%s/%s: status not written: %s", self.namespace, self.name, err)
            self.deleting.wait(POLL_S)
        self._finish()

    def _finish(self) -> None:
        """Delete: preStop, SIGTERM, the grace period, SIGKILL; then the pod leaves the API."""
        grace_s = float(self.pod["spec"].get("terminationGracePeriodSeconds", 30))
        deadline = time.monotonic() + grace_s
        if not self.gone.is_set():
            for c in self.containers:
                pre_stop = ((c.spec.get("lifecycle") or {}).get("preStop") or {}).get("sleep")
                if c.proc is not None and pre_stop:
                    time.sleep(min(float(pre_stop["seconds"]), grace_s))
        for c in self.containers:
            if c.proc is not None:
                _stop_process(c.proc, max(0.0, deadline - time.monotonic()) if not self.gone.is_set() else 0.0)
        if not self.gone.is_set():
            from kubernetes.client import V1DeleteOptions, V1Preconditions

            try:
                self.kubelet.core.delete_namespaced_pod(
                    self.name, self.namespace,
                    body=V1DeleteOptions(grace_period_seconds=0, preconditions=V1Preconditions(uid=self.uid)),
                )
            except Exception as err:  # noqa: BLE001 - already gone
                log.debug("%s/%s: delete: %s", self.namespace, self.name, err)
        log.info("%s/%s: removed", self.namespace, self.name)

    # ---- status ------------------------------------------------------------------------------

    def _condition(self, type_: str, value: bool, reason: str = "", message: str = "") -> dict[str, Any]:
        status = "True" if value else "False"
        old = self.conditions.get(type_)
        since = old[1] if old and old[0] == status else _now()
        self.conditions[type_] = (status, since)
        entry = {"type": type_, "status": status, "lastTransitionTime": since, "lastProbeTime": None}
        if reason:
            entry.update(reason=reason, message=message)
        return entry

    def _status(self, error: str | None = None) -> dict[str, Any]:
        statuses = []
        for c in self.containers:
            statuses.append({
                "name": c.name, "image": c.spec.get("image", ""), "imageID": "",
                "containerID": f"local://{c.proc.pid}" if c.proc else "",
                "ready": c.ready, "started": c.started, "restartCount": c.restart_count,
                "state": copy.deepcopy(c.state), "lastState": copy.deepcopy(c.last_state),
            })
        ready = bool(self.containers) and all(c.ready for c in self.containers)
        not_ready = [c.name for c in self.containers if not c.ready]
        message = f"containers with unready status: [{' '.join(not_ready)}]" if not_ready else ""
        running = any(c.proc is not None for c in self.containers)
        status: dict[str, Any] = {
            "phase": "Running" if running or any(c.restart_count for c in self.containers) else "Pending",
            "hostIP": "127.0.0.1", "hostIPs": [{"ip": "127.0.0.1"}],
            "podIP": self.ip, "podIPs": [{"ip": self.ip}],
            "startTime": self.start_time,
            "conditions": [
                self._condition("PodReadyToStartContainers", error is None),
                self._condition("Initialized", True),
                self._condition("Ready", ready, "" if ready else "ContainersNotReady", message),
                self._condition("ContainersReady", ready, "" if ready else "ContainersNotReady", message),
                self._condition("PodScheduled", True),
            ],
            "containerStatuses": statuses,
        }
        if error:
            status["message"] = error
            for s in statuses:
                s["state"] = {"waiting": {"reason": "CreateContainerError", "message": error}}
        return status

    def _write_status(self, error: str | None = None) -> None:
        try:
            self.kubelet.core.patch_namespaced_pod_status(self.name, self.namespace, {"status": self._status(error)})
        except Exception as err:  # noqa: BLE001
            log.debug("%s/%s: status not written: %s", self.namespace, self.name, err)

    # ---- for tests ---------------------------------------------------------------------------

    def kill(self, container: str | None = None, sig: int = signal.SIGKILL) -> int:
        """Send `sig` to a container's process (as the OOM killer or a crash would); -> its pid."""
        c = next(c for c in self.containers if container in (None, c.name))
        with self.lock:
            assert c.proc is not None, f"{self.name}/{c.name} is not running"
            pid = c.proc.pid
            os.killpg(pid, sig)
        return pid


def _stop_process(proc: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM the container's process group, SIGKILL it after `grace_s`."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=grace_s)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


class LocalKubelet:
    """One node whose pods run as processes on this machine. `start()` registers it; `stop()`
    kills what runs, removes its pods and the node."""

    def __init__(self, cluster, workdir: Path, *, node_name: str = "local-0",
                 image_paths: dict[str, str | Path] | None = None, path: str | None = None,
                 cpu: str = "16", memory: str = "64Gi"):
        self.cluster = cluster
        self.workdir = Path(workdir)
        self.node_name = node_name
        self.image_paths = {k: Path(v) for k, v in (image_paths or {}).items()}
        self.path = path or os.environ.get("PATH", "/usr/bin:/bin")
        self.cpu, self.memory = cpu, memory
        self.pods: dict[str, PodRunner] = {}  # uid -> runner
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        # Each pod gets an address of its own in 127.0.0.0/8; this node's block is picked at random
        # so that several sessions on one machine do not collide.
        self._ip_prefix = f"127.{random.randint(20, 250)}.{random.randint(0, 255)}"
        self._next_host = 2
        self._api = None

    # ---- API access -------------------------------------------------------------------------

    @property
    def core(self):
        from kubernetes import client

        if self._api is None:
            self._api = self.cluster.api_client()
        return client.CoreV1Api(self._api)

    def _allocate_ip(self, ports: list[int]) -> str:
        while self._next_host < 255:
            ip = f"{self._ip_prefix}.{self._next_host}"
            self._next_host += 1
            if all(_port_free(ip, p) for p in ports):
                return ip
        raise RuntimeError(f"no free loopback address left in {self._ip_prefix}.0/24")

    # ---- the node ---------------------------------------------------------------------------

    def _node_status(self) -> dict[str, Any]:
        now = _now()
        capacity = {"cpu": self.cpu, "memory": self.memory, "pods": "20", "ephemeral-storage": "100Gi"}
        ok = [("Ready", "True", "KubeletReady", "local kubelet is posting ready status"),
              ("MemoryPressure", "False", "KubeletHasSufficientMemory", ""),
              ("DiskPressure", "False", "KubeletHasNoDiskPressure", ""),
              ("PIDPressure", "False", "KubeletHasSufficientPID", "")]
        return {
            "capacity": capacity, "allocatable": capacity,
            "conditions": [{"type": t, "status": s, "reason": r, "message": m, "lastHeartbeatTime": now,
                            "lastTransitionTime": self._started_at} for t, s, r, m in ok],
            "addresses": [{"type": "InternalIP", "address": "127.0.0.1"}, {"type": "Hostname", "address": self.node_name}],
            "nodeInfo": {"architecture": "amd64", "operatingSystem": "linux", "kubeletVersion": "local",
                         "kubeProxyVersion": "local", "containerRuntimeVersion": "local://processes",
                         "osImage": "", "kernelVersion": os.uname().release, "machineID": "", "systemUUID": "",
                         "bootID": ""},
        }

    def _register(self) -> None:
        from kubernetes import client

        self._started_at = _now()
        node = {
            "apiVersion": "v1", "kind": "Node",
            "metadata": {"name": self.node_name, "labels": {
                "kubernetes.io/hostname": self.node_name, "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64", LOCAL_NODE_LABEL: "true"}},
            "spec": {},
        }
        self.core.create_node(node)
        self.core.patch_node_status(self.node_name, {"status": self._node_status()})
        lease = client.V1Lease(
            metadata=client.V1ObjectMeta(name=self.node_name, namespace="kube-node-lease"),
            spec=client.V1LeaseSpec(holder_identity=self.node_name, lease_duration_seconds=40,
                                    renew_time=_now_micro()),
        )
        coordination = client.CoordinationV1Api(self._api)
        try:
            coordination.create_namespaced_lease("kube-node-lease", lease)
        except client.exceptions.ApiException as err:
            if err.status != 409:  # a lease of that name already exists: take it over
                raise
            coordination.patch_namespaced_lease(self.node_name, "kube-node-lease", {
                "spec": {"holderIdentity": self.node_name, "leaseDurationSeconds": 40, "renewTime": _now_micro()}})

    def _heartbeat(self) -> None:
        from kubernetes import client

        coordination = client.CoordinationV1Api(self._api)
        while not self._stop.wait(HEARTBEAT_S):
            try:
                coordination.patch_namespaced_lease(self.node_name, "kube-node-lease",
                                                    {"spec": {"renewTime": _now_micro()}})
                self.core.patch_node_status(self.node_name, {"status": {"conditions": self._node_status()["conditions"]}})
            except Exception as err:  # noqa: BLE001 - the next beat retries
                log.warning("node %s: heartbeat failed: %s", self.node_name, err)

    def _sync(self) -> None:
        while not self._stop.wait(POLL_S):
            try:
                pods = self.core.list_pod_for_all_namespaces(field_selector=f"spec.nodeName={self.node_name}")
            except Exception as err:  # noqa: BLE001
                log.debug("list pods: %s", err)
                continue
            seen = set()
            for item in pods.items:
                pod = self._api.sanitize_for_serialization(item)
                uid = pod["metadata"]["uid"]
                seen.add(uid)
                runner = self.pods.get(uid)
                if runner is None and not pod["metadata"].get("deletionTimestamp"):
                    ports = [p["containerPort"] for c in pod["spec"]["containers"] for p in c.get("ports") or []]
                    runner = PodRunner(self, pod, self._allocate_ip(ports))
                    self.pods[uid] = runner
                    runner.start()
                elif runner is None:
                    # Deleted before it ever ran here: nothing to stop, remove it.
                    self._force_delete(pod)
                elif pod["metadata"].get("deletionTimestamp"):
                    runner.deleting.set()
            for uid, runner in list(self.pods.items()):
                if uid not in seen:
                    runner.gone.set()
                    if not runner.is_alive():
                        del self.pods[uid]

    def _force_delete(self, pod: dict[str, Any]) -> None:
        from kubernetes.client import V1DeleteOptions

        try:
            self.core.delete_namespaced_pod(pod["metadata"]["name"], pod["metadata"]["namespace"],
                                            body=V1DeleteOptions(grace_period_seconds=0))
        except Exception:  # noqa: BLE001
            pass

    def start(self) -> LocalKubelet:
        self.workdir.mkdir(parents=True, exist_ok=True)
        _ = self.core
        self._register()
        for target in (self._heartbeat, self._sync):
            thread = threading.Thread(target=target, name=f"local-kubelet-{target.__name__}", daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(10)
        for runner in self.pods.values():
            runner.gone.set()
        for runner in self.pods.values():
            runner.join(30)
            self._force_delete(runner.pod)
        try:
            self.core.delete_node(self.node_name)
        except Exception as err:  # noqa: BLE001
            log.warning("node %s: not deleted: %s", self.node_name, err)
        if self._api is not None:
            self._api.close()

    # ---- for tests --------------------------------------------------------------------------

    def runner(self, namespace: str, name: str) -> PodRunner:
        for runner in self.pods.values():
            if runner.namespace == namespace and runner.name == name and not runner.deleting.is_set():
                return runner
        raise KeyError(f"no pod {namespace}/{name} runs on {self.node_name}")

    def running(self, namespace: str | None = None) -> list[PodRunner]:
        return [r for r in self.pods.values() if r.is_alive() and not r.deleting.is_set()
                and namespace in (None, r.namespace)]

    def cordon_others(self) -> list[str]:
        """Mark every other node unschedulable (so pods land here); -> their names, for uncordon()."""
        names = [n.metadata.name for n in self.core.list_node().items
                 if n.metadata.name != self.node_name and not n.spec.unschedulable]
        for name in names:
            self.core.patch_node(name, {"spec": {"unschedulable": True}})
        return names

    def uncordon(self, names: list[str]) -> None:
        for name in names:
            self.core.patch_node(name, {"spec": {"unschedulable": False}})


def _port_free(ip: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((ip, port))
            return True
        except OSError:
            return False
