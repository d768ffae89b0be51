"""The cluster is torn down whatever happens to the test session that started it.

Each test runs a small pytest session in a subprocess that uses `kube_cluster`, then checks from the
outside that no process of that cluster is left, no port stays bound and its directory is gone.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from testcluster import wait_for
from specdeploy.localcluster.controlplane import _pids_mentioning, listening_ports, reap_orphans

CLUSTER_PKG_DIR = Path(__file__).resolve().parent

INNER_TEST = textwrap.dedent(
    """
    import json, os, time

    def test_inner(kube_cluster):
        info = {"workdir": str(kube_cluster.workdir), "ports": kube_cluster.ports}
        with open(os.environ["CLUSTER_INFO"], "w") as f:
            json.dump(info, f)
        assert kube_cluster.kubectl("get", "nodes").returncode == 0
        if os.environ["INNER_MODE"] == "fail":
            assert False, "this test fails on purpose"
        time.sleep(120)  # killed from outside
    """
)


def _start_inner_session(tmp_path: Path, mode: str) -> tuple[subprocess.Popen, Path]:
    (tmp_path / "test_inner.py").write_text(INNER_TEST)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    info = tmp_path / "cluster.json"
    pythonpath = os.pathsep.join(filter(None, [str(CLUSTER_PKG_DIR), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, PYTHONPATH=pythonpath, CLUSTER_INFO=str(info), INNER_MODE=mode)
    proc = subprocess.Popen(
        [sys.executable, "-P", "-m", "pytest", "-q", "-p", "testcluster.plugin", "-p", "no:cacheprovider",
         "-c", str(tmp_path / "pytest.ini"), "--rootdir", str(tmp_path), str(tmp_path / "test_inner.py")],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    return proc, info


def _wait_for_cluster(proc: subprocess.Popen, info: Path) -> dict:
    def ready():
        if proc.poll() is not None:
            raise AssertionError(f"inner session exited early ({proc.returncode}):\n{proc.stdout.read()}")
        return json.loads(info.read_text()) if info.exists() and info.stat().st_size else None

    return wait_for(ready, timeout_s=90, what="the inner session's cluster")


def _assert_gone(cluster: dict) -> None:
    workdir = Path(cluster["workdir"])
    assert _pids_mentioning(workdir) == [], "cluster processes left behind"
    listening = listening_ports()
    bound = [p for p in cluster["ports"] if p in listening]
    if bound:
        ss = subprocess.run(["ss", "-ltnp"], capture_output=True, text=True).stdout
        owners = "\n".join(line for line in ss.splitlines() if any(f":{p} " in line for p in bound))
        raise AssertionError(f"cluster ports still bound: {bound}\n{owners}")
    assert not workdir.exists(), f"{workdir} left behind"


@pytest.mark.usefixtures("kube_tools")
def test_teardown_after_a_failing_test(tmp_path: Path):
    proc, info = _start_inner_session(tmp_path, "fail")
    out, _ = proc.communicate(timeout=180)
    assert proc.returncode == 1, out
    assert "this test fails on purpose" in out
    _assert_gone(json.loads(info.read_text()))


@pytest.mark.usefixtures("kube_tools")
def test_teardown_when_the_session_is_terminated(tmp_path: Path):
    proc, info = _start_inner_session(tmp_path, "hang")
    cluster = _wait_for_cluster(proc, info)
    assert _pids_mentioning(Path(cluster["workdir"])), "the inner cluster is not running"
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode != 0, out
    _assert_gone(cluster)


@pytest.mark.usefixtures("kube_tools")
def test_a_killed_sessions_cluster_is_reaped_by_the_next_start(tmp_path: Path):
    proc, info = _start_inner_session(tmp_path, "hang")
    cluster = _wait_for_cluster(proc, info)
    proc.kill()  # SIGKILL: no teardown can run
    proc.communicate(timeout=30)
    workdir = Path(cluster["workdir"])
    assert _pids_mentioning(workdir), "expected the killed session's cluster to outlive it"
    reap_orphans(workdir.parent)
    _assert_gone(cluster)
