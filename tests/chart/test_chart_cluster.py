"""The chart against the real control plane (tests/cluster): the rendered objects are accepted,
`helm install` gives an operator that serves the examples under the chart's own ServiceAccount and
nothing more, `helm upgrade` rolls it, `helm uninstall` leaves nothing behind."""

from __future__ import annotations

import contextlib
import json
import re
import shlex
import socket
import subprocess
import sys
import threading
import urllib.parse
import urllib.request
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml
from testcluster import KubeCluster, wait_for

import chartkit as examples
from chartkit import CHART, CRD_SOURCE, EXAMPLES, INSTALL_YAML, ROOT, parse

INSTANCE_LABEL = "app.kubernetes.io/instance"
HUB_TOKEN = "hf_chart_test_token"
ONE_GPU_EXAMPLE = "llama-3.1-8b-eagle3-h200.yaml"


# ---- fixtures ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def crd(kube_cluster: KubeCluster) -> str:
    """The CRD applied with the chart README's upgrade step (its crds/ is a copy of CRD_SOURCE)."""
    kube_cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CHART / "crds"))
    name = yaml.safe_load(CRD_SOURCE.read_text())["metadata"]["name"]
    kube_cluster.kubectl("wait", "--for=condition=Established", f"crd/{name}", "--timeout=60s")
    return name


def _hub_models() -> dict[str, Path]:
    """model id -> config.json, for every hub-read model the examples name in their comments."""
    models = {}
    for path in examples.example_files():
        spec = examples.load_sdd(path)["spec"]
        for role, file in examples.config_sources(path).items():
            models[spec[role]["model"]] = file
    return models


class _Hub(BaseHTTPRequestHandler):
    """A Hugging Face-compatible hub serving manifests/models; meta-llama models are gated, as on
    the real hub, so their configs need the token the examples name in spec.hub.tokenSecretRef."""

    models: dict[str, Path] = {}
    requests: list[str] = []

    def do_GET(self) -> None:  # noqa: N802
        path = urllib.parse.unquote(self.path)
        self.requests.append(path)
        code, body = 404, b"not found"
        for model, file in self.models.items():
            if path == f"/{model}/resolve/main/config.json":
                code, body = 200, file.read_bytes()
                if model.startswith("meta-llama/") and self.headers.get("Authorization") != f"Bearer {HUB_TOKEN}":
                    code, body = 401, b"gated model: token required"
        self.send_response(code)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def hub() -> Iterator[str]:
    _Hub.models = _hub_models()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Hub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _release(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:5]}"


def helm_install(cluster: KubeCluster, release: str, namespace: str, *values: str) -> None:
    args = ["install", release, str(CHART), "--namespace", namespace]
    for value in values:
        args += ["--set", value]
    cluster.helm(*args)


def operator_deployment(cluster: KubeCluster, release: str, namespace: str) -> dict[str, Any]:
    (deploy,) = cluster.kubectl_json("get", "deployments", "-n", namespace, "-l", f"{INSTANCE_LABEL}={release}")["items"]
    return deploy


def service_account_kubeconfig(cluster: KubeCluster, namespace: str, sa: str, path: Path) -> Path:
    """A kubeconfig that authenticates as the ServiceAccount, with a token from the TokenRequest
    API: what the operator pod's projected token gives it in a real cluster."""
    token = cluster.kubectl("create", "token", sa, "-n", namespace, "--duration=1h").stdout.strip()
    admin = yaml.safe_load(cluster.kubeconfig.read_text())
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "test", "cluster": admin["clusters"][0]["cluster"]}],
        "users": [{"name": sa, "user": {"token": token}}],
        "contexts": [{"name": sa, "context": {"cluster": "test", "user": sa, "namespace": namespace}}],
        "current-context": sa,
    }
    path.write_text(yaml.safe_dump(config))
    return path


def can_i(cluster: KubeCluster, subject: str, *args: str) -> bool:
    result = cluster.kubectl("auth", "can-i", f"--as={subject}", *args, check=False)
    answer = result.stdout.strip()
    assert answer in ("yes", "no"), f"kubectl auth can-i {args}: {result.stdout}{result.stderr}"
    return answer == "yes"


def dry_run(cluster: KubeCluster, text: str, namespace: str | None = None) -> subprocess.CompletedProcess[str]:
    args = ["apply", "--dry-run=server", "--server-side", "-f", "-"]
    if namespace:
        args += ["-n", namespace]
    return cluster.kubectl(*args, input=text)


# ---- the rendered chart and the plain manifests ---------------------------------------------


@pytest.mark.parametrize("variant", ["default", "namespaces", "cluster-wide"])
def test_rendered_chart_is_accepted_by_the_apiserver(kube_cluster, kube_namespace, helm, variant):
    values = {
        "default": [],
        # Roles in two namespaces: the release's and another that exists.
        "namespaces": [f"watch.namespaces={{{kube_namespace},default}}"],
        "cluster-wide": ["watch.clusterWide=true"],
    }[variant]
    text = helm.template(*values, release=_release("dry"), namespace=kube_namespace, include_crds=True)
    out = dry_run(kube_cluster, text).stdout
    kinds = {o["kind"] for o in parse(text)}
    assert {"CustomResourceDefinition", "ServiceAccount", "Deployment", "ClusterRole"} <= kinds
    assert out.count("serverside-applied (server dry run)") == len(parse(text)), out


def test_install_yaml_installs_with_kubectl(kube_cluster, crd):
    """The plain-YAML path of the README, for real: every object is created and the operator's
    Deployment rolls out; then everything but the CRD is removed again."""
    objs = parse(INSTALL_YAML.read_text())
    try:
        kube_cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(INSTALL_YAML))
        kube_cluster.kubectl("-n", "specdeploy", "rollout", "status", "deployment/specdeploy", "--timeout=45s")
        for obj in objs:
            meta = obj["metadata"]
            ns = ["-n", meta["namespace"]] if "namespace" in meta else []
            kube_cluster.kubectl("get", obj["kind"].lower(), meta["name"], *ns)
    finally:
        # Synchronously: the README test installs the chart under the same names next.
        others = [o for o in objs if o["kind"] != "CustomResourceDefinition"]
        kube_cluster.kubectl(
            "delete", "--ignore-not-found", "-f", "-", input=yaml.safe_dump_all(others), check=False, timeout_s=120
        )


def test_readme_installs_the_chart_and_an_example_with_two_commands(kube_cluster, crd):
    """The chart README's "Install" commands, run as written (from the repository root)."""
    readme = (CHART / "README.md").read_text()
    block = re.search(r"^## Install\n\n```sh\n(.*?)^```", readme, re.MULTILINE | re.DOTALL)
    assert block, "charts/specdeploy/README.md has no Install code block"
    commands = [shlex.split(line) for line in block.group(1).strip().splitlines()]
    assert [c[0] for c in commands] == ["helm", "kubectl"]
    run = {"helm": kube_cluster.helm, "kubectl": kube_cluster.kubectl}
    release, namespace = commands[0][2], commands[0][commands[0].index("--namespace") + 1]
    try:
        for tool, *args in commands:
            # Paths in the README are relative to the repository root.
            run[tool](*[str(ROOT / a) if a.startswith(("charts/", "manifests/")) else a for a in args])
        name = operator_deployment(kube_cluster, release, namespace)["metadata"]["name"]
        kube_cluster.kubectl("-n", namespace, "rollout", "status", f"deployment/{name}", "--timeout=45s")
        example = examples.load_sdd(ROOT / commands[1][-1])["metadata"]["name"]
        kube_cluster.kubectl("-n", namespace, "get", "sdd", example)
    finally:
        kube_cluster.kubectl("-n", namespace, "delete", "sdd", "--all", "--wait=false", check=False)
        kube_cluster.helm("uninstall", release, "-n", namespace, check=False)
        kube_cluster.kubectl("delete", "namespace", namespace, "--wait=false", "--ignore-not-found", check=False)


def test_every_example_passes_server_dry_run(kube_cluster, kube_namespace, crd):
    files = examples.example_files()
    assert files
    for path in files:
        out = dry_run(kube_cluster, path.read_text(), namespace=kube_namespace).stdout
        assert "serverside-applied (server dry run)" in out, f"{path.name}: {out}"


# ---- install: the chart's identity runs the operator ----------------------------------------


@contextlib.contextmanager
def operator_as_chart_deploys_it(cluster: KubeCluster, release: str, ns: str, workdir: Path) -> Iterator[Path]:
    """Run `specdeploy` with the args of the chart's operator Deployment, authenticated with a
    token of the chart's ServiceAccount; yields the log file. On exit, stops the operator and
    checks that it was never refused anything (the RBAC is sufficient)."""
    deploy = operator_deployment(cluster, release, ns)
    cluster.kubectl("-n", ns, "rollout", "status", f"deployment/{deploy['metadata']['name']}", "--timeout=45s")
    pod_spec = deploy["spec"]["template"]["spec"]
    (container,) = pod_spec["containers"]
    kubeconfig = service_account_kubeconfig(cluster, ns, pod_spec["serviceAccountName"], workdir / "sa-kubeconfig")
    health_port = next(a for a in container["args"] if a.startswith("--liveness-port=")).split("=")[1]
    log_path = workdir / "operator.log"
    with open(log_path, "w") as log:
        operator = subprocess.Popen(
            [sys.executable, "-P", "-m", "specdeploy.cli", *container["args"]],
            env=dict(cluster.env, KUBECONFIG=str(kubeconfig)), cwd=workdir, stdout=log, stderr=subprocess.STDOUT,
        )
    try:
        # The endpoint both probes call answers.
        def healthy() -> bool:
            with urllib.request.urlopen(f"http://127.0.0.1:{health_port}/healthz", timeout=2) as r:
                return r.status == 200

        wait_for(healthy, timeout_s=60, what="the operator's /healthz")
        yield log_path
    finally:
        operator.terminate()
        try:
            operator.wait(timeout=20)
        except subprocess.TimeoutExpired:
            operator.kill()
            operator.wait()
        # Shown by pytest when the test fails.
        print(f"---- operator log ({' '.join(container['args'])}) ----\n{log_path.read_text()}")
    log_text = log_path.read_text()
    for needle in ("Forbidden", "forbidden", " 403"):
        assert needle not in log_text, f"the operator was refused something:\n{log_text[-4000:]}"
    assert "Traceback" not in log_text, log_text[-4000:]


def test_install_serves_examples_with_the_charts_service_account(kube_cluster, kube_namespace, helm, crd, hub, tmp_path):
    ns = kube_namespace
    release = _release("sd")
    helm_install(
        kube_cluster, release, ns,
        f"operator.healthPort={_free_port()}", f"hub.endpoint={hub}", "engine.image.tag=test",
        # Debug logs show each engine-metrics round, which lists the engine pods.
        "operator.logLevel=debug",
    )
    try:
        notes = kube_cluster.helm("get", "notes", release, "-n", ns).stdout
        assert f"kubectl -n {ns} get sdd" in notes
        assert "kubectl apply --server-side --force-conflicts" in notes

        with operator_as_chart_deploys_it(kube_cluster, release, ns, tmp_path) as log_path:
            kube_cluster.kubectl("-n", ns, "create", "secret", "generic", "hf-token", f"--from-literal=token={HUB_TOKEN}")
            for path in examples.example_files():
                kube_cluster.kubectl("-n", ns, "apply", "-f", str(path))
            for path in examples.example_files():
                # The fake cluster has two 8-GPU H200 nodes and one H100 node: room for every
                # example only if nothing else holds GPUs, so only the one-GPU ones must reach Ready.
                _check_served(kube_cluster, ns, path, engine_image="ghcr.io/specdeploy/engine:test",
                              must_be_ready=examples.commented_plan(path)["tensor_parallel_size"] == 1)
            # One round of the operator's engine-metrics loop (every 30 s): it lists the ready
            # engine pods and tries their /metrics, which kwok's pods do not serve.
            wait_for(lambda: "metrics not scraped" in log_path.read_text(), timeout_s=100,
                     what="an engine-metrics round in the operator log")

        sa = operator_deployment(kube_cluster, release, ns)["spec"]["template"]["spec"]["serviceAccountName"]
        subject = f"system:serviceaccount:{ns}:{sa}"
        # Minimal: what it has no business doing is denied.
        other = "default"
        for args in [
            ("delete", "secrets", "-n", ns),
            ("list", "secrets", "-n", ns),
            ("watch", "secrets", "-n", ns),
            # It creates a split-role resource's shared secret once; it never rewrites a Secret.
            ("update", "secrets", "-n", ns),
            ("patch", "secrets", "-n", ns),
            ("get", "secrets", "-n", other),
            ("list", "pods", "--all-namespaces"),
            ("get", "pods", "-n", ns),
            ("delete", "pods", "-n", ns),
            ("create", "pods", "-n", ns),
            ("create", "pods", "--subresource=exec", "-n", ns),
            ("delete", "services", "-n", ns),
            ("update", "deployments", "-n", ns),
            ("delete", "specdecodedeployments.specdeploy.dev", "-n", ns),
            ("create", "specdecodedeployments.specdeploy.dev", "-n", ns),
            ("list", "specdecodedeployments.specdeploy.dev", "-n", other),
            ("patch", "deployments", "-n", other),
            ("create", "clusterroles"),
            ("create", "rolebindings", "-n", ns),
            ("bind", "clusterroles"),
            ("escalate", "roles", "-n", ns),
            ("impersonate", "serviceaccounts", "-n", ns),
            ("create", "serviceaccounts", "--subresource=token", "-n", ns),
            ("delete", "customresourcedefinitions"),
            ("patch", "customresourcedefinitions"),
            ("list", "nodes"),
        ]:
            assert not can_i(kube_cluster, subject, *args), f"{subject} may {' '.join(args)}"
        # ... and what it uses is granted, in its namespace only.
        for args in [
            ("patch", "deployments", "-n", ns),
            ("update", "specdecodedeployments.specdeploy.dev", "--subresource=status", "-n", ns),
            ("get", "secrets", "-n", ns),
            ("create", "secrets", "-n", ns),  # a disaggregated resource's shared secret, made once
            ("watch", "customresourcedefinitions"),
        ]:
            assert can_i(kube_cluster, subject, *args), f"{subject} may not {' '.join(args)}"
    finally:
        for path in examples.example_files():
            kube_cluster.kubectl("-n", ns, "delete", "-f", str(path), "--ignore-not-found", "--wait=false", check=False)
        kube_cluster.helm("uninstall", release, "-n", ns, check=False)


def test_cluster_wide_install_serves_any_namespace(kube_cluster, kube_namespace, crd, hub, tmp_path):
    ns, release = kube_namespace, _release("cw")
    elsewhere = f"{ns}-users"
    kube_cluster.kubectl("create", "namespace", elsewhere)
    example = EXAMPLES / ONE_GPU_EXAMPLE
    helm_install(
        kube_cluster, release, ns,
        "watch.clusterWide=true", f"operator.healthPort={_free_port()}", f"hub.endpoint={hub}", "engine.image.tag=test",
    )
    try:
        with operator_as_chart_deploys_it(kube_cluster, release, ns, tmp_path):
            kube_cluster.kubectl("-n", elsewhere, "create", "secret", "generic", "hf-token", f"--from-literal=token={HUB_TOKEN}")
            kube_cluster.kubectl("-n", elsewhere, "apply", "-f", str(example))
            _check_served(kube_cluster, elsewhere, example, engine_image="ghcr.io/specdeploy/engine:test", must_be_ready=False)
        sa = operator_deployment(kube_cluster, release, ns)["spec"]["template"]["spec"]["serviceAccountName"]
        subject = f"system:serviceaccount:{ns}:{sa}"
        # Cluster-wide still means the operator's resources only.
        assert can_i(kube_cluster, subject, "list", "specdecodedeployments.specdeploy.dev", "--all-namespaces")
        for args in [("list", "secrets", "--all-namespaces"), ("get", "pods", "-n", elsewhere),
                     ("delete", "services", "-n", elsewhere), ("create", "clusterroles")]:
            assert not can_i(kube_cluster, subject, *args), f"{subject} may {' '.join(args)}"
    finally:
        kube_cluster.kubectl("-n", elsewhere, "delete", "-f", str(example), "--ignore-not-found", "--wait=false", check=False)
        kube_cluster.helm("uninstall", release, "-n", ns, check=False)
        kube_cluster.kubectl("delete", "namespace", elsewhere, "--wait=false", "--ignore-not-found", check=False)


def _check_served(cluster: KubeCluster, ns: str, path: Path, engine_image: str, must_be_ready: bool) -> None:
    """The operator planned the example as its comment says and created the engine's children."""
    from specdeploy.operator.desired.render import config_map_name
    from specdeploy.operator.desired.status import camel_case

    name = examples.load_sdd(path)["metadata"]["name"]

    def planned() -> dict[str, Any]:
        sdd = cluster.kubectl_json("-n", ns, "get", "sdd", name)
        plan = (sdd.get("status") or {}).get("plan") or {}
        assert plan, f"no status.plan yet; status: {json.dumps(sdd.get('status'))}"
        return plan

    summary = wait_for(planned, timeout_s=90, what=f"status.plan of {name}")
    if int(summary.get("nodes") or 1) > 1:
        # A group of nodes runs as a LeaderWorkerSet, which this cluster does not serve: the
        # resource says so and how to install it, and nothing is applied.
        sdd = cluster.kubectl_json("-n", ns, "get", "sdd", name)
        ready = [c for c in sdd["status"]["conditions"] if c["type"] == "Ready"][0]
        assert ready["reason"] == "LeaderWorkerSetMissing" and "kubectl apply" in ready["message"], ready
        assert summary["nodes"] == examples.commented_plan(path)["nodes"]
        return
    # status.plan is the summary for people; the byte-level plan is the engine ConfigMap's plan.json.
    config_map = cluster.kubectl_json("-n", ns, "get", "configmap", config_map_name(name))
    plan = json.loads(config_map["data"]["plan.json"])
    assert summary["maxTotalTokens"] == plan["max_total_tokens"]
    for dotted, value in examples.commented_plan(path).items():
        got: Any = plan
        for part in dotted.split("."):
            got = got[part]
        assert got == value, f"{path.name}: plan.json {dotted} = {got}, the example's comment says {value}"
        if "." not in dotted and camel_case(dotted) in summary:
            assert summary[camel_case(dotted)] == value, f"{path.name}: status.plan {dotted} = {summary[camel_case(dotted)]}"

    deploy = wait_for(
        lambda: cluster.kubectl_json("-n", ns, "get", "deployment", name), timeout_s=30, what=f"deployment {name}"
    )
    (container,) = deploy["spec"]["template"]["spec"]["containers"]
    assert container["image"] == engine_image
    if "cpu" in examples.load_sdd(path)["spec"]:
        # CPU mode: no GPU asked for, no GPU node required.
        assert "nvidia.com/gpu" not in json.dumps(deploy["spec"]["template"]["spec"])
        assert plan["tensor_parallel_size"] == 1
    else:
        assert int(container["resources"]["limits"]["nvidia.com/gpu"]) == plan["tensor_parallel_size"]
    owner = deploy["metadata"]["ownerReferences"][0]
    assert (owner["kind"], owner["name"]) == ("SpecDecodeDeployment", name)
    cluster.kubectl("-n", ns, "get", "service", name)
    cluster.kubectl("-n", ns, "get", "configmap", f"{name}-engine")
    if not must_be_ready:
        return
    # kwok runs the engine pods on the fake nodes; the operator folds that into status.
    wait_for(
        lambda: cluster.kubectl_json("-n", ns, "get", "sdd", name)["status"].get("phase") == "Ready",
        timeout_s=90, what=f"{name} phase Ready",
    )


# ---- upgrade and uninstall --------------------------------------------------------------------


def _replica_sets(cluster: KubeCluster, ns: str, release: str) -> dict[str, int]:
    """pod-template-hash -> desired replicas of the operator's ReplicaSets."""
    items = cluster.kubectl_json("get", "replicasets", "-n", ns, "-l", f"{INSTANCE_LABEL}={release}")["items"]
    return {rs["metadata"]["labels"]["pod-template-hash"]: rs["spec"]["replicas"] for rs in items}


def test_upgrade_with_a_changed_value_rolls_the_operator(kube_cluster, kube_namespace, crd):
    ns, release = kube_namespace, _release("up")
    # The API server's PodSecurity admission refuses any operator pod that is not `restricted`:
    # the rollouts below succeed only if the chart's pod passes.
    kube_cluster.kubectl("label", "namespace", ns, "pod-security.kubernetes.io/enforce=restricted")
    helm_install(kube_cluster, release, ns)
    try:
        name = operator_deployment(kube_cluster, release, ns)["metadata"]["name"]
        kube_cluster.kubectl("-n", ns, "rollout", "status", f"deployment/{name}", "--timeout=45s")
        before = _replica_sets(kube_cluster, ns, release)
        assert list(before.values()) == [1]

        # An unchanged upgrade renders the same pod template: nothing rolls.
        kube_cluster.helm("upgrade", release, str(CHART), "-n", ns, "--reuse-values")
        assert _replica_sets(kube_cluster, ns, release) == before

        kube_cluster.helm("upgrade", release, str(CHART), "-n", ns, "--reuse-values", "--set", "operator.logLevel=debug")
        kube_cluster.kubectl("-n", ns, "rollout", "status", f"deployment/{name}", "--timeout=45s")
        after = _replica_sets(kube_cluster, ns, release)
        (new_hash,) = set(after) - set(before)
        assert after[new_hash] == 1 and all(after[h] == 0 for h in before), after
        deploy = operator_deployment(kube_cluster, release, ns)
        assert "--verbose" in deploy["spec"]["template"]["spec"]["containers"][0]["args"]
        assert deploy["spec"]["strategy"]["type"] == "Recreate"
        assert kube_cluster.helm("history", release, "-n", ns, "-o", "json").stdout.count('"revision"') == 3
    finally:
        kube_cluster.helm("uninstall", release, "-n", ns, check=False)


NAMESPACED_KINDS = "serviceaccounts,roles,rolebindings,deployments,replicasets,pods,configmaps,secrets,services"
CLUSTER_KINDS = "clusterroles,clusterrolebindings"


@pytest.mark.parametrize("mode", ["namespaces", "cluster-wide"])
def test_uninstall_leaves_no_orphans(kube_cluster, kube_namespace, crd, mode):
    ns, release = kube_namespace, _release("un")
    served = f"{ns}-served"
    kube_cluster.kubectl("create", "namespace", served)
    try:
        values = [f"watch.namespaces={{{ns},{served}}}"] if mode == "namespaces" else ["watch.clusterWide=true"]
        helm_install(kube_cluster, release, ns, *values)
        selector = f"{INSTANCE_LABEL}={release}"

        def leftovers() -> list[str]:
            found = kube_cluster.kubectl_json("get", NAMESPACED_KINDS, "-A", "-l", selector)["items"]
            found += kube_cluster.kubectl_json("get", CLUSTER_KINDS, "-l", selector)["items"]
            return [f"{o['kind']} {o['metadata'].get('namespace', '')}/{o['metadata']['name']}" for o in found]

        installed = leftovers()
        kinds = {entry.split()[0] for entry in installed}
        assert {"ServiceAccount", "Deployment", "ClusterRole", "ClusterRoleBinding"} <= kinds
        if mode == "namespaces":
            assert any(e.startswith(f"Role {served}/") for e in installed), installed
            assert any(e.startswith(f"RoleBinding {served}/") for e in installed), installed
            # The operator may work in the served namespace but not in one it does not serve.
            sa = operator_deployment(kube_cluster, release, ns)["spec"]["template"]["spec"]["serviceAccountName"]
            subject = f"system:serviceaccount:{ns}:{sa}"
            assert can_i(kube_cluster, subject, "patch", "deployments", "-n", served)
            assert not can_i(kube_cluster, subject, "patch", "deployments", "-n", "default")
        else:
            assert not any(e.startswith("Role") for e in installed), installed

        kube_cluster.helm("uninstall", release, "-n", ns, "--wait")
        # ReplicaSets and pods go by garbage collection, shortly after their Deployment.
        wait_for(lambda: not leftovers(), timeout_s=90, what=f"no objects of release {release}")
        # Helm never deletes crds/: the SpecDecodeDeployments survive an uninstall.
        kube_cluster.kubectl("get", "crd", crd)
    finally:
        kube_cluster.helm("uninstall", release, "-n", ns, check=False)
        kube_cluster.kubectl("delete", "namespace", served, "--wait=false", "--ignore-not-found", check=False)
