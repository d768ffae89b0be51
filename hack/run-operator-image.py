"""Run the built operator image against a throwaway test cluster and serve the examples.

    python3 -P hack/run-operator-image.py [IMAGE]     (default localhost/specdeploy/operator:dev)

Starts the tests' kwok cluster (tests/cluster/testcluster), installs the CRD, runs the image's own
entrypoint (`specdeploy operator`, as user 65532) from buildah's local storage with the cluster's
kubeconfig mounted and a local hub serving manifests/models/*/config.json (the examples' models;
no model hub is reachable from a build machine), applies manifests/examples/, waits for each to be
answered and prints `kubectl get sdd`. Exit 0 when every example is Ready.

The image runs under `buildah run --isolation chroot`: its file system, environment, user and
entrypoint, but no OCI runtime, which needs cgroups a build sandbox may not give (podman's crun
refuses hybrid cgroup v1/v2 hosts). Where `podman run` works, run the image with it instead.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "cluster"))

from testcluster import KubeCluster, Tools, wait_for  # noqa: E402

IMAGE = sys.argv[1] if len(sys.argv) > 1 else "localhost/specdeploy/operator:dev"
CRD = REPO / "manifests" / "crd" / "specdeploy.dev_specdecodedeployments.yaml"
EXAMPLES = sorted((REPO / "manifests" / "examples").glob("*.yaml"))
NAMESPACE = "specdeploy-image"
MODELS = REPO / "manifests" / "models"  # the shipped config.json of each example's models
HUB_TOKEN = "hf_local_token"


class ConfigHub(BaseHTTPRequestHandler):
    """GET /{org}/{name}/resolve/{revision}/config.json from manifests/models/{name, lower case}/."""

    def do_GET(self) -> None:  # noqa: N802
        parts = self.path.strip("/").split("/")
        path = MODELS / parts[1].lower() / "config.json" if len(parts) == 5 and parts[2] == "resolve" else None
        ok = path is not None and path.is_file() and self.headers.get("Authorization") in (None, f"Bearer {HUB_TOKEN}")
        body = path.read_bytes() if ok else b"not found"
        self.send_response(200 if ok else 404)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def main() -> int:
    env = {**os.environ, "STORAGE_DRIVER": os.environ.get("STORAGE_DRIVER", "vfs"),
           "BUILDAH_ISOLATION": "chroot"}
    hub = ThreadingHTTPServer(("127.0.0.1", 0), ConfigHub)
    threading.Thread(target=hub.serve_forever, daemon=True).start()
    cluster = KubeCluster.start(Tools.find())
    container = None
    proc = None
    try:
        cluster.kubectl("apply", "--server-side", "-f", str(CRD))
        cluster.kubectl("wait", "--for=condition=Established", "crd/specdecodedeployments.specdeploy.dev")
        cluster.kubectl("create", "namespace", NAMESPACE)
        cluster.wait_for_default_service_account(NAMESPACE)
        cluster.kubectl("create", "secret", "generic", "hf-token", "-n", NAMESPACE, f"--from-literal=token={HUB_TOKEN}")
        container = subprocess.run(["buildah", "from", IMAGE], env=env, capture_output=True, text=True,
                                   check=True).stdout.strip()
        # Certificates inline (the cluster's kubeconfig names files the image cannot see), readable
        # by the image's user.
        kubeconfig = cluster.workdir / "image-kubeconfig.yaml"
        kubeconfig.write_text(cluster.kubectl("config", "view", "--raw", "--flatten").stdout)
        kubeconfig.chmod(0o644)
        log = open(cluster.workdir / "operator-image.log", "wb")
        proc = subprocess.Popen(
            ["buildah", "run", "--isolation", "chroot", "--network", "host",
             "-v", f"{kubeconfig}:/etc/specdeploy-kube/config:ro", "--env", "KUBECONFIG=/etc/specdeploy-kube/config",
             container, "--", "specdeploy", "operator", "--namespace", NAMESPACE,
             "--engine-image", "localhost/specdeploy/engine:dev",
             "--hub-endpoint", f"http://127.0.0.1:{hub.server_address[1]}"],
            env=env, stdout=log, stderr=subprocess.STDOUT)
        t0 = time.monotonic()
        for example in EXAMPLES:
            cluster.kubectl("apply", "-n", NAMESPACE, "-f", str(example))
        names = [n.split("/", 1)[1] for n in cluster.kubectl("get", "sdd", "-n", NAMESPACE, "-o", "name").stdout.split()]

        def answered() -> bool:
            items = cluster.kubectl_json("get", "sdd", "-n", NAMESPACE)["items"]
            return len(items) == len(names) and all(
                (i.get("status") or {}).get("phase") in ("Ready", "Failed", "Pending") for i in items)

        wait_for(answered, timeout_s=180, interval_s=1, what="the operator image to answer every example")
        print(f"operator image {IMAGE}: every example answered in {time.monotonic() - t0:.1f} s")
        print(cluster.kubectl("get", "sdd", "-n", NAMESPACE).stdout)
        print(cluster.kubectl("get", "deployments,pods", "-n", NAMESPACE).stdout)
        assert proc.poll() is None, "the operator container exited"
        items = cluster.kubectl_json("get", "sdd", "-n", NAMESPACE)["items"]
        # Every example is meant to be served (the kwok GPU nodes hold the tensor-parallel ones).
        not_ready = [i["metadata"]["name"] for i in items if i["status"].get("phase") != "Ready"]
        print("not Ready:", not_ready or "none")
        return 1 if not_ready else 0
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
            print((cluster.workdir / "operator-image.log").read_text(errors="replace")[-3000:])
        if container:
            subprocess.run(["buildah", "rm", container], env=env, capture_output=True, check=False)
        cluster.stop()
        hub.shutdown()


if __name__ == "__main__":
    sys.exit(main())
