"""`specdeploy cluster up | down | status`, and the local node's own process.

`up` starts the control plane from the cached tools (building them first if they are missing),
then the local node as a process of its own (`specdeploy cluster node`, detached: it outlives the
command), writes the kubeconfig and links kubectl and helm into the cluster's bin/. `down` stops
the node (its pods with it), deletes the control plane, stops anything still running from the
cluster's directory, removes the pod network and the directory, and checks that nothing is left:
it works the same after a crash (the node SIGKILLed, the machine rebooted) since it goes by the
directory and the cluster's tag, not by what a live process remembers.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

from . import netns
from .controlplane import KubeCluster, _alive, _pids_mentioning, _terminate, wait_for
from .podspec import DEFAULT_ENTRYPOINTS
from .state import NODE_GRACE_S, NODE_NAME, ClusterState, Layout, clusters_root, tag_for, validate_name
from .tools import Tools, ToolsMissing, ensure_tools

log = logging.getLogger("specdeploy.localcluster")

NODE_READY_TIMEOUT_S = 60.0
NODE_STOP_TIMEOUT_S = 20.0
# CPUs the node offers the scheduler, at least: nothing is limited here (no cgroups), so requests
# only decide placement, and a 2-core laptop still takes the examples (tiny-cpu-demo asks for 2
# next to the operator's 50m).
MIN_NODE_CPUS = 8
Say = Callable[[str], None]


class ClusterError(RuntimeError):
    """A reason `up`/`down` cannot go on, in one line for the user."""


def layout_of(name: str) -> Layout:
    return Layout(clusters_root() / validate_name(name))


def port_in_use(host: str, port: int) -> bool:
    import socket

    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
            return False
        except OSError:
            return True


def _node_pid(layout: Layout) -> int | None:
    try:
        pid = int(layout.node_pid.read_text())
    except (OSError, ValueError):
        return None
    return pid if _alive(pid) else None


def _kubectl(tools: Tools, layout: Layout, *args: str, timeout_s: float = 20) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(tools.kubectl), "--kubeconfig", str(layout.kubeconfig), *args], capture_output=True,
                          text=True, timeout=timeout_s, stdin=subprocess.DEVNULL)


def is_running(layout: Layout) -> bool:
    """The node process is alive and the apiserver answers."""
    if not layout.state_file.exists() or _node_pid(layout) is None:
        return False
    state = ClusterState.from_json(layout.state_file.read_text())
    return port_in_use("127.0.0.1", state.apiserver_port)


def default_image_paths() -> dict[str, str]:
    """Where the engine image's files are on this machine: its demo pair (Dockerfile.engine trains
    it into /opt/specdeploy/demo) is the one `specdeploy demo` caches."""
    from specdeploy.engine.demo.cli import default_cache_dir

    return {"/opt/specdeploy/demo": str(default_cache_dir())}


def up(name: str, port: int, say: Say, image_paths: dict[str, str] | None = None) -> Layout:
    layout = layout_of(name)
    if layout.state_file.exists():
        if is_running(layout):
            state = ClusterState.from_json(layout.state_file.read_text())
            say(f"cluster {name} is already running (https://127.0.0.1:{state.apiserver_port}); "
                f"`specdeploy cluster down{'' if name == 'local' else ' --name ' + name}` removes it")
            say(layout.export_line())
            return layout
        say(f"cluster {name}: removing what a stopped run left in {layout.root}")
        down(name, lambda _line: None)
    if port_in_use("127.0.0.1", port):
        raise ClusterError(f"port {port} (kube-apiserver) is already in use on 127.0.0.1: stop what holds it or pass --port")

    t0 = time.monotonic()
    try:
        tools = ensure_tools(lambda line: say(f"  {line}"))
    except ToolsMissing as err:
        raise ClusterError(str(err).splitlines()[0]) from None

    why_not = netns.available()
    tag = tag_for(layout.root)
    if why_not is None:
        subnet = netns.pick_subnet(netns.taken_networks())
        network, node_ip = "netns", str(subnet.network_address + 1)
    else:
        subnet, network, node_ip = None, "loopback", "127.0.0.1"
        say(f"  note: {why_not}; pods get loopback addresses, which Services' endpoints refuse")
    state = ClusterState(
        name=name, tag=tag, apiserver_port=port, network=network, subnet=str(subnet or ""), node_ip=node_ip,
        image_paths=image_paths if image_paths is not None else default_image_paths(),
        entrypoints=DEFAULT_ENTRYPOINTS,
        # The containers' commands (`specdeploy`, `python`) are this environment's.
        path=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "/usr/bin:/bin")]),
    )
    layout.root.mkdir(parents=True, exist_ok=True)
    layout.state_file.write_text(state.to_json())
    try:
        say(f"starting etcd, kube-apiserver, kube-controller-manager, kube-scheduler {tools.kube_version} on 127.0.0.1:{port} ...")
        cluster = KubeCluster.start(tools, nodes=(), workdir=layout.control_plane, name=state.kwok_name,
                                    apiserver_port=port, node_grace_s=NODE_GRACE_S,
                                    apiserver_sans=(node_ip,) if network == "netns" else ())
        shutil.copyfile(cluster.kubeconfig, layout.kubeconfig)
        layout.bin_dir.mkdir(exist_ok=True)
        for tool in (tools.kubectl, tools.helm):
            link = layout.bin_dir / tool.name
            link.unlink(missing_ok=True)
            link.symlink_to(tool)
        say(f"  control plane up in {time.monotonic() - t0:.0f} s; starting node {NODE_NAME} "
            f"({'pods in network namespaces on ' + str(subnet) if subnet else 'pods on loopback'}) ...")
        _spawn_node(layout)
        _wait_node_ready(tools, layout)
    except BaseException:
        log_tail = layout.node_log.read_text(errors="replace").strip().splitlines()[-5:] if layout.node_log.exists() else []
        down(name, lambda _line: None)
        if log_tail:
            say("node log:\n  " + "\n  ".join(log_tail))
        raise
    say(f"cluster {name} is up in {time.monotonic() - t0:.0f} s: Kubernetes {tools.kube_version} at "
        f"https://127.0.0.1:{port}, node {NODE_NAME} runs pods as local processes")
    say(layout.export_line())
    return layout


def _spawn_node(layout: Layout) -> None:
    layout.node_log.parent.mkdir(parents=True, exist_ok=True)
    with layout.node_log.open("ab") as out:
        # Its own session: the node outlives this command and the terminal it ran in.
        subprocess.Popen([sys.executable, "-P", "-m", "specdeploy.cli", "cluster", "node", "--dir", str(layout.root)],
                         stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                         cwd=layout.root)


def _wait_node_ready(tools: Tools, layout: Layout) -> None:
    def ready() -> bool:
        if layout.node_pid.exists() and _node_pid(layout) is None:
            raise ClusterError(f"the local node exited; its log is {layout.node_log}")
        out = _kubectl(tools, layout, "get", "node", NODE_NAME, "-o",
                       "jsonpath={.status.conditions[?(@.type=='Ready')].status}")
        return out.returncode == 0 and out.stdout.strip() == "True"

    deadline = time.monotonic() + NODE_READY_TIMEOUT_S
    while not ready():
        if time.monotonic() > deadline:
            raise ClusterError(f"node {NODE_NAME} not Ready after {NODE_READY_TIMEOUT_S:.0f} s; its log is {layout.node_log}")
        time.sleep(0.3)


def down(name: str, say: Say) -> bool:
    """Remove the cluster whatever state it is in; -> whether there was one."""
    layout = layout_of(name)
    if not layout.root.exists():
        say(f"no cluster {name} here ({layout.root} does not exist)")
        return False
    t0 = time.monotonic()
    state = ClusterState.from_json(layout.state_file.read_text()) if layout.state_file.exists() else None
    pid = _node_pid(layout)
    if pid is not None:
        say(f"stopping node {NODE_NAME} and its pods ...")
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + NODE_STOP_TIMEOUT_S
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
    if state is not None:
        try:
            tools = Tools.find()
        except ToolsMissing:
            tools = None
        if tools is not None:
            say("deleting the control plane ...")
            KubeCluster(name=state.kwok_name, tools=tools, workdir=layout.control_plane, nodes=()).stop()
    stopped = _terminate(lambda: _pids_mentioning(layout.root))
    removed_net = netns.teardown(state.tag if state else tag_for(layout.root))
    shutil.rmtree(layout.root, ignore_errors=True)
    left = leftovers(name)
    if left:
        raise ClusterError(f"cluster {name}: left behind after down: {', '.join(left)}")
    extra = f"; stopped {len(stopped)} leftover processes" if stopped else ""
    say(f"cluster {name} removed in {time.monotonic() - t0:.0f} s (processes, pod network"
        f"{' ' + ', '.join(removed_net) if removed_net else ''}, {layout.root}){extra}")
    return True


def leftovers(name: str) -> list[str]:
    """What of the cluster still exists on this machine: processes, namespaces, interfaces, mounts, files."""
    layout = layout_of(name)
    tag = tag_for(layout.root)
    left = [f"process {p}" for p in _pids_mentioning(layout.root)]
    left += [f"netns {n}" for n in netns.namespaces_of(tag)]
    left += [f"link {n}" for n in netns.links_of(tag)]
    try:
        mounts = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        mounts = []
    left += [f"mount {m.split()[4]}" for m in mounts if str(layout.root) in m.split()[4]]
    if layout.root.exists():
        left.append(f"directory {layout.root}")
    return left


def status(name: str, say: Say) -> bool:
    layout = layout_of(name)
    if not layout.state_file.exists():
        say(f"cluster {name}: not created (specdeploy cluster up)")
        return False
    state = ClusterState.from_json(layout.state_file.read_text())
    if not is_running(layout):
        say(f"cluster {name}: stopped or crashed (node process {'alive' if _node_pid(layout) else 'gone'}); "
            "`specdeploy cluster down` cleans up, `up` starts it again")
        return False
    tools = Tools.find()
    nodes = _kubectl(tools, layout, "get", "nodes", "-o", "wide").stdout.strip()
    pods = _kubectl(tools, layout, "get", "pods", "-A", "--no-headers").stdout.strip().splitlines()
    say(f"cluster {name}: running, Kubernetes {tools.kube_version} at https://127.0.0.1:{state.apiserver_port}; "
        f"pod network {state.subnet or 'loopback'}; {len(pods)} pods")
    say(nodes)
    say(layout.export_line())
    return True


# ---- the node process ----------------------------------------------------------------------

def run_node(root: Path) -> int:
    """`specdeploy cluster node --dir ROOT`: the local node until SIGTERM."""
    from .kubelet import LocalKubelet

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # every probe would be a line
    layout = Layout(root)
    state = ClusterState.from_json(layout.state_file.read_text())
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    network = None
    if state.network == "netns":
        network = netns.NamespaceNetwork(state.tag, ipaddress.ip_network(state.subnet)).setup()
    pki_dir = layout.control_plane / "clusters" / state.kwok_name / "pki"
    kubelet = LocalKubelet(
        SimpleNamespace(kubeconfig=layout.kubeconfig, pki_dir=pki_dir), layout.node_dir, node_name=NODE_NAME,
        image_paths=state.image_paths, path=state.path, network=network, entrypoints=state.entrypoints,
        cpu=str(max(os.cpu_count() or 1, MIN_NODE_CPUS)), memory=f"{_memory_gib()}Gi",
        kubelet_port=10250 if network else 0,
    )
    try:
        kubelet.start()
        layout.node_pid.write_text(str(os.getpid()))
        log.info("node %s ready: pods on %s", NODE_NAME, state.subnet or "loopback")
        stop.wait()
        log.info("node %s stopping", NODE_NAME)
    finally:
        kubelet.stop()
        netns.teardown(state.tag)
    return 0


def _memory_gib() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return max(1, int(line.split()[1]) // (1024 * 1024))
    except OSError:
        pass
    return 8


__all__ = ["ClusterError", "down", "is_running", "layout_of", "leftovers", "run_node", "status", "up", "wait_for"]
