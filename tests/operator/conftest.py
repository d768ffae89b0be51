"""Fixtures for the operator's end-to-end tests on the real control plane (tests/cluster):
the CRD installed, a local HTTP server as the model hub, and the operator itself, either
in-process (a thread running `specdeploy.operator.cli.run`, as `specdeploy operator` does) or as a
`specdeploy operator` subprocess that a test can kill outright."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Iterator

# Imported before any test sets KUBECONFIG, as in a full session: the operator must read
# KUBECONFIG when it starts, not rely on the client's import-time default.
import kubernetes.config  # noqa: F401
import pytest
import yaml
from demo_pair import TINY_CPU_DEMO, build_demo_pair
from local_node import local_node
from testcluster import KubeCluster, wait_for

from specdeploy.localcluster.kubelet import LocalKubelet
from specdeploy.operator import cli as operator_cli

REPO = Path(__file__).resolve().parents[2]
CRD_PATH = REPO / "manifests" / "crd" / "specdeploy.dev_specdecodedeployments.yaml"
CONFIGS = REPO / "tests" / "configs"
HUB_TOKEN = "hf_test_token"

# model id -> config file served at {hub}/{model}/resolve/main/config.json
HUB_MODELS = {
    "meta-llama/Llama-3.3-70B-Instruct": "llama-3.3-70b-instruct.json",
    "meta-llama/Llama-3.1-8B-Instruct": "llama-3.1-8b-instruct.json",
    "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B": "eagle3-llama3.1-instruct-8b.json",
    "yuhuili/EAGLE3-LLaMA3.3-Instruct-70B": "eagle3-llama3.3-instruct-70b.json",
}


def model_config(model: str) -> dict[str, Any]:
    return json.loads((CONFIGS / HUB_MODELS[model]).read_text())


# A compressed-tensors FP8 checkpoint (per-channel e4m3, as RedHatAI publishes Llama-3.3-70B in
# FP8): config.json, the index and real-format shard headers (weights never materialised, served
# with HTTP Range as the hub does), for the operator to count its real bytes.
FP8_70B = "RedHatAI/Llama-3.3-70B-Instruct-FP8-dynamic"


def fp8_70b_files() -> dict[str, Any]:
    from checkpoint_hub import VirtualSafetensors, sharded_checkpoint

    config = model_config("meta-llama/Llama-3.3-70B-Instruct")
    config["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
        "config_groups": {"group_0": {"targets": ["Linear"],
                                      "weights": {"num_bits": 8, "type": "float", "strategy": "channel"},
                                      "input_activations": {"num_bits": 8, "type": "float", "dynamic": True}}}}
    h, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    kv = config["num_key_value_heads"] * config.get("head_dim", h // config["num_attention_heads"])
    groups = []
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}"
        layer = [(f"{p}.input_layernorm.weight", "BF16", (h,)), (f"{p}.post_attention_layernorm.weight", "BF16", (h,))]
        for name, out, inp in (("self_attn.q_proj", h, h), ("self_attn.k_proj", kv, h), ("self_attn.v_proj", kv, h),
                               ("self_attn.o_proj", h, h), ("mlp.gate_proj", inter, h), ("mlp.up_proj", inter, h),
                               ("mlp.down_proj", h, inter)):
            layer += [(f"{p}.{name}.weight", "F8_E4M3", (out, inp)), (f"{p}.{name}.weight_scale", "BF16", (out, 1))]
        groups.append(layer)
    groups.append([("model.embed_tokens.weight", "BF16", (vocab, h)), ("model.norm.weight", "BF16", (h,)),
                   ("lm_head.weight", "BF16", (vocab, h))])
    files = sharded_checkpoint(groups, per_shard=6)
    files["config.json"] = json.dumps(config).encode()
    files["payload_bytes"] = sum(f.payload_bytes for f in files.values() if isinstance(f, VirtualSafetensors))
    return files


HUB_FILES: dict[str, Any] = {}  # FP8_70B's files, filled by the hub_url fixture


class _HubHandler(BaseHTTPRequestHandler):
    """A Hugging Face-compatible hub: every model needs the bearer token (as gated models do)."""

    def do_GET(self) -> None:  # noqa: N802
        path = urllib.parse.unquote(self.path)
        code, body = 404, b"not found"
        if self.headers.get("Authorization") != f"Bearer {HUB_TOKEN}":
            code, body = 401, b"unauthorized"
        else:
            for model, filename in HUB_MODELS.items():
                if path == f"/{model}/resolve/main/config.json":
                    code, body = 200, (CONFIGS / filename).read_bytes()
            prefix = f"/{FP8_70B}/resolve/main/"
            name = path[len(prefix):] if path.startswith(prefix) else None
            if name in HUB_FILES and name != "payload_bytes":
                content = HUB_FILES[name]
                if isinstance(content, bytes):
                    code, body = 200, content
                else:  # a shard: its header and zeros, by Range
                    first, _, last = (self.headers.get("Range") or "bytes=0-").removeprefix("bytes=").partition("-")
                    start, end = int(first), min(int(last) + 1 if last else content.size, content.size)
                    code, body = 206, content.read(start, end)
        self.send_response(code)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="session")
def hub_url() -> Iterator[str]:
    HUB_FILES.update(fp8_70b_files())
    server = ThreadingHTTPServer(("127.0.0.1", 0), _HubHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def example() -> dict:
    """manifests/examples/tiny-cpu-demo.yaml."""
    return yaml.safe_load(TINY_CPU_DEMO.read_text())


@pytest.fixture(scope="module")
def demo_pair(tmp_path_factory, example) -> Path:
    """What the engine image holds at /opt/specdeploy/demo: target/ (with its tokenizer) and draft/,
    whose config.json files are the example's inline configs, byte for byte the same fields."""
    return build_demo_pair(tmp_path_factory.mktemp("image") / "demo", example)


@pytest.fixture
def local_kubelet(kube_cluster, demo_pair, tmp_path) -> Iterator[LocalKubelet]:
    with local_node(kube_cluster, tmp_path / "kubelet", demo_pair) as kubelet:
        yield kubelet


@pytest.fixture(scope="session")
def crd(kube_cluster: KubeCluster) -> str:
    kube_cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CRD_PATH))
    name = yaml.safe_load(CRD_PATH.read_text())["metadata"]["name"]
    kube_cluster.kubectl("wait", "--for=condition=Established", f"crd/{name}", "--timeout=60s")
    # Established comes a moment before the storage serves lists; operators started earlier retry.
    wait_for(lambda: kube_cluster.kubectl("get", "sdd", "-A", check=False).returncode == 0, timeout_s=30, what="sdd storage")
    return name


class OperatorThread:
    """The operator in-process, watching one namespace; start() returns once kopf is ready."""

    def __init__(self, namespace: str, hub_endpoint: str) -> None:
        self.namespace = namespace
        self.hub_endpoint = hub_endpoint
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None

    def _run(self) -> None:
        try:
            operator_cli.run(
                engine_image="registry.local/specdeploy-engine:test",
                hub_endpoint=self.hub_endpoint,
                namespaces=[self.namespace],
                stop_flag=self.stop_flag,
                ready_flag=self.ready_flag,
                # Retry transient failures quickly so tests need not wait 30 s.
                transient_retry_delay_s=2,
            )
        except BaseException as exc:  # noqa: BLE001 - reported by stop()
            self.error = exc

    def start(self) -> "OperatorThread":
        self.stop_flag, self.ready_flag = threading.Event(), threading.Event()
        self.thread = threading.Thread(target=self._run, name="specdeploy-operator", daemon=True)
        self.thread.start()
        assert self.ready_flag.wait(60), f"operator did not become ready: {self.error!r}"
        return self

    def stop(self) -> None:
        if self.thread is None:
            return
        self.stop_flag.set()
        self.thread.join(60)
        assert not self.thread.is_alive(), "operator did not stop within 60 s"
        self.thread = None
        assert self.error is None, f"operator crashed: {self.error!r}"


@pytest.fixture
def operator(kube_cluster: KubeCluster, kube_namespace: str, crd: str, hub_url: str, monkeypatch) -> Iterator[OperatorThread]:
    monkeypatch.setenv("KUBECONFIG", str(kube_cluster.kubeconfig))
    runner = OperatorThread(kube_namespace, hub_url).start()
    yield runner
    runner.stop()


class OperatorProcess:
    """`specdeploy operator` as a child process, so that a test can SIGKILL it mid-way."""

    def __init__(
        self, cluster: KubeCluster, namespace: str, hub_endpoint: str, log_path: Path,
        liveness_port: int = 0, kubeconfig: Path | None = None, metrics_interval_s: float = 30,
        trusted_hub_endpoints: tuple[str, ...] = (),
    ) -> None:
        self.liveness_port = liveness_port
        self.cmd = [
            sys.executable, "-P", "-m", "specdeploy.cli", "operator", "--namespace", namespace,
            "--hub-endpoint", hub_endpoint, "--engine-image", "registry.local/specdeploy-engine:test",
            "--liveness-port", str(liveness_port), "--metrics-interval-s", str(metrics_interval_s),
            *(arg for e in trusted_hub_endpoints for arg in ("--trusted-hub-endpoint", e)),
        ]
        self.env = {**cluster.env, "PYTHONUNBUFFERED": "1"}
        if kubeconfig is not None:
            self.env["KUBECONFIG"] = str(kubeconfig)
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None

    def start(self) -> "OperatorProcess":
        self.log = self.log_path.open("ab")
        self.proc = subprocess.Popen(self.cmd, env=self.env, stdout=self.log, stderr=subprocess.STDOUT)
        return self

    def kill(self) -> None:
        assert self.proc is not None and self.proc.poll() is None, self.logs()
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)
        self.log.close()

    def logs(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


def sdd_manifest(name: str, **spec_overrides: Any) -> dict[str, Any]:
    """A 70B Llama with an EAGLE-3 head, configs from the hub (with a token), on H200s."""
    spec: dict[str, Any] = {
        "target": {"model": "meta-llama/Llama-3.3-70B-Instruct"},
        "draft": {"model": "yuhuili/EAGLE3-LLaMA3.3-Instruct-70B"},
        "speculative": {"algorithm": "EAGLE3", "numSteps": 3, "topk": 1, "numDraftTokens": 4},
        "engine": {"maxRunningRequests": 32, "contextLength": 8192},
        "gpu": {"product": "h200"},
        "hub": {"tokenSecretRef": {"name": "hub-token"}},
        "replicas": 2,
    }
    spec.update(spec_overrides)
    return {
        "apiVersion": "specdeploy.dev/v1alpha1",
        "kind": "SpecDecodeDeployment",
        "metadata": {"name": name},
        "spec": spec,
    }


def token_secret() -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": "hub-token"},
        "stringData": {"token": HUB_TOKEN},
    }


class Sdd:
    """Reads one SpecDecodeDeployment and its children through kubectl."""

    def __init__(self, cluster: KubeCluster, namespace: str, name: str) -> None:
        self.cluster, self.namespace, self.name = cluster, namespace, name

    def get(self) -> dict[str, Any]:
        return self.cluster.kubectl_json("get", "sdd", self.name, "-n", self.namespace)

    def status(self) -> dict[str, Any]:
        return self.get().get("status") or {}

    def condition(self, type_: str) -> dict[str, Any]:
        for c in self.status().get("conditions") or []:
            if c["type"] == type_:
                return c
        return {}

    def items(self, kind: str, *selector: str) -> list[dict[str, Any]]:
        args = ["get", kind, "-n", self.namespace, *selector]
        return self.cluster.kubectl_json(*args)["items"]

    def owned(self, kind: str) -> list[dict[str, Any]]:
        return self.items(kind, "-l", f"app.kubernetes.io/instance={self.name}")

    def deployment(self) -> dict[str, Any] | None:
        found = self.items("deployments", "--field-selector", f"metadata.name={self.name}")
        return found[0] if found else None

    def wait_ready(self, timeout_s: float = 60) -> dict[str, Any]:
        def ready() -> dict[str, Any] | None:
            st = self.status()
            ok = (
                st.get("phase") == "Ready"
                and st.get("observedGeneration") == self.get()["metadata"]["generation"]
                and self.condition("Ready").get("status") == "True"
            )
            return st if ok else None

        return wait_for(ready, timeout_s=timeout_s, what=f"sdd {self.name} Ready")

    def events(self) -> list[dict[str, Any]]:
        return self.items("events", "--field-selector", f"involvedObject.name={self.name},involvedObject.kind=SpecDecodeDeployment")

    def pods(self) -> list[dict[str, Any]]:
        return self.owned("pods")


def running_pods(sdd: Sdd) -> list[dict[str, Any]]:
    return [p for p in sdd.pods() if p["status"].get("phase") == "Running" and not p["metadata"].get("deletionTimestamp")]



@pytest.fixture
def operator_process(kube_cluster: KubeCluster, kube_namespace: str, crd: str, hub_url: str, tmp_path: Path):
    """operator_process() -> a started `specdeploy operator` child process (killed at teardown)."""
    started: list[OperatorProcess] = []

    def start(**kwargs: Any) -> OperatorProcess:
        log_path = tmp_path / f"operator-{len(started)}.log"
        proc = OperatorProcess(kube_cluster, kube_namespace, hub_url, log_path, **kwargs).start()
        started.append(proc)
        return proc

    yield start
    for proc in started:
        if proc.proc is not None and proc.proc.poll() is None:
            proc.kill()


@pytest.fixture
def sdd_of(kube_cluster: KubeCluster, kube_namespace: str):
    """sdd_of(name) -> Sdd reader in the test's namespace."""
    return lambda name: Sdd(kube_cluster, kube_namespace, name)


@pytest.fixture
def manifest():
    """manifest(name, **spec_overrides) -> a SpecDecodeDeployment dict."""
    return sdd_manifest


@pytest.fixture
def hub_secret(kube_cluster: KubeCluster, kube_namespace: str) -> None:
    kube_cluster.apply(token_secret(), namespace=kube_namespace)
