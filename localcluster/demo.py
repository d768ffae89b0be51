"""`specdeploy demo`: the product's main job on this machine, through the operator.

1. the tiny demo pair (trained here the first time, cached: what the engine image holds at
   /opt/specdeploy/demo);
2. a local cluster (`specdeploy cluster up`; the first run builds the control-plane tools);
3. the operator from the Helm chart, run by the local node from its pod spec;
4. manifests/examples/tiny-cpu-demo.yaml, until the operator reports it Ready;
5. completions through its Service (`kubectl port-forward`), until `kubectl get sdd` shows the
   accept length and tok/s the operator reads from the live engine;
then the commands to look further. The cluster stays up unless --down. `--engine-only` is the
engine on its own, without Kubernetes (`engine/demo/cli.py`).

Only the standard library at the top (the parser is built for every subcommand).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from specdeploy.engine.demo import cli as engine_demo

NAMESPACE = "specdeploy"
RELEASE = "specdeploy"
EXAMPLE = "tiny-cpu-demo"
READY_TIMEOUT_S = 300.0
# The operator reads engines' /metrics this often in the demo (the chart's default is 30 s).
DEMO_METRICS_INTERVAL_S = 3
CLUSTER_EXTRA_MODULES = ("kubernetes", "yaml", "cryptography", "kopf", "httpx")


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = engine_demo.add_parser(subparsers)
    p.description = __doc__.splitlines()[0]
    p.help = "the operator end to end on a local cluster (--engine-only: the engine alone)"
    p.add_argument("--engine-only", action="store_true",
                   help="the engine alone on a loopback port, no Kubernetes (the previous demo)")
    p.add_argument("--down", action="store_true", help="remove the local cluster at the end")
    p.add_argument("--cluster-name", default="local", help="local cluster to use or create (default %(default)s)")
    p.set_defaults(func=run)
    return p


def say(line: str = "") -> None:
    print(line, flush=True)


def run(args: argparse.Namespace) -> int:
    if args.engine_only:
        return engine_demo.run(args)
    missing = [m for m in CLUSTER_EXTRA_MODULES if not _importable(m)]
    if missing:
        print(f"specdeploy demo: the local cluster needs the cluster extra ({', '.join(missing)} not installed): "
              "pip install -e '.[engine,cluster]' (or run `specdeploy demo --engine-only`)", file=sys.stderr)
        return 2
    from .cluster import ClusterError

    try:
        return _run(args)
    except (ClusterError, TimeoutError, subprocess.CalledProcessError) as err:
        print(f"specdeploy demo: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("specdeploy demo: interrupted (the cluster is left as it is; `specdeploy cluster down` removes it)",
              file=sys.stderr)
        return 130


def _importable(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


class Kube:
    """kubectl and helm of the local cluster, as the user runs them (the printed export line)."""

    def __init__(self, layout) -> None:
        self.env = dict(os.environ, KUBECONFIG=str(layout.kubeconfig),
                        PATH=f"{layout.bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")
        self.layout = layout

    def run(self, *argv: str, check: bool = True, timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(list(argv), env=self.env, capture_output=True, text=True, timeout=timeout_s,
                                stdin=subprocess.DEVNULL, cwd=_repo_root())
        if check and result.returncode != 0:
            raise subprocess.CalledProcessError(result.returncode, " ".join(argv), result.stdout,
                                                result.stderr) from None
        return result

    def json(self, *argv: str) -> Any:
        return json.loads(self.run("kubectl", *argv, "-o", "json").stdout)


def _repo_root() -> Path:
    from .tools import REPO_ROOT

    return REPO_ROOT


def _wait(predicate, timeout_s: float, what: str, interval_s: float = 0.5, progress=None):
    """Poll `predicate`; `progress()` -> (state, line): the line is shown whenever the state changes."""
    deadline = time.monotonic() + timeout_s
    last_state = None
    while True:
        value = predicate()
        if value:
            return value
        if progress is not None:
            state, line = progress()
            if state != last_state:
                say(f"  {line}")
                last_state = state
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(interval_s)


def _run(args: argparse.Namespace) -> int:
    from . import cluster
    from .state import DEFAULT_APISERVER_PORT

    t0 = time.monotonic()
    say("specdeploy demo: the operator on a local Kubernetes cluster (real control plane, a node that runs")
    say("pods as local processes), serving the tiny demo pair through its Service. Nothing is downloaded.")
    say()
    say("[1/5] models: the tiny target + EAGLE draft the engine image holds at /opt/specdeploy/demo")
    recipe = engine_demo.Recipe(target_steps=args.target_steps, target_train_s=args.target_train_s,
                                draft_steps=args.draft_steps, draft_train_s=args.draft_train_s)
    engine_demo.ensure_models(args.cache_dir or engine_demo.default_cache_dir(), recipe, retrain=args.retrain)
    image_paths = {"/opt/specdeploy/demo": str(args.cache_dir or engine_demo.default_cache_dir())}

    say()
    say("[2/5] cluster: specdeploy cluster up")
    layout = cluster.up(args.cluster_name, DEFAULT_APISERVER_PORT, lambda line: say(f"  {line}"),
                        image_paths=image_paths)
    kube = Kube(layout)

    say()
    say(f"[3/5] operator: helm upgrade --install {RELEASE} charts/specdeploy --namespace {NAMESPACE} --create-namespace")
    kube.run("helm", "upgrade", "--install", RELEASE, "charts/specdeploy", "--namespace", NAMESPACE, "--create-namespace",
             "--set-json", f'operator.extraArgs=["--metrics-interval-s={DEMO_METRICS_INTERVAL_S}"]', timeout_s=180)
    kube.run("kubectl", "rollout", "status", f"deployment/{RELEASE}", "-n", NAMESPACE, "--timeout=120s", timeout_s=130)
    # Its own first line (kopf's start-up bookkeeping is not logged at INFO).
    _wait(lambda: "starting:" in _operator_log(kube), 60, "the operator to start")
    say(f"  operator running: {_first_line(_operator_log(kube))}")

    say()
    say(f"[4/5] model: kubectl apply -n {NAMESPACE} -f manifests/examples/{EXAMPLE}.yaml")
    kube.run("kubectl", "apply", "-n", NAMESPACE, "-f", f"manifests/examples/{EXAMPLE}.yaml")
    started = time.monotonic()
    _wait(lambda: _sdd(kube).get("phase") == "Ready", READY_TIMEOUT_S, f"{EXAMPLE} to become Ready",
          progress=lambda: _phase_line(kube, started))
    say(f"  Ready after {time.monotonic() - started:.0f} s")

    say()
    say(f"[5/5] requests through its Service: kubectl port-forward -n {NAMESPACE} service/{EXAMPLE} PORT:8000")
    texts, table = _traffic(kube)
    for prompt, text in texts:
        say(f"  {prompt!r} -> {text!r}")
    say()
    for line in table.splitlines():
        say(f"  {line}")
    say()
    say(f"done in {time.monotonic() - t0:.0f} s. " + ("The cluster is removed now (--down); without --down it stays up "
                                                     "to look further with:" if args.down else
                                                     "The cluster is still running; look further with:"))
    say(f"  {layout.export_line()}")
    for command in (f"kubectl get sdd -n {NAMESPACE}", f"kubectl describe sdd {EXAMPLE} -n {NAMESPACE}",
                    f"kubectl logs -n {NAMESPACE} deploy/{RELEASE}", f"kubectl logs -n {NAMESPACE} deploy/{EXAMPLE} --tail=20",
                    f"kubectl port-forward -n {NAMESPACE} service/{EXAMPLE} 8000:8000",
                    "specdeploy cluster down"):
        say(f"  {command}")
    if args.down:
        cluster.down(args.cluster_name, lambda line: say(f"  {line}"))
    return 0


def _operator_log(kube: Kube) -> str:
    return kube.run("kubectl", "logs", "-n", NAMESPACE, f"deploy/{RELEASE}", check=False).stdout


def _first_line(text: str) -> str:
    return next((line for line in text.splitlines() if line.startswith("starting")), text.splitlines()[0] if text else "")


def _sdd(kube: Kube) -> dict[str, Any]:
    result = kube.run("kubectl", "get", "sdd", EXAMPLE, "-n", NAMESPACE, "-o", "json", check=False)
    return json.loads(result.stdout).get("status", {}) if result.returncode == 0 else {}


def _phase_line(kube: Kube, started: float) -> tuple[str, str]:
    status = _sdd(kube)
    pods = kube.run("kubectl", "get", "pods", "-n", NAMESPACE, "-l", f"app.kubernetes.io/instance={EXAMPLE}",
                    "--no-headers", check=False).stdout.split()
    pod = f", engine pod {pods[2]} {pods[1]} ready" if len(pods) >= 3 else ""
    state = f"phase {status.get('phase', '-')}{pod}"
    return state, f"{state} ({time.monotonic() - started:.0f} s)"


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _traffic(kube: Kube) -> tuple[list[tuple[str, str]], str]:
    """Completions through the Service until the operator shows the live accept length and tok/s."""
    import openai

    port = _free_port()
    forward = subprocess.Popen(["kubectl", "port-forward", "-n", NAMESPACE, f"service/{EXAMPLE}", f"{port}:8000"],
                               env=kube.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert forward.stdout is not None
        line = forward.stdout.readline()
        if "Forwarding from" not in line:
            raise TimeoutError(f"kubectl port-forward: {line.strip() or 'exited ' + str(forward.wait())}")
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=2, timeout=60)
        model = client.models.list().data[0].id
        texts = []
        # Sampled (seeded), as the engine-only demo does: greedy decoding of a model this small loops.
        for prompt in ("def fibonacci(n):\n", "class Scheduler:\n    def "):
            out = client.completions.create(model=model, prompt=prompt, max_tokens=32, temperature=0.7, top_p=0.95,
                                            seed=1)
            texts.append((prompt, out.choices[0].text))
        say(f"  model {model}: {len(texts)} completions answered; sending more until the operator reports them ...")
        done = threading.Event()

        def load() -> None:
            while not done.is_set():
                try:
                    client.completions.create(model=model, prompt="import os\n", max_tokens=48, temperature=0,
                                              extra_body={"ignore_eos": True})
                except openai.OpenAIError:
                    time.sleep(0.2)

        workers = [threading.Thread(target=load, daemon=True) for _ in range(2)]
        for w in workers:
            w.start()
        try:
            _wait(lambda: (s := _sdd(kube).get("serving") or {}).get("meanAcceptLength", 0) > 0
                  and s.get("tokensPerSecond", 0) > 0, 90, "the accept length and tok/s in status.serving")
        finally:
            done.set()
            for w in workers:
                w.join(60)
        table = kube.run("kubectl", "get", "sdd", "-n", NAMESPACE).stdout.strip()
        return texts, table
    finally:
        forward.terminate()
        forward.wait(10)
