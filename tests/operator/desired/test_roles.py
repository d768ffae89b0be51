"""A disaggregated SpecDecodeDeployment (spec.disaggregation) rendered and its status folded
(pure, no cluster): each engine role has its own plan and ConfigMap, `engine serve --role`,
the pod IP for its transfer engine and a headless Service; the router sits under the resource's
Service; one config hash rolls all three; Ready needs every role."""

from __future__ import annotations

import json

from split_resource import DEFAULTS, by_name, config, make_sdd, planned

from specdeploy.operator.desired import roles, status
from specdeploy.operator.desired.planning import plan_engine, plan_summary


def test_each_role_is_planned_on_its_own():
    p = planned(make_sdd())
    prefill, decode = p.role_plans["prefill"], p.role_plans["decode"]
    assert prefill["role"] == "prefill" and decode["role"] == "decode" and p.plan == decode
    assert prefill["memory_per_gpu"]["cuda_graph_pool_bytes"] == 0 < decode["memory_per_gpu"]["cuda_graph_pool_bytes"]
    assert prefill["cuda_graph_batch_sizes"] == [] and decode["cuda_graph_batch_sizes"]
    assert prefill["buffers"]["metadata_hidden_states_shape"] == decode["buffers"]["metadata_hidden_states_shape"] == [32, 4096]
    assert "prefill: TP 1" in plan_summary(p) and "decode: TP 1" in plan_summary(p)


def test_children_of_a_disaggregated_resource():
    sdd = make_sdd()
    children = roles.render_roles(sdd, planned(sdd), DEFAULTS)
    deployments, services, config_maps = (by_name(children, k) for k in ("Deployment", "Service", "ConfigMap"))
    assert set(deployments) == {"llama8b-prefill", "llama8b-decode", "llama8b-router"}
    assert set(services) == {"llama8b", "llama8b-prefill", "llama8b-decode"}
    assert set(config_maps) == {"llama8b-prefill-engine", "llama8b-decode-engine"}
    assert [o["kind"] for o in children.all()] == ["ConfigMap"] * 2 + ["Deployment"] * 3 + ["Service"] * 3
    for role, replicas in (("prefill", 1), ("decode", 3)):
        d = deployments[f"llama8b-{role}"]
        assert d["spec"]["replicas"] == replicas
        pod = d["spec"]["template"]["spec"]
        (c,) = pod["containers"]
        args = c["args"]
        assert args[args.index("--role") + 1] == role and args[args.index("--transfer-host") + 1] == "$(POD_IP)"
        assert {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}} in c["env"]
        assert c["resources"]["requests"]["nvidia.com/gpu"] == 1 and c["resources"]["requests"]["cpu"] == "8"
        assert pod["volumes"][0]["configMap"]["name"] == f"llama8b-{role}-engine"
        plan = json.loads(config_maps[f"llama8b-{role}-engine"]["data"]["plan.json"])
        assert plan["role"] == role
        assert d["spec"]["selector"]["matchLabels"]["specdeploy.dev/role"] == role
        assert services[f"llama8b-{role}"]["spec"]["clusterIP"] == "None"
        assert services[f"llama8b-{role}"]["spec"]["selector"] == d["spec"]["selector"]["matchLabels"]
    router = deployments["llama8b-router"]
    (rc,) = router["spec"]["template"]["spec"]["containers"]
    assert rc["command"] == ["specdeploy", "router"]
    assert rc["args"][:4] == ["--prefill", "http://llama8b-prefill:8000", "--decode", "http://llama8b-decode:8000"]
    assert rc["resources"] == {"requests": {"cpu": "1"}, "limits": {}}
    assert router["spec"]["replicas"] == 2
    assert services["llama8b"]["spec"]["selector"] == router["spec"]["selector"]["matchLabels"]
    assert "clusterIP" not in services["llama8b"]["spec"]
    # No selector overlaps another role's pods, and the engine selector (metrics) skips the router.
    selectors = [d["spec"]["selector"]["matchLabels"] for d in deployments.values()]
    for i, a in enumerate(selectors):
        for b in selectors[i + 1:]:
            assert any(a.get(k) != v for k, v in b.items())
    hashes = {d["metadata"]["annotations"]["specdeploy.dev/config-hash"] for d in deployments.values()}
    assert hashes == {children.config_hash}
    for obj in children.all():
        assert obj["metadata"]["ownerReferences"][0]["uid"] == "0000-uid" and obj["metadata"]["namespace"] == "serving"


def test_role_pods_ask_for_their_host_staging_arena_on_top_of_the_users_memory():
    sdd = make_sdd()
    sdd["spec"]["engine"]["resources"]["limits"] = {"memory": "80Gi"}
    sdd["spec"]["disaggregation"]["decode"]["resources"] = {"requests": {"cpu": "4"}}
    p = planned(sdd)
    deployments = by_name(roles.render_roles(sdd, p, DEFAULTS), "Deployment")
    for role, user in (("prefill", {"requests": {"memory": 64 << 30}, "limits": {"memory": 80 << 30}}),
                       ("decode", {"requests": {}, "limits": {}})):
        staging = p.role_plans[role]["buffers"]["transfer_staging_bytes"]
        # Two full 8192-token requests of the 8B's target and EAGLE-3 KV (132 KiB per token).
        assert 2 * 8192 * 132 << 10 <= staging < 2 * 8200 * 132 << 10
        (c,) = deployments[f"llama8b-{role}"]["spec"]["template"]["spec"]["containers"]
        for kind in ("requests", "limits"):
            got = c["resources"][kind].get("memory")
            if "memory" in user[kind]:
                assert got == f"{-(-(user[kind]['memory'] + staging) // (1 << 20))}Mi"
            else:  # no memory given (the decode role's own resources replace the engine's): none made up
                assert got is None
    # The aggregated engine has no staging arena: its memory is the user's, unchanged.
    assert roles.with_host_staging({"requests": {"memory": "3Gi"}}, 0) == {"requests": {"memory": "3Gi"}}
    assert roles.with_host_staging({"limits": {"memory": "1000M", "cpu": "2"}}, 1 << 20) == {
        "limits": {"memory": f"{-(-(10**9 + (1 << 20)) // (1 << 20))}Mi", "cpu": "2"}}
    assert roles.with_host_staging({"limits": {"memory": "1Ei"}}, 1 << 20) == {"limits": {"memory": f"{(1 << 40) + 1}Mi"}}
    # Not a quantity: left for the API server to refuse (a rendering error would hide its message).
    assert roles.with_host_staging({"limits": {"memory": "lots"}}, 1 << 20) == {"limits": {"memory": "lots"}}


def test_roles_of_a_model_that_needs_two_gpus_get_two_each():
    """Llama-3.3-70B: each role is planned at TP 2, as one server is; its pods ask for 2 GPUs and
    its ConfigMap's plan says TP 2 (the engine serves split roles tensor parallel)."""
    sdd = make_sdd()
    sdd["spec"]["target"]["model"] = "meta-llama/Llama-3.3-70B-Instruct"
    del sdd["spec"]["draft"]
    sdd["spec"]["speculative"] = {"algorithm": "NONE"}
    p = plan_engine(sdd["spec"], config("llama-3.3-70b-instruct"), None)
    children = roles.render_roles(sdd, p, DEFAULTS)
    deployments, config_maps = by_name(children, "Deployment"), by_name(children, "ConfigMap")
    for role in ("prefill", "decode"):
        assert p.role_plans[role]["tensor_parallel_size"] == 2
        (c,) = deployments[f"llama8b-{role}"]["spec"]["template"]["spec"]["containers"]
        assert c["resources"]["requests"]["nvidia.com/gpu"] == c["resources"]["limits"]["nvidia.com/gpu"] == 2
        assert json.loads(config_maps[f"llama8b-{role}-engine"]["data"]["engine.json"])["tensor_parallel_size"] == 2


def test_any_change_rolls_every_role():
    a = make_sdd()
    b = make_sdd(transferProtocol="rdma")
    ha, hb = (roles.render_roles(s, planned(s), DEFAULTS).config_hash for s in (a, b))
    assert ha != hb


def deployment(name, wanted, ready, hash_value):
    return {"metadata": {"name": name, "generation": 1, "annotations": {"specdeploy.dev/config-hash": hash_value}},
            "spec": {"replicas": wanted, "selector": {"matchLabels": {"a": "b"}}},
            "status": {"observedGeneration": 1, "replicas": wanted, "updatedReplicas": wanted,
                       "availableReplicas": ready, "readyReplicas": ready}}


def test_status_is_ready_only_when_every_role_is():
    sdd = make_sdd()
    p = planned(sdd)
    base = status.plan_ready({}, generation=1, plan=p.plan, config_hash="h1", message="planned", now="t0")
    deps = {"prefill": deployment("llama8b-prefill", 1, 1, "h1"), "decode": deployment("llama8b-decode", 3, 2, "h1"),
            "router": deployment("llama8b-router", 2, 2, "h1")}
    st = status.serving_roles(base, deps, generation=1, now="t1", role_plans=p.role_plans)
    assert st["phase"] == "Deploying" and status.get_condition(st, "Ready")["status"] == "False"
    assert "decode 2/3 ready" in status.get_condition(st, "Ready")["message"]
    assert st["disaggregation"]["decode"] == {"deployment": "llama8b-decode", "replicas": 3, "readyReplicas": 2,
                                              "updatedReplicas": 3, "wantedReplicas": 3,
                                              "maxTotalTokens": p.role_plans["decode"]["max_total_tokens"],
                                              "gpusPerReplica": 1}
    assert st["disaggregation"]["prefill"]["maxTotalTokens"] == p.role_plans["prefill"]["max_total_tokens"]
    deps["decode"] = deployment("llama8b-decode", 3, 3, "h1")
    st = status.serving_roles(st, deps, generation=1, now="t2")
    assert st["phase"] == "Ready" and status.get_condition(st, "Ready")["status"] == "True"
    assert st["serving"]["readyReplicas"] == 6 and st["serving"]["deployment"] == "llama8b-decode"
    # A role whose Deployment runs an older spec holds Ready back; a missing one too.
    deps["prefill"] = deployment("llama8b-prefill", 1, 1, "old")
    assert status.get_condition(status.serving_roles(st, deps, generation=1, now="t3"), "Ready")["reason"] == "RolloutPending"
    deps["prefill"] = None
    st = status.serving_roles(st, deps, generation=1, now="t4")
    assert status.get_condition(st, "Ready")["reason"] == "DeploymentMissing"
    assert "prefill" in status.get_condition(st, "Ready")["message"]
