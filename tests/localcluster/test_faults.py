"""`specdeploy cluster` under bad input and faults, on one cluster of its own (a free port, its own
name): `up` twice, a port in use, the kubelet API's logs (--tail, -f, --previous) and its refusal of
anyone but the apiserver, a crash-looping pod (CrashLoopBackOff, its exit code, the doubling
back-off), the node process SIGKILLed (its containers die with it, the node goes NotReady and its
pods unready; nothing hangs), and `down` after that crash removing everything."""

from __future__ import annotations

import json
import os
import signal
import socket
import ssl
import subprocess
import time
from datetime import datetime
from pathlib import Path

import pytest
import yaml
from local_cluster_cli import leftovers, specdeploy  # tests/support
from testcluster import wait_for

from specdeploy.localcluster.cluster import _alive

NAME = "faults"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def up(cluster_env):
    port = _free_port()
    result = specdeploy(cluster_env, "cluster", "up", "--name", NAME, "--port", str(port))
    assert result.returncode == 0, result.stderr
    env = dict(cluster_env)
    export = result.stdout.strip().splitlines()[-1]
    kubeconfig, path = export.removeprefix("export KUBECONFIG=").split(" PATH=")
    env.update(KUBECONFIG=kubeconfig, PATH=path.replace("$PATH", env["PATH"]))
    try:
        yield env, port
    finally:
        specdeploy(cluster_env, "cluster", "down", "--name", NAME)


def kubectl(env, *args: str, check: bool = True, timeout_s: float = 60, input: str | None = None) -> str:
    result = subprocess.run(["kubectl", *args], env=env, capture_output=True, text=True, timeout=timeout_s, input=input)
    if check:
        assert result.returncode == 0, f"kubectl {' '.join(args)}: {result.stderr}"
    return result.stdout


def pod_of(env, app: str) -> dict:
    return wait_for(lambda: (items := json.loads(kubectl(env, "get", "pods", "-l", f"app={app}", "-o", "json"))["items"])
                    and items[0], timeout_s=30, what=f"the pod of {app}")


def deployment(app: str, script: str) -> str:
    return yaml.safe_dump({
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": app},
        "spec": {"replicas": 1, "selector": {"matchLabels": {"app": app}}, "template": {
            "metadata": {"labels": {"app": app}},
            "spec": {"terminationGracePeriodSeconds": 2,
                     "containers": [{"name": app, "image": "python", "command": ["python3", "-u", "-c", script]}]}}},
    })


def test_up_twice_and_a_port_in_use_are_one_line_each(up, cluster_env):
    env, port = up
    again = specdeploy(cluster_env, "cluster", "up", "--name", NAME, "--port", str(port))
    assert again.returncode == 0 and f"cluster {NAME} is already running" in again.stdout
    other = specdeploy(cluster_env, "cluster", "up", "--name", "other", "--port", str(port))
    assert other.returncode == 2 and other.stdout == ""
    assert other.stderr.strip().splitlines() == [
        f"specdeploy cluster up: port {port} (kube-apiserver) is already in use on 127.0.0.1: stop what holds it or pass --port"]
    assert not (Path(cluster_env["XDG_STATE_HOME"]) / "specdeploy" / "clusters" / "other").exists()
    status = specdeploy(cluster_env, "cluster", "status", "--name", NAME)
    assert status.returncode == 0 and "running" in status.stdout and "local-0   Ready" in status.stdout


def test_logs_tail_follow_and_only_the_apiserver_may_ask(up):
    env, _ = up
    kubectl(env, "apply", "-f", "-", input=deployment(
        "ticker", "import time\nfor i in range(10**6):\n    print(f'tick {i}'); time.sleep(0.2)"))
    pod = pod_of(env, "ticker")["metadata"]["name"]
    wait_for(lambda: "tick 5" in kubectl(env, "logs", pod, check=False), timeout_s=60, what="the ticker's log")
    assert kubectl(env, "logs", pod, "--tail=2").strip().count("\n") == 1
    follow = subprocess.Popen(["kubectl", "logs", "-f", "--tail=1", pod], env=env, stdout=subprocess.PIPE, text=True)
    try:
        first = int(follow.stdout.readline().split()[1])
        lines = [follow.stdout.readline() for _ in range(3)]  # new lines keep coming
        assert [int(line.split()[1]) for line in lines] == [first + 1, first + 2, first + 3]
    finally:
        follow.terminate()
        follow.wait(10)
    # The kubelet API itself: TLS with a client certificate from the cluster CA that is the
    # apiserver's; a client without one is refused at the handshake.
    node = json.loads(kubectl(env, "get", "node", "local-0", "-o", "json"))
    address = node["status"]["addresses"][0]["address"]
    port = node["status"]["daemonEndpoints"]["kubeletEndpoint"]["Port"]
    context = ssl.create_default_context()
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    with pytest.raises((ssl.SSLError, ConnectionResetError, BrokenPipeError)):
        with socket.create_connection((address, port), timeout=5) as raw, context.wrap_socket(raw) as tls:
            tls.sendall(b"GET /containerLogs/default/x/y HTTP/1.1\r\nHost: x\r\n\r\n")
            if not tls.recv(100):
                raise ConnectionResetError("closed")
    kubectl(env, "delete", "deployment", "ticker", "--wait=false")


def test_a_failing_command_crash_loops_with_its_exit_code_and_back_off(up):
    env, _ = up
    kubectl(env, "apply", "-f", "-", input=deployment("crasher", "import sys; print('about to fail'); sys.exit(3)"))
    pod = pod_of(env, "crasher")["metadata"]["name"]

    def status():
        return json.loads(kubectl(env, "get", "pod", pod, "-o", "json"))["status"]["containerStatuses"][0]

    first = wait_for(lambda: (s := status())["restartCount"] >= 1 and "waiting" in s["state"] and s, timeout_s=60,
                     what="the first restart")
    assert first["state"]["waiting"]["reason"] == "CrashLoopBackOff"
    assert "last exit code 3" in first["state"]["waiting"]["message"]
    assert first["lastState"]["terminated"]["exitCode"] == 3
    assert "CrashLoopBackOff" in kubectl(env, "get", "pod", pod)
    assert kubectl(env, "logs", pod, "--previous").strip() == "about to fail"
    # The back-off: 10 s before the second start, then 20 s.
    second = wait_for(lambda: (s := status())["restartCount"] >= 2 and s, timeout_s=60, interval_s=0.5,
                      what="the second restart")
    t1 = datetime.fromisoformat(first["lastState"]["terminated"]["finishedAt"].replace("Z", "+00:00"))
    t2 = datetime.fromisoformat(second["lastState"]["terminated"]["startedAt"].replace("Z", "+00:00"))
    assert (t2 - t1).total_seconds() >= 9
    assert "back-off 20s" in second["state"].get("waiting", {}).get("message", "back-off 20s")
    kubectl(env, "delete", "deployment", "crasher", "--wait=false")


def test_killing_the_node_fails_its_pods_and_down_still_cleans_up(up, cluster_env):
    env, _ = up
    kubectl(env, "apply", "-f", "-", input=deployment("sleeper", "import time; print('up', flush=True); time.sleep(3600)"))
    pod = wait_for(lambda: (p := pod_of(env, "sleeper"))["status"].get("phase") == "Running" and p, timeout_s=60,
                   what="the sleeper Running")
    pid = int(pod["status"]["containerStatuses"][0]["containerID"].removeprefix("local://"))
    state_dir = Path(cluster_env["XDG_STATE_HOME"]) / "specdeploy" / "clusters" / NAME
    node_pid = int((state_dir / "node.pid").read_text())
    os.kill(node_pid, signal.SIGKILL)
    # Its containers die with it (parent-death signal), as on a machine that lost power ...
    wait_for(lambda: not _alive(pid), timeout_s=10, what="the container to die with the node")
    # ... and the node lifecycle controller marks the node NotReady and its pods unready.
    t0 = time.monotonic()
    wait_for(lambda: "NotReady" in kubectl(env, "get", "node", "local-0", check=False), timeout_s=60, interval_s=1,
             what="the node NotReady")
    ready = wait_for(lambda: [c for c in json.loads(kubectl(env, "get", "pod", pod["metadata"]["name"], "-o", "json"))
                              ["status"]["conditions"] if c["type"] == "Ready" and c["status"] == "False"],
                     timeout_s=30, what="the pod unready")
    assert ready and time.monotonic() - t0 < 60
    status = specdeploy(cluster_env, "cluster", "status", "--name", NAME)
    assert status.returncode == 3 and "stopped or crashed" in status.stdout
    # `down` after the crash: the control plane, the namespaces, the directory; nothing left.
    down = specdeploy(cluster_env, "cluster", "down", "--name", NAME, timeout_s=120)
    assert down.returncode == 0 and f"cluster {NAME} removed" in down.stdout, down.stderr
    assert leftovers(cluster_env, NAME) == [] and not state_dir.exists()
    again = specdeploy(cluster_env, "cluster", "down", "--name", NAME)
    assert again.returncode == 0 and "no cluster faults here" in again.stdout
