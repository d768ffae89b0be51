"""A disaggregated SpecDecodeDeployment (spec.disaggregation) on the real control plane: the
operator plans each engine role, applies prefill and decode Deployments (each `engine serve
--role` with its own plan), the router and the Services, reports every role in status, and
goes back to one engine Deployment when spec.disaggregation is removed."""

from __future__ import annotations

import json

from testcluster import wait_for

SPLIT = {"prefill": {"replicas": 1}, "decode": {"replicas": 2}, "router": {"replicas": 1}}


def test_disaggregated_resource_reconciles_and_reverts(kube_cluster, kube_namespace, operator, hub_secret,
                                                        manifest, sdd_of):
    body = manifest("split", target={"model": "meta-llama/Llama-3.1-8B-Instruct"},
                    draft={"model": "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B"}, replicas=1,
                    disaggregation=SPLIT)
    kube_cluster.apply(body, namespace=kube_namespace)
    sdd = sdd_of("split")
    st = sdd.wait_ready(timeout_s=90)

    deployments = {d["metadata"]["name"]: d for d in sdd.owned("deployments")}
    assert set(deployments) == {"split-prefill", "split-decode", "split-router"}
    (router,) = sdd.items("deployments", "-l", "app.kubernetes.io/name=specdeploy-router")
    assert router["spec"]["template"]["spec"]["containers"][0]["command"] == ["specdeploy", "router"]
    for role, replicas in (("prefill", 1), ("decode", 2)):
        d = deployments[f"split-{role}"]
        assert d["spec"]["replicas"] == replicas
        args = d["spec"]["template"]["spec"]["containers"][0]["args"]
        assert args[args.index("--role") + 1] == role
        assert st["disaggregation"][role]["readyReplicas"] == replicas
        assert st["disaggregation"][role]["deployment"] == f"split-{role}"
    assert st["disaggregation"]["router"]["readyReplicas"] == 1
    plans = {c["metadata"]["name"]: json.loads(c["data"]["plan.json"]) for c in sdd.owned("configmaps")
             if c["metadata"]["name"] in ("split-prefill-engine", "split-decode-engine")}
    assert plans["split-prefill-engine"]["role"] == "prefill"
    assert plans["split-prefill-engine"]["memory_per_gpu"]["cuda_graph_pool_bytes"] == 0
    assert plans["split-decode-engine"]["role"] == "decode"
    assert st["plan"]["role"] == "decode" and st["plan"]["maxTotalTokens"] == plans["split-decode-engine"]["max_total_tokens"]
    assert st["disaggregation"]["prefill"]["maxTotalTokens"] == plans["split-prefill-engine"]["max_total_tokens"]
    services = {s["metadata"]["name"]: s for s in sdd.items("services")}
    assert services["split"]["spec"]["selector"] == {"app.kubernetes.io/name": "specdeploy-router",
                                                     "app.kubernetes.io/instance": "split"}
    assert services["split-prefill"]["spec"]["clusterIP"] == "None"
    assert services["split-decode"]["spec"]["clusterIP"] == "None"
    running = [p for p in sdd.items("pods", "-l", "app.kubernetes.io/instance=split") if p["status"].get("phase") == "Running"]
    assert len(running) == 4  # 1 prefill + 2 decode + 1 router
    assert st["serving"]["readyReplicas"] == 4

    # Back to one engine: the role children go, the Service selects the engine again.
    body["spec"].pop("disaggregation")
    kube_cluster.apply(body, namespace=kube_namespace)
    wait_for(lambda: sdd.deployment() is not None and not any(
        d["metadata"]["name"].startswith("split-") for d in sdd.items("deployments")), timeout_s=60,
        what="the aggregated engine alone")
    st = sdd.wait_ready(timeout_s=60)
    assert st["plan"]["role"] == "both" and "disaggregation" not in st
    service = sdd.items("services", "--field-selector", "metadata.name=split")[0]
    assert service["spec"]["selector"] == {"app.kubernetes.io/name": "specdeploy-engine",
                                           "app.kubernetes.io/instance": "split"}
    assert not [s for s in sdd.items("services") if s["metadata"]["name"].startswith("split-")]
