"""A replica across two nodes, run for real: the LeaderWorkerSet controller v0.9.0 (built from its
Go module by hack/build-lws.sh; its webhooks served to the API server with a real certificate,
tests/support/lws_controller.py) turns the operator's LeaderWorkerSet into a leader and a worker
pod, two local kubelets run them as processes on two nodes, and the tiny demo pair at 2 nodes x 1
rank (gloo) answers through the leader equal to one process, token for token. A worker killed:
the group is recreated and serves again; the resource's status follows the group's readiness.

The test cluster has no DNS: the pods resolve `<leader>.<lws>.<namespace>` from a hosts file the
test keeps from the pods' hostname, subdomain and IP (tests/support/cluster_dns), as cluster DNS
would answer for the group's headless Service."""

from __future__ import annotations

import copy
import os
import shutil
import sys
import tempfile
import threading
from pathlib import Path

import httpx
import pytest
import yaml
from lws_controller import ClusterHosts, LwsController
from testcluster import wait_for
from specdeploy.localcluster.kubelet import LocalKubelet

REPO = Path(__file__).resolve().parents[2]
SUPPORT = REPO / "tests" / "support"
IMAGE_DEMO_DIR = "/opt/specdeploy/demo"
PROMPT = "def fibonacci(n):"


@pytest.fixture
def lws_controller(kube_cluster, tmp_path):
    controller = LwsController(kube_cluster, tmp_path / "lws").start()
    yield controller
    controller.stop()


@pytest.fixture
def two_nodes(kube_cluster, demo_pair, tmp_path):  # noqa: F811
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    kubelets = [LocalKubelet(kube_cluster, tmp_path / f"kubelet-{i}", node_name=f"local-{i}",
                             image_paths={IMAGE_DEMO_DIR: demo_pair}, path=path).start() for i in range(2)]
    core = kubelets[0].core
    others = [n.metadata.name for n in core.list_node().items
              if not n.metadata.name.startswith("local-") and not n.spec.unschedulable]
    for name in others:
        core.patch_node(name, {"spec": {"unschedulable": True}})
    try:
        yield kubelets
    finally:
        for name in others:
            core.patch_node(name, {"spec": {"unschedulable": False}})
        for kubelet in kubelets:
            kubelet.stop()


class HostsRefresher:
    def __init__(self, hosts: ClusterHosts) -> None:
        self.hosts, self.done = hosts, threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.done.wait(0.3):
            try:
                self.hosts.poll()
            except Exception:  # noqa: BLE001 - the next round tries again
                pass

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.done.set()
        self.thread.join(10)


def complete(ip: str) -> dict:
    # The model's name is its path as the pod sees it (the kubelet maps the image's paths).
    model = httpx.get(f"http://{ip}:8000/v1/models", timeout=30).json()["data"][0]["id"]
    r = httpx.post(f"http://{ip}:8000/v1/completions", timeout=120,
                   json={"model": model, "prompt": PROMPT, "max_tokens": 24, "temperature": 0})
    r.raise_for_status()
    return r.json()


def leader_and_worker(kube_cluster, namespace: str, name: str) -> tuple[dict, dict] | None:
    pods = kube_cluster.kubectl_json("get", "pods", "-n", namespace, "-l", f"leaderworkerset.sigs.k8s.io/name={name}")
    live = [p for p in pods["items"] if not p["metadata"].get("deletionTimestamp")]
    by_index = {p["metadata"]["labels"].get("leaderworkerset.sigs.k8s.io/worker-index"): p for p in live}
    if set(by_index) != {"0", "1"}:
        return None
    return by_index["0"], by_index["1"]


def test_two_nodes_serve_as_one_and_recover_from_a_worker_kill(
    kube_cluster, kube_namespace, lws_controller, two_nodes, operator, sdd_of, example, demo_pair, request,  # noqa: F811
):
    from specdeploy.engine.serving.cli import ServerThread, free_port

    # One process, the same pair: what the group must answer.
    reference = ServerThread(["engine", "serve", "--target", str(demo_pair / "target"), "--draft",
                              str(demo_pair / "draft"), "--algorithm", "EAGLE", "--num-steps", "3", "--topk", "1",
                              "--num-draft-tokens", "4", "--dtype", "float32", "--context-length", "1024",
                              "--max-running-requests", "4", "--served-model-name", IMAGE_DEMO_DIR + "/target",
                              "--host", "127.0.0.1", "--port", str(free_port())]).start(timeout_s=240)
    try:
        want = httpx.post(f"{reference.base_url}/v1/completions", timeout=120,
                          json={"model": IMAGE_DEMO_DIR + "/target", "prompt": PROMPT, "max_tokens": 24,
                                "temperature": 0}).json()
    finally:
        reference.stop()

    # Not under /tmp: the engine pod has a /tmp volume of its own (a read-only root), and the local
    # kubelet maps paths under a pod volume into it, so the pods would look there for the hosts
    # file and for the DNS shim (a checkout under /tmp, as CI's is, included).
    hosts_dir = Path(tempfile.mkdtemp(prefix="sdd-hosts-", dir="/var/tmp"))
    request.addfinalizer(lambda: shutil.rmtree(hosts_dir, ignore_errors=True))
    dns_shim = shutil.copytree(SUPPORT / "cluster_dns", hosts_dir / "cluster_dns")
    hosts = ClusterHosts(kube_cluster, kube_namespace, hosts_dir / "hosts.json")
    sdd_manifest = copy.deepcopy(example)
    spec = sdd_manifest["spec"]
    spec["cpu"]["nodes"] = 2
    spec["engine"]["resources"] = {"requests": {"cpu": "1", "memory": "2Gi"}}
    spec["engine"]["env"] = [
        {"name": "PYTHONPATH", "value": os.pathsep.join([str(dns_shim), os.environ.get("PYTHONPATH", "")])},
        {"name": "SPECDEPLOY_TEST_HOSTS", "value": str(hosts.path)},
        {"name": "OMP_NUM_THREADS", "value": "1"},
    ]
    name = sdd_manifest["metadata"]["name"]
    with HostsRefresher(hosts):
        kube_cluster.apply(yaml.safe_dump(sdd_manifest), namespace=kube_namespace)
        sdd = sdd_of(name)
        st = sdd.wait_ready(timeout_s=300)
        assert st["plan"]["nodes"] == 2 and st["plan"]["tensorParallelSize"] == 2
        assert st["serving"]["readyReplicas"] == 1
        leader, worker = leader_and_worker(kube_cluster, kube_namespace, name)
        assert {leader["spec"]["nodeName"], worker["spec"]["nodeName"]} == {"local-0", "local-1"}
        # The Service selects the leader alone.
        service = kube_cluster.kubectl_json("get", "service", name, "-n", kube_namespace)
        selector = ",".join(f"{k}={v}" for k, v in service["spec"]["selector"].items())
        selected = kube_cluster.kubectl_json("get", "pods", "-n", kube_namespace, "-l", selector)["items"]
        assert [p["metadata"]["uid"] for p in selected] == [leader["metadata"]["uid"]]

        got = complete(leader["status"]["podIP"])
        assert got["choices"][0]["text"] == want["choices"][0]["text"]
        assert got["usage"]["completion_tokens"] == want["usage"]["completion_tokens"]

        # A worker killed: the leader stops, LWS recreates the group, and it serves again.
        kubelet = next(k for k in two_nodes if k.node_name == worker["spec"]["nodeName"])
        kubelet.runner(kube_namespace, worker["metadata"]["name"]).kill()
        old = {leader["metadata"]["uid"], worker["metadata"]["uid"]}
        wait_for(lambda: sdd.condition("Ready").get("status") == "False", timeout_s=120, what="group not ready")
        pair = wait_for(lambda: (p := leader_and_worker(kube_cluster, kube_namespace, name))
                        and not ({p[0]["metadata"]["uid"], p[1]["metadata"]["uid"]} & old) and p,
                        timeout_s=180, what="a recreated group")
        st = sdd.wait_ready(timeout_s=300)
        assert st["serving"]["readyReplicas"] == 1
        leader = leader_and_worker(kube_cluster, kube_namespace, name)[0]
        assert leader["metadata"]["uid"] == pair[0]["metadata"]["uid"]
        again = complete(leader["status"]["podIP"])
        assert again["choices"][0]["text"] == want["choices"][0]["text"]
