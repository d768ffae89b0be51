"""pytest fixtures for the test cluster; loaded for every test folder by tests/conftest.py."""

from __future__ import annotations

import atexit
import logging
import signal
import threading
import time
import uuid
from typing import Iterator

import pytest

from specdeploy.localcluster.controlplane import KubeCluster
from specdeploy.localcluster.tools import Tools, ToolsMissing

log = logging.getLogger("specdeploy.tests.cluster")
# The HPA controller's pass every 2 s instead of 15 s, so tests/operator/test_hpa_loop.py sees it
# scale within seconds of the metric changing.
HPA_SYNC_PERIOD_S = 2


def _report(config: pytest.Config, message: str) -> None:
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(f"[kube_cluster] {message}")
    log.info(message)


def _sigterm_as_interrupt():
    """Make SIGTERM (CI timeouts, `kill`) interrupt pytest like Ctrl-C, so fixture teardown still
    runs and the cluster is deleted; by default SIGTERM ends Python without any cleanup."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return lambda: None

    def on_sigterm(signum, frame):
        raise KeyboardInterrupt("SIGTERM")

    signal.signal(signal.SIGTERM, on_sigterm)
    return lambda: signal.signal(signal.SIGTERM, signal.SIG_DFL)


@pytest.fixture(scope="session")
def kube_tools() -> Tools:
    """Paths of the cached binaries; fails (never skips) with a `make tools` hint when missing."""
    try:
        return Tools.find()
    except ToolsMissing as exc:
        missing = str(exc)
    pytest.fail(missing, pytrace=False)


@pytest.fixture(scope="session")
def kube_cluster(request: pytest.FixtureRequest, kube_tools: Tools) -> Iterator[KubeCluster]:
    """One throwaway cluster for the whole test session, torn down at its end (also on failure)."""
    _report(request.config, f"starting a kwok cluster from {kube_tools.kube_apiserver.parent.parent}")
    restore_sigterm = _sigterm_as_interrupt()
    t0 = time.monotonic()
    cluster = KubeCluster.start(kube_tools, hpa_sync_period_s=HPA_SYNC_PERIOD_S)
    # Belt and braces: if the session dies before fixture teardown runs, stop at interpreter exit.
    # (A SIGKILLed session leaves its cluster running; the next KubeCluster.start reaps it.)
    atexit.register(cluster.stop)
    _report(
        request.config,
        f"cluster {cluster.name} ({kube_tools.kube_version}) up in {time.monotonic() - t0:.1f}s at {cluster.server}; "
        f"nodes: {', '.join(n.name for n in cluster.nodes)}",
    )
    try:
        yield cluster
    finally:
        t1 = time.monotonic()
        cluster.stop()
        atexit.unregister(cluster.stop)
        restore_sigterm()
        _report(request.config, f"cluster {cluster.name} deleted in {time.monotonic() - t1:.1f}s")


@pytest.fixture(scope="session")
def kube_client(kube_cluster: KubeCluster):
    """A kubernetes python `ApiClient` for the session cluster."""
    client = kube_cluster.api_client()
    yield client
    client.close()


@pytest.fixture
def kube_namespace(request: pytest.FixtureRequest, kube_cluster: KubeCluster) -> Iterator[str]:
    """A fresh namespace for one test (its `default` ServiceAccount exists), deleted afterwards."""
    base = "".join(c if c.isalnum() else "-" for c in request.node.name.lower())[:40].strip("-")
    name = f"{base}-{uuid.uuid4().hex[:5]}"
    kube_cluster.kubectl("create", "namespace", name)
    kube_cluster.wait_for_default_service_account(name)
    yield name
    # Deletion finishes in the background (the namespace controller empties it); no test waits for it.
    kube_cluster.kubectl("delete", "namespace", name, "--wait=false", "--ignore-not-found", check=False)
