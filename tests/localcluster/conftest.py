"""A place of its own for every local cluster a test makes: its state directory (XDG_STATE_HOME),
the demo pair where `cluster up` looks for it (XDG_CACHE_HOME), helm's homes, and this
environment's `specdeploy` first on PATH. Pod network namespaces need root and `ip`; without
them these tests skip and say so."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import yaml

from specdeploy.localcluster import netns

REPO = Path(__file__).resolve().parents[2]
TINY_CPU_DEMO = REPO / "manifests" / "examples" / "tiny-cpu-demo.yaml"


@pytest.fixture(scope="module")
def cluster_env(tmp_path_factory, kube_tools):
    why = netns.available()
    if why:
        pytest.skip(f"the local cluster's pod network: {why}")
    from demo_pair import build_demo_pair  # tests/support/demo_pair.py

    from specdeploy.engine.demo.cli import DEMO_VERSION

    home = tmp_path_factory.mktemp("local-cluster")
    build_demo_pair(home / "cache" / "specdeploy" / "demo" / DEMO_VERSION, yaml.safe_load(TINY_CPU_DEMO.read_text()))
    env = dict(os.environ)
    env.pop("KUBECONFIG", None)
    env.update(XDG_STATE_HOME=str(home / "state"), XDG_CACHE_HOME=str(home / "cache"),
               HELM_CACHE_HOME=str(home / "helm" / "cache"), HELM_CONFIG_HOME=str(home / "helm" / "config"),
               HELM_DATA_HOME=str(home / "helm" / "data"),
               PATH=os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")]))
    yield env
    # Whatever a failed or interrupted test left running is removed with its directory.
    from local_cluster_cli import specdeploy  # tests/support

    for root in sorted((home / "state" / "specdeploy" / "clusters").glob("*")):
        specdeploy(env, "cluster", "down", "--name", root.name, timeout_s=180)

