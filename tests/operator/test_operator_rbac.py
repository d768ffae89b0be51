"""The operator works with exactly the permissions docs/operator.md lists: it runs as a
ServiceAccount bound to those rules (the test cluster enforces RBAC), never as an admin."""

from __future__ import annotations

from pathlib import Path

import yaml
from testcluster import wait_for

NAMESPACED_RULES = [
    {"apiGroups": ["specdeploy.dev"], "resources": ["specdecodedeployments"], "verbs": ["get", "list", "watch", "patch"]},
    {"apiGroups": ["specdeploy.dev"], "resources": ["specdecodedeployments/status"], "verbs": ["update"]},
    {"apiGroups": ["apps"], "resources": ["deployments"], "verbs": ["get", "list", "watch", "create", "patch", "delete"]},
    {"apiGroups": ["leaderworkerset.x-k8s.io"], "resources": ["leaderworkersets"],
     "verbs": ["get", "list", "watch", "create", "patch", "delete"]},
    {"apiGroups": [""], "resources": ["configmaps"], "verbs": ["get", "create", "patch", "delete"]},
    {"apiGroups": [""], "resources": ["persistentvolumeclaims"], "verbs": ["get", "create", "patch"]},
    {"apiGroups": [""], "resources": ["services"], "verbs": ["get", "create", "patch"]},
    {"apiGroups": [""], "resources": ["secrets"], "verbs": ["get", "create"]},
    {"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "watch"]},
    {"apiGroups": [""], "resources": ["pods/log"], "verbs": ["get"]},
    {"apiGroups": [""], "resources": ["events"], "verbs": ["create"]},
    *({"apiGroups": [group], "resources": [resource], "verbs": ["get", "list", "create", "patch", "delete"]}
      for group, resource in (("policy", "poddisruptionbudgets"), ("networking.k8s.io", "networkpolicies"),
                              ("autoscaling", "horizontalpodautoscalers"), ("keda.sh", "scaledobjects"),
                              ("inference.networking.k8s.io", "inferencepools"))),
]
CLUSTER_RULES = [
    {"apiGroups": ["apiextensions.k8s.io"], "resources": ["customresourcedefinitions"], "verbs": ["list", "watch"]},
    {"apiGroups": [""], "resources": ["namespaces"], "verbs": ["list", "watch"]},
]


def service_account_kubeconfig(cluster, namespace: str, path: Path) -> Path:
    sa = "specdeploy-operator"
    cluster.kubectl("create", "serviceaccount", sa, "-n", namespace)
    rbac = [
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": {"name": sa, "namespace": namespace}, "rules": NAMESPACED_RULES},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": {"name": sa, "namespace": namespace},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": sa},
         "subjects": [{"kind": "ServiceAccount", "name": sa, "namespace": namespace}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole", "metadata": {"name": f"{sa}-{namespace}"}, "rules": CLUSTER_RULES},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding", "metadata": {"name": f"{sa}-{namespace}"},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": f"{sa}-{namespace}"},
         "subjects": [{"kind": "ServiceAccount", "name": sa, "namespace": namespace}]},
    ]
    cluster.apply(rbac)
    token = cluster.kubectl("create", "token", sa, "-n", namespace, "--duration=1h").stdout.strip()
    admin = yaml.safe_load(cluster.kubeconfig.read_text())
    kubeconfig = {
        "apiVersion": "v1", "kind": "Config",
        "clusters": admin["clusters"],
        "users": [{"name": sa, "user": {"token": token}}],
        "contexts": [{"name": sa, "context": {"cluster": admin["clusters"][0]["name"], "user": sa, "namespace": namespace}}],
        "current-context": sa,
    }
    path.write_text(yaml.safe_dump(kubeconfig))
    return path


def test_operator_runs_with_the_documented_permissions(kube_cluster, kube_namespace, operator_process, hub_secret, manifest, sdd_of, tmp_path):
    kubeconfig = service_account_kubeconfig(kube_cluster, kube_namespace, tmp_path / "sa-kubeconfig.yaml")
    operator = operator_process(kubeconfig=kubeconfig, metrics_interval_s=1)
    try:
        kube_cluster.apply(manifest("restricted", replicas=2, networkPolicy={}), namespace=kube_namespace)
        sdd = sdd_of("restricted")
        sdd.wait_ready(timeout_s=90)
        # Its addons too: the disruption budget of two replicas and the network policy.
        wait_for(lambda: sdd.owned("poddisruptionbudgets") and sdd.owned("networkpolicies"), timeout_s=30, what="addons")
        wait_for(lambda: {"Planned", "Applied"} <= {e["reason"] for e in sdd.events()}, timeout_s=20, what="events")
        # A config error path (Secret read, delete of nothing) and a few metrics rounds.
        kube_cluster.kubectl("patch", "sdd", "restricted", "-n", kube_namespace, "--type=merge", "-p", '{"spec":{"gpu":{"product":"l40s","perNode":1}}}')
        wait_for(lambda: sdd.deployment() is None and sdd.status().get("phase") == "Failed", timeout_s=30, what="engine removed")
    finally:
        logs = operator.logs()
    assert "Forbidden" not in logs and " 403" not in logs and "metrics round failed" not in logs, logs
