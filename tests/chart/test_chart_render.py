"""The chart as rendered by helm, before any cluster sees it: lint, schema, security, RBAC shape."""

from __future__ import annotations

import subprocess

import pytest
import yaml

from chartkit import CHART, CRD_SOURCE, INSTALL_YAML, ROOT, by_kind, one, parse

VARIANTS = {
    "default": [],
    "namespaces": ["watch.namespaces={team-a,team-b}"],
    "cluster-wide": ["watch.clusterWide=true"],
    "debug-no-rbac": ["operator.logLevel=debug", "rbac.create=false"],
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_lint_is_clean(helm, variant):
    args = ["lint", "--strict", str(CHART), "--kube-version", helm.kube_version]
    for value in VARIANTS[variant]:
        args += ["--set", value]
    result = helm.run(*args, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "[WARNING]" not in result.stdout and "[ERROR]" not in result.stdout, result.stdout


@pytest.mark.parametrize("value, complaint", [
    ("watch.clusterWide=yes", "/watch/clusterWide"),
    ("watch.namespaces={Team_A}", "/watch/namespaces/0"),
    ("watch.clusterWide=true,watch.namespaces={team-a}", "/watch/namespaces"),
    ("operator.logLevel=trace", "/operator/logLevel"),
    ("operator.healthPort=80", "/operator/healthPort"),
    ("image.pullPolicy=Sometimes", "/image/pullPolicy"),
    ("replicas=2", "additional properties 'replicas'"),
    ("podSecurityContext.runAsNonRoot=false", "/podSecurityContext/runAsNonRoot"),
    ("securityContext.allowPrivilegeEscalation=true", "/securityContext/allowPrivilegeEscalation"),
    ("resources.requests.memory=lots", "/resources/requests/memory"),
    ("hub.endpoint=hub.local", "/hub/endpoint"),
])
def test_schema_refuses_bad_values(helm, value, complaint):
    result = helm.run("template", "x", str(CHART), "--kube-version", helm.kube_version, "--set", value, check=False)
    assert result.returncode != 0, f"{value} was accepted"
    assert "don't meet the specifications of the schema" in result.stderr
    assert complaint in result.stderr, result.stderr


def test_operator_deployment_is_single_recreated_and_locked_down(helm):
    objs = parse(helm.template(release="sd", namespace="ops"))
    deploy = one(objs, "Deployment")
    spec = deploy["spec"]
    assert spec["replicas"] == 1
    assert spec["strategy"] == {"type": "Recreate"}
    pod = spec["template"]["spec"]
    assert pod["serviceAccountName"] == one(objs, "ServiceAccount")["metadata"]["name"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] > 0
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}

    (container,) = pod["containers"]
    sc = container["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert sc["seccompProfile"] == {"type": "RuntimeDefault"}
    assert "privileged" not in sc

    # The one writable path.
    (mount,) = container["volumeMounts"]
    assert mount["mountPath"] == "/tmp"
    (volume,) = pod["volumes"]
    assert volume["name"] == mount["name"] and "emptyDir" in volume

    (port,) = container["ports"]
    assert port["containerPort"] == 8080
    for probe in ("livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"] == {"path": "/healthz", "port": port["name"]}
    assert f"--liveness-port={port['containerPort']}" in container["args"]

    assert container["resources"]["requests"]["cpu"] and container["resources"]["requests"]["memory"]
    assert container["resources"]["limits"]["memory"]
    assert container["image"] == "ghcr.io/specdeploy/operator:0.1.0"
    assert "--engine-image=ghcr.io/specdeploy/engine:0.1.0" in container["args"]
    assert not [a for a in container["args"] if a.startswith("--hub-endpoint")]
    assert container["args"][0] == "operator"


def test_engine_image_and_hub_endpoint_reach_the_operator(helm):
    args = _operator_args(parse(helm.template(
        "engine.image.repository=registry.local/engine", "engine.image.tag=dev", "hub.endpoint=http://hub.local:8080",
    )))
    assert "--engine-image=registry.local/engine:dev" in args
    assert "--hub-endpoint=http://hub.local:8080" in args


def test_health_port_moves_the_probes(helm):
    container = one(parse(helm.template("operator.healthPort=9808")), "Deployment")["spec"]["template"]["spec"]["containers"][0]
    assert container["ports"][0]["containerPort"] == 9808
    assert "--liveness-port=9808" in container["args"]


def _operator_args(objs):
    return one(objs, "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]


def test_default_serves_the_release_namespace_with_a_role(helm):
    objs = parse(helm.template(release="sd", namespace="ops"))
    assert [r["metadata"]["namespace"] for r in by_kind(objs, "Role")] == ["ops"]
    assert [b["metadata"]["namespace"] for b in by_kind(objs, "RoleBinding")] == ["ops"]
    assert "--namespace=ops" in _operator_args(objs)
    assert "--all-namespaces" not in _operator_args(objs)
    # The only cluster-scoped grant is kopf's read-only watch of CRDs and namespaces.
    (cluster_role,) = by_kind(objs, "ClusterRole")
    assert _flatten(cluster_role["rules"]) == {
        ("apiextensions.k8s.io", "customresourcedefinitions"): {"list", "watch"},
        ("", "namespaces"): {"list", "watch"},
    }


def test_listed_namespaces_each_get_a_role(helm):
    objs = parse(helm.template("watch.namespaces={team-a,team-b}", release="sd", namespace="ops"))
    assert sorted(r["metadata"]["namespace"] for r in by_kind(objs, "Role")) == ["team-a", "team-b"]
    for binding in by_kind(objs, "RoleBinding"):
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "sd-specdeploy", "namespace": "ops"}]
    args = _operator_args(objs)
    assert [a for a in args if a.startswith("--namespace")] == ["--namespace=team-a", "--namespace=team-b"]


def test_cluster_wide_uses_a_cluster_role(helm):
    objs = parse(helm.template("watch.clusterWide=true", release="sd", namespace="ops"))
    assert not by_kind(objs, "Role") and not by_kind(objs, "RoleBinding")
    names = sorted(r["metadata"]["name"] for r in by_kind(objs, "ClusterRole"))
    assert names == ["sd-specdeploy", "sd-specdeploy-kopf"]
    kopf_role = [r for r in by_kind(objs, "ClusterRole") if r["metadata"]["name"] == "sd-specdeploy-kopf"][0]
    # kopf lists namespaces only to match a list of them; cluster-wide it needs none.
    assert _flatten(kopf_role["rules"]) == {("apiextensions.k8s.io", "customresourcedefinitions"): {"list", "watch"}}
    assert "--all-namespaces" in _operator_args(objs)
    assert not [a for a in _operator_args(objs) if a.startswith("--namespace")]


def test_rbac_off_renders_no_rbac(helm):
    objs = parse(helm.template("rbac.create=false"))
    assert not [o for o in objs if o["apiVersion"].startswith("rbac.authorization.k8s.io")]


# The operator's grants, as a contract: changing one must be deliberate (and the cluster tests
# must still pass with the new set). (apiGroup, resource) -> verbs.
EXPECTED_OPERATOR_RULES = {
    ("specdeploy.dev", "specdecodedeployments"): {"get", "list", "watch", "patch"},
    ("specdeploy.dev", "specdecodedeployments/status"): {"update"},
    ("specdeploy.dev", "specdecodedeployments/finalizers"): {"update"},
    ("apps", "deployments"): {"get", "list", "watch", "create", "patch", "delete"},
    ("", "configmaps"): {"get", "create", "patch", "delete"},
    ("", "persistentvolumeclaims"): {"get", "create", "patch"},
    ("", "services"): {"get", "create", "patch"},
    ("", "pods"): {"list", "watch"},
    ("", "pods/log"): {"get"},
    ("", "secrets"): {"get"},
    ("", "events"): {"create"},
}


def _flatten(rules):
    grants: dict[tuple[str, str], set[str]] = {}
    for rule in rules:
        assert "resourceNames" not in rule and "nonResourceURLs" not in rule
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                grants.setdefault((group, resource), set()).update(rule["verbs"])
    return grants


@pytest.mark.parametrize("variant", ["default", "cluster-wide"])
def test_operator_rules_are_exactly_the_contract(helm, variant):
    objs = parse(helm.template(*VARIANTS[variant], release="sd"))
    roles = [r for r in by_kind(objs, "Role") + by_kind(objs, "ClusterRole") if r["metadata"]["name"] == "sd-specdeploy"]
    assert len(roles) == 1
    grants = _flatten(roles[0]["rules"])
    assert grants == EXPECTED_OPERATOR_RULES
    every_verb = set().union(*grants.values())
    every_word = every_verb | {g for g, _ in grants} | {r for _, r in grants}
    assert "*" not in every_word
    assert not every_verb & {"deletecollection", "escalate", "bind", "impersonate"}
    # Writes to the main resources go through server-side apply (patch); update only on subresources.
    assert {k for k, verbs in grants.items() if "update" in verbs} == {
        ("specdeploy.dev", "specdecodedeployments/status"), ("specdeploy.dev", "specdecodedeployments/finalizers"),
    }
    assert {k for k, verbs in grants.items() if "delete" in verbs} == {("apps", "deployments"), ("", "configmaps")}


def test_chart_versions_follow_the_package():
    import tomllib

    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    package = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert chart["appVersion"] == package
    # The images the chart defaults to are tagged with appVersion (values leave the tags empty).
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["image"]["tag"] == "" and values["engine"]["image"]["tag"] == ""


def test_install_yaml_is_the_fresh_default_render(helm):
    env = dict(helm.env, HELM=str(helm.binary))
    result = subprocess.run(
        ["bash", str(ROOT / "hack" / "render-install.sh"), "--check"],
        env=env, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr + "\n(run hack/render-install.sh)"


def test_install_yaml_carries_namespace_crd_and_operator():
    objs = parse(INSTALL_YAML.read_text())
    assert one(objs, "Namespace")["metadata"]["name"] == "specdeploy"
    assert objs[0]["kind"] == "Namespace", "the namespace must come first"
    crd = one(objs, "CustomResourceDefinition")
    assert crd == yaml.safe_load(CRD_SOURCE.read_text())
    deploy = one(objs, "Deployment")
    assert deploy["metadata"]["namespace"] == "specdeploy"
    assert "--namespace=specdeploy" in deploy["spec"]["template"]["spec"]["containers"][0]["args"]
