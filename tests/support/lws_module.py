"""LeaderWorkerSet v0.9.0 as the Go module sigs.k8s.io/lws publishes it: its CRD, read from the
Go module cache (`go mod download` fills it once; nothing of LWS is copied into this repository)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

LWS_MODULE = "sigs.k8s.io/lws"
VERSIONS = Path(__file__).resolve().parents[2] / "hack" / "tools-versions.env"
# The version hack/build-lws.sh builds the controller of (one home: hack/tools-versions.env).
LWS_VERSION = dict(line.split("=", 1) for line in VERSIONS.read_text().splitlines()
                   if line and not line.startswith("#"))["LWS_VERSION"]
CRD_FILE = "config/crd/bases/leaderworkerset.x-k8s.io_leaderworkersets.yaml"
# The controller also serves DisaggregatedSets: without their CRD its manager stops after two
# minutes of waiting for that cache ("timed out waiting for cache to be synced").
DISAGGREGATED_SET_CRD_FILE = "config/crd/bases/disaggregatedset.x-k8s.io_disaggregatedsets.yaml"
DISAGGREGATED_SET_CRD_NAME = "disaggregatedsets.disaggregatedset.x-k8s.io"


def module_dir() -> Path:
    """The module's source in the Go module cache, downloaded on first use."""
    if shutil.which("go") is None:
        raise RuntimeError("the LeaderWorkerSet CRD is read from the Go module cache: install Go >= 1.26")
    out = subprocess.run(["go", "mod", "download", "-json", f"{LWS_MODULE}@{LWS_VERSION}"],
                         capture_output=True, text=True, timeout=600, cwd="/")
    info = json.loads(out.stdout or "{}")
    if out.returncode != 0 or "Dir" not in info:
        raise RuntimeError(f"go mod download {LWS_MODULE}@{LWS_VERSION} failed: {info.get('Error') or out.stderr.strip()}")
    return Path(info["Dir"])


def crd_path() -> Path:
    return module_dir() / CRD_FILE


CRD_NAME = "leaderworkersets.leaderworkerset.x-k8s.io"


def install_crd(cluster) -> None:
    """Apply the CRD to the test cluster and wait until its API is served."""
    from testcluster import wait_for

    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(crd_path()))
    wait_for(lambda: "True" in cluster.kubectl(
        "get", "crd", CRD_NAME, "-o", "jsonpath={.status.conditions[?(@.type=='Established')].status}").stdout,
        timeout_s=60, what="LWS CRD established")
    wait_for(lambda: cluster.kubectl("get", "lws", "-A", check=False).returncode == 0,
             timeout_s=30, what="lws storage")


def uninstall_crd(cluster) -> None:
    """Delete the CRD (and every LeaderWorkerSet with it) and wait until its API is gone."""
    from testcluster import wait_for

    cluster.kubectl("delete", "crd", CRD_NAME, "--ignore-not-found", "--wait=true", "--timeout=60s")
    wait_for(lambda: cluster.kubectl("get", "--raw", "/apis/leaderworkerset.x-k8s.io/v1", check=False).returncode != 0,
             timeout_s=60, what="LWS API gone")
