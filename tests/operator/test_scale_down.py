"""Scaling through the resource's scale subresource, with real engine pods and nothing lost.

manifests/examples/tiny-cpu-demo.yaml at two replicas, both run for real by a LocalKubelet. A
client sends a bounded load to the ready endpoints of the resource's Service (its pods that are
Ready and not terminating, as the endpoints controller picks them); meanwhile the resource is scaled
through /scale, the endpoint an autoscaler writes (`kubectl scale` calls the same): up to three,
then down to one. Every request is answered, and the pods that go drain: the engine exits 0
after its SIGTERM drain, having finished what it had."""

from __future__ import annotations


import yaml
from demo_pair import TINY_CPU_DEMO
from load import Load
from testcluster import wait_for

def test_scale_up_and_down_through_the_scale_subresource_loses_nothing(
    kube_cluster, kube_namespace, local_kubelet, operator_process, sdd_of, demo_pair, capsys,
):
    operator_process(metrics_interval_s=0)
    resource = yaml.safe_load(TINY_CPU_DEMO.read_text())
    resource["spec"]["replicas"] = 2
    kube_cluster.apply(resource, namespace=kube_namespace)
    sdd = sdd_of("tiny-cpu-demo")
    wait_for(lambda: sdd.status().get("phase") == "Ready" and sdd.status()["serving"]["readyReplicas"] == 2,
             timeout_s=240, what="2 replicas Ready")
    (budget,) = sdd.owned("poddisruptionbudgets")
    assert budget["spec"]["maxUnavailable"] == 1

    def scale(replicas: int) -> None:
        kube_cluster.kubectl("scale", "sdd", "tiny-cpu-demo", "-n", kube_namespace, f"--replicas={replicas}")

    model = str(demo_pair / "target")
    (service,) = sdd.owned("services")
    with Load(kube_cluster, kube_namespace, service["spec"]["selector"], model) as load:
        wait_for(lambda: len(load.results) >= 6, timeout_s=120, what="requests before scaling")
        scale(3)
        wait_for(lambda: sdd.status()["serving"].get("readyReplicas") == 3, timeout_s=240, what="3 replicas Ready")
        first = {r.name: r for r in local_kubelet.running(kube_namespace)}
        served_by = wait_for(lambda: len({ip for ip, _ in load.results}) == 3 and {ip for ip, _ in load.results},
                             timeout_s=120, what="all three replicas serving")
        assert len(served_by) == 3
        before = len(load.results)
        scale(1)
        wait_for(lambda: len(local_kubelet.running(kube_namespace)) == 1 and sdd.status()["serving"].get("replicas") == 1,
                 timeout_s=240, what="down to one replica")
        wait_for(lambda: len(load.results) >= before + 6, timeout_s=120, what="requests after scaling down")

    failures = [r for r in load.results if r[1] != 200]
    with capsys.disabled():
        print(f"\nscale 2 -> 3 -> 1 under load: {len(load.results)} requests, {len(failures)} not answered;"
              f" {before} before the scale-down, {len(load.results) - before} during and after it")
    assert not failures, f"{len(failures)} of {len(load.results)} requests not answered: {failures[:10]}"
    # The removed pods' engines drained: SIGTERM, their requests finished, exit 0.
    (kept,) = local_kubelet.running(kube_namespace)
    removed = [r for name, r in first.items() if name != kept.name]
    assert len(removed) == 2
    for runner in removed:
        runner.join(150)  # preStop, SIGTERM, the drain
        assert not runner.is_alive()
        (engine,) = runner.containers
        assert engine.proc is not None and engine.proc.returncode == 0, (runner.name, engine.proc and engine.proc.returncode)
    assert sdd.get()["spec"]["replicas"] == 1 and sdd.status()["phase"] == "Ready"
