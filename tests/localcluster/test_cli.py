"""`specdeploy cluster` without what it needs: one line and exit code 2, nothing left behind."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from local_cluster_cli import specdeploy  # tests/support


def test_up_without_go_says_what_to_install(tmp_path):
    # No cached tools, and a PATH with this Python but without Go.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("bash", "ip"):
        if shutil.which(tool):
            (bin_dir / tool).symlink_to(shutil.which(tool))
    env = dict(os.environ, SPECDEPLOY_TOOLS_DIR=str(tmp_path / "no-tools"), XDG_STATE_HOME=str(tmp_path / "state"),
               PATH=os.pathsep.join([str(Path(sys.executable).parent), str(bin_dir)]))
    assert shutil.which("go", path=env["PATH"]) is None
    result = specdeploy(env, "cluster", "up", "--port", "1")
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("specdeploy cluster up: building the Kubernetes control plane needs Go >= 1.26 on PATH")
    assert not (tmp_path / "state" / "specdeploy" / "clusters" / "local").exists()


def test_bad_names_and_missing_clusters(tmp_path):
    env = dict(os.environ, XDG_STATE_HOME=str(tmp_path / "state"))
    bad = specdeploy(env, "cluster", "up", "--name", "Bad_Name")
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [
        "specdeploy cluster up: cluster name 'Bad_Name': 1-20 lowercase letters, digits and '-', not at either end"]
    status = specdeploy(env, "cluster", "status")
    assert status.returncode == 3 and "not created" in status.stdout
    assert specdeploy(env, "cluster", "env").returncode == 2
    down = specdeploy(env, "cluster", "down")
    assert down.returncode == 0 and "no cluster local here" in down.stdout
