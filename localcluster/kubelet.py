"""A kubelet for local nodes: it really runs its pods' containers, as processes on this machine.

`LocalKubelet` registers a node, keeps it Ready (node status and its Lease in kube-node-lease, as
a kubelet does), serves the kubelet API the apiserver uses for `kubectl logs` and `kubectl
port-forward` (`kubelet_api.py`, TLS both ways), and for every pod the scheduler binds to it:

- gives the pod an address: with `network` (`netns.NamespaceNetwork`, root) a network namespace
  of its own on a private /24 that exists only on this machine; without it a loopback address
  (127.x.y.z), which the Endpoints controllers refuse (tests that talk to the pod directly use it);
- runs each container's `command` + `args` (an image's known entrypoint where it names none:
  `podspec.command_of`) with `$(VAR)` expanded, its `env` (values, and `valueFrom` Secret/ConfigMap
  keys and pod fields) plus the KUBERNETES_SERVICE_HOST/PORT of the apiserver, and nothing else of
  this process's environment but PATH, HOME, LANG and the thread-count variables;
- materialises its volumes: ConfigMap/Secret/downwardAPI/projected (the ServiceAccount token from
  the TokenRequest API) files, an emptyDir as an empty directory, a PersistentVolumeClaim as a
  directory per claim that outlives the pod (a new pod of the same claim sees the same files);
- maps each volume's mountPath, and each path of `image_paths` (what the image would hold), onto
  those directories wherever a path appears in the command, the args or the env; mounts under
  /run and /var/run (the ServiceAccount's) are really mounted, in the container's own mount
  namespace (`sandbox.py`, root);
- runs the startup, liveness and readiness probes (httpGet, tcpSocket, exec) with their own
  periods and thresholds against the pod's address, restarts containers that exit or fail liveness
  (restartPolicy, with the kubelet's doubling back-off: CrashLoopBackOff with the last exit code),
  keeps each container's current and previous log, and writes the pod's status;
- on deletion runs the preStop sleep, sends SIGTERM, waits out the grace period, kills, removes
  the pod's namespace and the pod.

Images are not pulled and nothing is limited (no cgroups): the container runs from this machine's
filesystem and Python environment, which is why `image_paths` says where the image's files live here.
"""

from __future__ import annotations

import base64
import copy
import logging
import os
import random
import shutil
import signal
import socket
import subprocess
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable
from urllib.parse import urlsplit

import httpx

from . import sandbox
from .podspec import (APISERVER_SERVICE_PORT, BACKOFF_INITIAL_S, DEFAULT_ENTRYPOINTS, LOCAL_NODE_LABEL, PASSED_ENV,
                      Probe, command_of, expand_vars, map_path, next_backoff, node_status, pod_hosts_file, under_run)

log = logging.getLogger("specdeploy.localcluster.kubelet")

HEARTBEAT_S = 5.0
POLL_S = 0.25
SERVICE_ACCOUNT_TOKEN_S = 3607


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _now_micro() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@dataclass
class Container:
    spec: dict[str, Any]
    argv: list[str]
    env: dict[str, str]
    log_path: Path
    preexec: Callable[[], None] | None = None
    proc: subprocess.Popen | None = None
    runs: int = 0  # how many times it was started: a log reader follows one run
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

    @property
    def previous_log_path(self) -> Path:
        return self.log_path.with_suffix(".previous.log")


class PodRunner(threading.Thread):
    """One pod: its containers' processes, probes and status, until the pod is deleted."""

    def __init__(self, kubelet: LocalKubelet, pod: dict[str, Any]):
        meta = pod["metadata"]
        super().__init__(name=f"pod-{meta['namespace']}-{meta['name']}", daemon=True)
        self.kubelet = kubelet
        self.pod = pod
        self.namespace, self.name, self.uid = meta["namespace"], meta["name"], meta["uid"]
        self.ip = ""
        self.netns: str | None = None
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
            sources = volume["projected"].get("sources") or [] if "projected" in volume else [volume]
            for source in sources:
                for rel, text in self._volume_files(source):
                    target = path / rel
                    target.parent.mkdir(parents=True, exist_ok=True)
                    target.write_text(text)
            dirs[name] = path
        return dirs

    def _volume_files(self, source: dict[str, Any]) -> list[tuple[str, str]]:
        """(path, text) of the files a ConfigMap, Secret, downwardAPI or serviceAccountToken source makes."""
        core = self.kubelet.core
        if "configMap" in source:
            data = dict(core.read_namespaced_config_map(source["configMap"]["name"], self.namespace).data or {})
            items = source["configMap"].get("items")
        elif "secret" in source:
            ref = source["secret"]
            secret = core.read_namespaced_secret(ref.get("secretName") or ref["name"], self.namespace)
            data = {k: base64.b64decode(v).decode() for k, v in (secret.data or {}).items()}
            items = ref.get("items")
        elif "downwardAPI" in source:
            return [(item["path"], self._field(item["fieldRef"]["fieldPath"]))
                    for item in source["downwardAPI"].get("items") or [] if "fieldRef" in item]
        elif "serviceAccountToken" in source:
            return [(source["serviceAccountToken"]["path"], self._token(source["serviceAccountToken"]))]
        else:
            return []
        return [(item["path"], data[item["key"]]) for item in items or [{"key": k, "path": k} for k in data]]

    def _token(self, spec: dict[str, Any]) -> str:
        """A bound token of the pod's ServiceAccount (TokenRequest, as the kubelet asks for one)."""
        body = {"spec": {"audiences": [spec["audience"]] if spec.get("audience") else None,
                         "expirationSeconds": int(spec.get("expirationSeconds", SERVICE_ACCOUNT_TOKEN_S)),
                         "boundObjectRef": {"apiVersion": "v1", "kind": "Pod", "name": self.name, "uid": self.uid}}}
        account = self.pod["spec"].get("serviceAccountName") or "default"
        return self.kubelet.core.create_namespaced_service_account_token(account, self.namespace, body).status.token

    def _field(self, path: str) -> str:
        meta = self.pod["metadata"]
        fields = {"metadata.name": self.name, "metadata.namespace": self.namespace, "metadata.uid": self.uid,
                  "status.podIP": self.ip, "status.hostIP": self.kubelet.node_ip, "spec.nodeName": self.kubelet.node_name,
                  "spec.serviceAccountName": self.pod["spec"].get("serviceAccountName") or "default"}
        if path.startswith("metadata.labels['") or path.startswith("metadata.annotations['"):
            kind, _, key = path[len("metadata."):].partition("['")
            return (meta.get(kind) or {}).get(key.rstrip("']"), "")
        return fields.get(path, "")

    def _env_value(self, var: dict[str, Any]) -> str | None:
        source = var.get("valueFrom")
        if not source:  # the API omits an empty value: the variable is set, to ""
            return var.get("value", "")
        core = self.kubelet.core
        if "secretKeyRef" in source:
            ref = source["secretKeyRef"]
            secret = core.read_namespaced_secret(ref["name"], self.namespace)
            return base64.b64decode((secret.data or {})[ref["key"]]).decode()
        if "configMapKeyRef" in source:
            ref = source["configMapKeyRef"]
            return (core.read_namespaced_config_map(ref["name"], self.namespace).data or {})[ref["key"]]
        if "fieldRef" in source:
            return self._field(source["fieldRef"]["fieldPath"])
        return None  # resourceFieldRef: not known here

    def _container(self, spec: dict[str, Any], mounts: list[tuple[str, Path]], run_dir: Path | None) -> Container:
        # A kubelet sets the apiserver's Service variables; here they name where it is reachable
        # from the pod (the node's relay in a namespace, loopback without one).
        host, port = self.kubelet.apiserver_for_pods
        env: dict[str, str] = {"KUBERNETES_SERVICE_HOST": host, "KUBERNETES_SERVICE_PORT": str(port),
                               "KUBERNETES_SERVICE_PORT_HTTPS": str(port)}
        for var in spec.get("env") or []:
            value = self._env_value(var)
            if value is not None:
                env[var["name"]] = map_path(expand_vars(value, env), mounts)
        argv = [expand_vars(a, env) for a in command_of(spec, self.kubelet.entrypoints)]
        # Without a namespace the pod's own loopback address stands for "every interface".
        argv = [self.ip if a == "0.0.0.0" and self.netns is None else map_path(a, mounts) for a in argv]
        resolved = shutil.which(argv[0], path=self.kubelet.path)
        if resolved is None:
            raise FileNotFoundError(f"container {spec['name']}: {argv[0]} not found on {self.kubelet.path}")
        argv[0] = resolved
        base = {k: os.environ[k] for k in PASSED_ENV if k in os.environ}
        base["PATH"] = self.kubelet.path
        base["HOSTNAME"] = self.name
        container = Container(spec, argv, {**base, **env}, self.dir / f"{spec['name']}.log",
                              preexec=sandbox.preexec(
                                  self.netns, run_dir if self.netns else None, self.dir / "hosts" if self.netns else None,
                                  image_binds=list(self.kubelet.image_paths.items()) if self.netns else [],
                                  shadow_dir=self.dir / "shadow"))
        for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
            if spec.get(kind):
                container.probes[kind] = Probe(spec[kind])
        return container

    def setup(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        self.netns, self.ip = self.kubelet.allocate_address(self.pod)
        if self.netns:
            (self.dir / "hosts").write_text(pod_hosts_file(self.ip, self.name, self.kubelet.apiserver_for_pods[0]))
        volume_dirs = self._volume_dirs()
        for spec in self.pod["spec"]["containers"]:
            mounts = [(m["mountPath"], volume_dirs[m["name"]] / m.get("subPath", ""))
                      for m in spec.get("volumeMounts") or [] if m["name"] in volume_dirs]
            if self.netns is None:  # in a mount namespace the image's paths are there as they are
                mounts += [(p, Path(h)) for p, h in self.kubelet.image_paths.items()]
            mounts.sort(key=lambda m: len(m[0]), reverse=True)
            # The container's /run: its volumes mounted under /run or /var/run, bound there for real.
            run_dir = self.dir / "run" / spec["name"]
            run_dir.mkdir(parents=True, exist_ok=True)
            for container_path, host_dir in mounts:
                rel = under_run(container_path)
                if rel:
                    link = run_dir / rel
                    link.parent.mkdir(parents=True, exist_ok=True)
                    if not link.is_symlink():
                        link.symlink_to(host_dir)
            self.containers.append(self._container(spec, mounts, run_dir))

    # ---- the lifecycle -----------------------------------------------------------------------

    def _start(self, c: Container, now: float) -> None:
        # `kubectl logs --previous` reads the run before this one.
        if c.runs and c.log_path.exists():
            os.replace(c.log_path, c.previous_log_path)
        log_file = c.log_path.open("wb")
        try:
            c.proc = subprocess.Popen(c.argv, env=c.env, cwd=self.dir, stdout=log_file, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=c.preexec)
        finally:
            log_file.close()
        c.runs += 1
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
                                   "message": f"back-off {c.backoff_s:.0f}s restarting failed container="
                                              f"{c.name} pod={self.name}_{self.namespace}({self.uid}); "
                                              f"last exit code {code}"}}
            c.next_start = now + c.backoff_s
            c.backoff_s = next_backoff(c.backoff_s)
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
                        try:
                            self._start(c, now)
                        except (OSError, subprocess.SubprocessError) as err:
                            # As a kubelet reports a container it cannot create; tried again after the back-off.
                            log.warning("%s/%s: cannot start %s: %s", self.namespace, self.name, c.name, err)
                            c.state = {"waiting": {"reason": "CreateContainerError", "message": str(err)}}
                            c.next_start = now + c.backoff_s
                            c.backoff_s = next_backoff(c.backoff_s)
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
        self.kubelet.release_address(self.netns)
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
        finished = bool(self.containers) and all(c.next_start == float("inf") for c in self.containers)
        if finished:
            codes = [c.last_state.get("terminated", {}).get("exitCode") for c in self.containers]
            phase = "Succeeded" if all(code == 0 for code in codes) else "Failed"
        else:
            phase = "Running" if running or any(c.restart_count for c in self.containers) else "Pending"
        host = self.kubelet.node_ip
        status: dict[str, Any] = {
            "phase": phase,
            "hostIP": host, "hostIPs": [{"ip": host}],
            **({"podIP": self.ip, "podIPs": [{"ip": self.ip}]} if self.ip else {}),
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
    kills what runs, removes its pods, their namespaces and the node.

    `cluster`: anything with `.kubeconfig` (and `.pki_dir`, the cluster CA, for the kubelet API),
    e.g. a `KubeCluster`. Without a PKI the node serves no kubelet API (no logs, no port-forward)."""

    def __init__(self, cluster, workdir: Path, *, node_name: str = "local-0",
                 image_paths: dict[str, str | Path] | None = None, path: str | None = None,
                 cpu: str = "16", memory: str = "64Gi", network=None,
                 entrypoints: dict[str, list[str]] | None = None, kubelet_port: int = 0):
        self.kubeconfig = Path(getattr(cluster, "kubeconfig", cluster))
        pki_dir = getattr(cluster, "pki_dir", None)
        self.pki_dir = Path(pki_dir) if pki_dir and (Path(pki_dir) / "ca.key").exists() else None
        self.workdir = Path(workdir)
        self.node_name = node_name
        self.image_paths = {k: Path(v) for k, v in (image_paths or {}).items()}
        self.entrypoints = dict(DEFAULT_ENTRYPOINTS if entrypoints is None else entrypoints)
        self.path = path or os.environ.get("PATH", "/usr/bin:/bin")
        self.cpu, self.memory = cpu, memory
        self.network = network  # netns.NamespaceNetwork, or None: loopback addresses
        self.kubelet_port = kubelet_port
        self.pods: dict[str, PodRunner] = {}  # uid -> runner
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        # Without namespaces each pod gets an address of its own in 127.0.0.0/8; this node's block
        # is picked at random so that several sessions on one machine do not collide.
        self._ip_prefix = f"127.{random.randint(20, 250)}.{random.randint(0, 255)}"
        self._next_host = 2
        self._ip_lock = threading.Lock()
        self._api = None
        self._kubelet_api = None
        self._relay = None

    # ---- API access -------------------------------------------------------------------------

    @property
    def core(self):
        from kubernetes import client

        if self._api is None:
            from kubernetes import config

            self._api = config.new_client_from_config(config_file=str(self.kubeconfig))
        return client.CoreV1Api(self._api)

    @property
    def node_ip(self) -> str:
        return self.network.node_ip if self.network is not None else "127.0.0.1"

    @property
    def apiserver(self) -> tuple[str, int]:
        url = urlsplit(self._api.configuration.host)
        return url.hostname, url.port or 443

    @property
    def apiserver_for_pods(self) -> tuple[str, int]:
        """Where pods reach the apiserver: in a namespace, the node's relay on port 443 (what the
        `kubernetes` Service would give; `kubernetes.default.svc` resolves there)."""
        return (self.node_ip, APISERVER_SERVICE_PORT) if self.network is not None else self.apiserver

    def allocate_address(self, pod: dict[str, Any]) -> tuple[str | None, str]:
        """(network namespace or None, pod IP) for a new pod."""
        if self.network is not None:
            return self.network.add_pod()
        ports = [p["containerPort"] for c in pod["spec"]["containers"] for p in c.get("ports") or []]
        with self._ip_lock:
            while self._next_host < 255:
                ip = f"{self._ip_prefix}.{self._next_host}"
                self._next_host += 1
                if all(_port_free(ip, p) for p in ports):
                    return None, ip
        raise RuntimeError(f"no free loopback address left in {self._ip_prefix}.0/24")

    def release_address(self, netns: str | None) -> None:
        if netns and self.network is not None:
            self.network.remove_pod(netns)

    # ---- the kubelet API's view of the pods --------------------------------------------------

    def _pod(self, namespace: str, name: str) -> PodRunner:
        for runner in list(self.pods.values()):
            if runner.namespace == namespace and runner.name == name:
                return runner
        raise KeyError(f"pod {namespace}/{name} does not run on node {self.node_name}")

    def log_file(self, namespace: str, pod: str, container: str, previous: bool) -> tuple[Path, Callable[[], bool]]:
        runner = self._pod(namespace, pod)
        c = next((c for c in runner.containers if c.name == container), None)
        if c is None:
            raise KeyError(f"container {container} is not in pod {namespace}/{pod}")
        if previous:
            # The last terminated run: while the container waits to restart, the one that just ended.
            if c.proc is None and c.runs and c.log_path.exists():
                return c.log_path, lambda: False
            if not c.previous_log_path.exists():
                raise KeyError(f"previous terminated container \"{container}\" in pod \"{pod}\" not found")
            return c.previous_log_path, lambda: False
        if not c.log_path.exists():
            raise KeyError(f"container \"{container}\" in pod \"{pod}\" is waiting to start")
        run = c.runs
        return c.log_path, lambda: c.runs == run and c.proc is not None and runner.is_alive()

    def port_forward_target(self, namespace: str, pod: str) -> str:
        runner = self._pod(namespace, pod)
        if not runner.ip:
            raise KeyError(f"pod {namespace}/{pod} has no address yet")
        return runner.ip

    # ---- the node ---------------------------------------------------------------------------

    def _node_status(self) -> dict[str, Any]:
        return node_status(now=_now(), since=self._started_at, node_ip=self.node_ip, hostname=self.node_name,
                           kubelet_port=self.kubelet_port, cpu=self.cpu, memory=self.memory, kernel=os.uname().release)

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
        try:
            self.core.create_node(node)
        except client.exceptions.ApiException as err:
            if err.status != 409:  # a node of that name was left by a crashed run: take it over
                raise
            self.core.patch_node(self.node_name, {"metadata": {"labels": node["metadata"]["labels"]}})
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
                    if pod["status"].get("phase") in ("Succeeded", "Failed"):
                        continue  # finished before this node (re)started: nothing to run
                    runner = PodRunner(self, pod)
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

    def _start_kubelet_api(self) -> None:
        from .kubelet_api import KubeletAPI
        from .pki import write_serving_cert

        cert, key = write_serving_cert(self.pki_dir, self.workdir / "pki", self.node_name, [self.node_ip])
        self._kubelet_api = KubeletAPI(self, self.node_ip, self.kubelet_port, cert, key,
                                       client_ca_file=self.pki_dir / "ca.crt", client_certs=[self.pki_dir / "admin.crt"])
        self.kubelet_port = self._kubelet_api.start()
        log.info("node %s: kubelet API on https://%s:%d", self.node_name, self.node_ip, self.kubelet_port)

    def start(self) -> LocalKubelet:
        self.workdir.mkdir(parents=True, exist_ok=True)
        _ = self.core
        if self.network is not None:
            from .relay import TcpRelay

            # Pods reach the apiserver (on the host's loopback) through the node's address.
            self._relay = TcpRelay(self.apiserver_for_pods, self.apiserver).start()
        if self.pki_dir is not None:
            self._start_kubelet_api()
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
        for server in (self._kubelet_api, self._relay):
            if server is not None:
                server.stop()
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
