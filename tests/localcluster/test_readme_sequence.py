"""The README's "A local cluster" commands, run exactly as written, one line after another in a
shell whose environment carries over (the `eval "$(specdeploy cluster env)"` line sets it), and
checked as a user would read them: the operator's log lines, `kubectl get sdd` filled from the
live engine, the engine's `kubectl logs`, a completion through the Service (the README's curl and
the `openai` client), and `down` leaving nothing of the cluster on the machine.

The harness adds only waits and checks between the lines: after a line ending in `&` it waits for
the port it forwards; before `kubectl get sdd` it sends completions through the Service until the
operator's next scrape has seen them (the chart's interval is 30 s).
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest
from local_cluster_cli import leftovers, specdeploy  # tests/support
from testcluster import wait_for

from specdeploy.localcluster import cluster as local_cluster

REPO = Path(__file__).resolve().parents[2]
FORWARDED_PORT = 8000


def readme_commands() -> list[str]:
    """The shell lines of the README's first code block under '### A local cluster'."""
    text = (REPO / "README.md").read_text()
    section = text[text.index("### A local cluster"):]
    block = re.search(r"```sh\n(.*?)```", section, re.S).group(1)
    return [line.strip() for line in block.splitlines() if line.strip()]


def test_readme_names_the_sequence():
    lines = readme_commands()
    assert lines[0].startswith("specdeploy cluster up") and lines[-1].startswith("specdeploy cluster down")
    assert any(line.startswith("helm install specdeploy charts/specdeploy") for line in lines)
    assert any("manifests/examples/tiny-cpu-demo.yaml" in line for line in lines)


class Shell:
    """Runs one line at a time with bash; the environment a line leaves is the next one's."""

    def __init__(self, env: dict[str, str]):
        self.env = dict(env)
        self.background: list[subprocess.Popen] = []

    def run(self, line: str, timeout_s: float = 360) -> str:
        if line.endswith("&"):
            proc = subprocess.Popen(["bash", "-c", "exec " + line[:-1].split("#")[0]], env=self.env, cwd=REPO,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            self.background.append(proc)
            return ""
        script = f"set -e\n{line}\nenv -0 > \"$SPECDEPLOY_TEST_ENV\"\n"
        env_file = Path(self.env["XDG_STATE_HOME"]).parent / "shell.env"
        result = subprocess.run(["bash", "-c", script], env={**self.env, "SPECDEPLOY_TEST_ENV": str(env_file)},
                                cwd=REPO, capture_output=True, text=True, timeout=timeout_s, stdin=subprocess.DEVNULL)
        assert result.returncode == 0, f"`{line}` exited {result.returncode}:\n{result.stdout}\n{result.stderr}"
        self.env = dict(kv.split("=", 1) for kv in env_file.read_text().split("\0") if "=" in kv)
        self.env.pop("SPECDEPLOY_TEST_ENV", None)
        return result.stdout + result.stderr

    def close(self) -> None:
        for proc in self.background:
            proc.terminate()
            proc.wait(10)


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def _sdd_serving(shell: Shell) -> dict:
    out = subprocess.run(["kubectl", "get", "sdd", "tiny-cpu-demo", "-n", "specdeploy", "-o", "json"], env=shell.env,
                         capture_output=True, text=True, timeout=30)
    return json.loads(out.stdout).get("status", {}).get("serving") or {}


def _traffic_until_scraped(shell: Shell) -> int:
    """openai-client completions through the forwarded Service until status.serving shows them."""
    import openai

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{FORWARDED_PORT}/v1", api_key="unused", max_retries=0, timeout=60)
    (model,) = [m.id for m in client.models.list().data]
    assert model == "/opt/specdeploy/demo/target"  # the image's path, as the container sees it
    done, completed = threading.Event(), []

    def load() -> None:
        while not done.is_set():
            out = client.completions.create(model=model, prompt="def fibonacci(n):", max_tokens=48,
                                            extra_body={"ignore_eos": True})
            completed.append(out.usage.completion_tokens)

    worker = threading.Thread(target=load, daemon=True)
    worker.start()
    try:
        wait_for(lambda: (s := _sdd_serving(shell)).get("meanAcceptLength", 0) > 1 and s.get("tokensPerSecond", 0) > 0,
                 timeout_s=120, interval_s=1, what="the accept length and tok/s scraped into status.serving")
    finally:
        done.set()
        worker.join(60)
    assert completed and all(n == 48 for n in completed)
    return len(completed)


def test_the_readme_local_cluster_commands_verbatim(cluster_env, capsys):
    if _port_open(FORWARDED_PORT) or local_cluster.port_in_use("127.0.0.1", 6443):
        pytest.fail(f"ports {FORWARDED_PORT} and 6443, which the README's commands use, must be free on this machine")
    shell = Shell(cluster_env)
    state_dir = Path(cluster_env["XDG_STATE_HOME"]) / "specdeploy" / "clusters" / "local"
    outputs: dict[str, str] = {}
    t0 = time.monotonic()
    try:
        for line in readme_commands():
            command = line.split("#")[0].strip() if not line.startswith("curl") else line
            if command.startswith("kubectl get sdd"):
                _traffic_until_scraped(shell)
            outputs[command] = out = shell.run(line)
            if line.endswith("&"):
                wait_for(lambda: _port_open(FORWARDED_PORT), timeout_s=30, what=f"kubectl port-forward on :{FORWARDED_PORT}")
            elif command.startswith("specdeploy cluster up"):
                assert f"export KUBECONFIG={state_dir}/kubeconfig PATH={state_dir}/bin:$PATH" in out
                assert "pods in network namespaces on 10.213." in out
            elif command.startswith("eval"):
                assert shell.env["KUBECONFIG"] == str(state_dir / "kubeconfig")
                assert shell.env["PATH"].startswith(str(state_dir / "bin"))
            elif command.startswith("helm install"):
                assert "STATUS: deployed" in out
            elif command.startswith("kubectl wait"):
                assert "condition met" in out
            elif command.startswith("curl"):
                answer = json.loads(out)
                assert answer["model"] == "/opt/specdeploy/demo/target" and answer["usage"]["completion_tokens"] == 32
            elif command.startswith("kubectl get sdd"):
                header, row = out.strip().splitlines()
                columns = dict(zip(["NAME", "READY", "PHASE", "GPUS", "MAX", "ACCEPT", "TOK/S"], row.split()))
                assert "ACCEPT LENGTH" in header and "TOK/S" in header
                assert columns["READY"] == "True" and columns["PHASE"] == "Ready" and columns["GPUS"] == "0"
                assert float(columns["ACCEPT"]) > 1 and float(columns["TOK/S"]) > 0
                with capsys.disabled():
                    print("\n" + out)
            elif command.startswith("kubectl logs -n specdeploy deploy/specdeploy"):
                # The operator ran from its pod spec (no fake container) and logged its decisions.
                assert "starting: namespaces specdeploy" in out
                assert "[specdeploy/tiny-cpu-demo] planned from spec.target.config" in out
                assert "[specdeploy/tiny-cpu-demo] status: phase Deploying -> Ready" in out
                assert "Traceback" not in out
            elif command.startswith("kubectl logs -n specdeploy deploy/tiny-cpu-demo"):
                assert "engine ready:" in out and "ready: serving /opt/specdeploy/demo/target" in out
            elif command.startswith("specdeploy cluster down"):
                assert "cluster local removed" in out
    except AssertionError as err:
        raise AssertionError(f"{err}\n--- what the cluster shows:\n{_diagnostics(shell, state_dir)}") from None
    finally:
        shell.close()
        if state_dir.exists():
            specdeploy(cluster_env, "cluster", "down")
    # Nothing of the cluster is left: no process, namespace, interface, mount or directory.
    assert not state_dir.exists()
    assert leftovers(cluster_env, "local") == []
    with capsys.disabled():
        print(f"README sequence in {time.monotonic() - t0:.0f} s")



def _diagnostics(shell: Shell, state_dir: Path) -> str:
    out = []
    for args in (["get", "sdd,deploy,pods,events", "-A", "-o", "wide"], ["logs", "-n", "specdeploy", "deploy/specdeploy", "--tail=30"]):
        result = subprocess.run(["kubectl", *args], env=shell.env, capture_output=True, text=True, timeout=30)
        out.append(f"$ kubectl {' '.join(args)}\n{result.stdout}{result.stderr}")
    node_log = state_dir / "logs" / "node.log"
    if node_log.exists():
        out.append("--- node log\n" + "\n".join(node_log.read_text(errors="replace").splitlines()[-40:]))
    return "\n".join(out)
