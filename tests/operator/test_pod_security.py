"""The rendered engine pod runs with its own security settings: the Deployment the operator
renders for manifests/examples/tiny-cpu-demo.yaml, its command and environment run exactly as a
container runtime would run them under that securityContext -

- in a mount namespace of its own, chrooted into a read-only view of this machine's root (an
  overlay whose upper layer holds only the mount points, remounted read-only), in which only the
  pod's rendered volumes are writable: each emptyDir a fresh directory at its mountPath, the
  ConfigMap's files read-only at /etc/specdeploy, the image's demo pair read-only at
  /opt/specdeploy/demo;
- as runAsUser/runAsGroup with no supplementary groups, no_new_privs (allowPrivilegeEscalation:
  false) and every capability dropped from the bounding, inheritable and ambient sets;

- and it serves completions through the `openai` client. seccomp is the container runtime's own
  RuntimeDefault profile: it is rendered (and admitted by Pod Security in test_pods.py) but not
  reproduced here. Needs root on the test machine (mount namespaces, chroot).
"""

from __future__ import annotations

import json
import os
import random
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import yaml
from demo_pair import IMAGE_DEMO_DIR, build_demo_pair
from testcluster import wait_for

from specdeploy.operator.desired import render
from specdeploy.operator.desired.planning import plan_engine

REPO = Path(__file__).resolve().parents[2]
TINY_CPU_DEMO = REPO / "manifests" / "examples" / "tiny-cpu-demo.yaml"
DEFAULTS = render.EngineDefaults(image="registry.local/specdeploy-engine:test", hub_endpoint="https://hub.local")

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("setpriv"),
                                reason="needs root, unshare and setpriv (mount namespaces, chroot)")


def rendered_pod() -> tuple[dict, dict]:
    """(the engine pod spec, the ConfigMap's data) the operator renders for the example."""
    sdd = yaml.safe_load(TINY_CPU_DEMO.read_text())
    sdd["metadata"].update(namespace="demo", uid="0000")
    spec = sdd["spec"]
    planned = plan_engine(spec, spec["target"]["config"], spec["draft"]["config"])
    children = render.render_children(sdd, planned, DEFAULTS)
    return children.deployment["spec"]["template"]["spec"], children.config_map["data"]


class Sandbox:
    """One container of a pod spec run under its securityContext (module docstring)."""

    def __init__(self, pod: dict, config_data: dict[str, str], image_paths: dict[str, Path], workdir: Path):
        self.pod, self.container = pod, pod["containers"][0]
        self.workdir = workdir
        self.ip = f"127.{random.randint(1, 254)}.{random.randint(1, 254)}.{random.randint(2, 254)}"
        self.volumes: dict[str, Path] = {}  # mountPath -> host directory
        self.read_only: set[str] = set()
        for volume in pod["volumes"]:
            host = workdir / "volumes" / volume["name"]
            host.mkdir(parents=True)
            if "configMap" in volume:
                for key, text in config_data.items():
                    (host / key).write_text(text)
            # As the kubelet makes them: an emptyDir is world-writable; a ConfigMap readable.
            host.chmod(0o777 if "emptyDir" in volume else 0o755)
            for mount in self.container["volumeMounts"]:
                if mount["name"] == volume["name"]:
                    self.volumes[mount["mountPath"]] = host
                    if mount.get("readOnly") or "configMap" in volume:
                        self.read_only.add(mount["mountPath"])
        for path, host in image_paths.items():
            self.volumes[path] = host
            self.read_only.add(path)
        self.root = workdir / "root"
        self.proc: subprocess.Popen | None = None

    def _setpriv(self) -> list[str]:
        pod_context, context = self.pod["securityContext"], self.container["securityContext"]
        assert context["allowPrivilegeEscalation"] is False and context["capabilities"]["drop"] == ["ALL"]
        assert context["runAsNonRoot"] and pod_context["runAsUser"] != 0
        return ["setpriv", f"--reuid={pod_context['runAsUser']}", f"--regid={pod_context['runAsGroup']}",
                "--clear-groups", "--no-new-privs", "--inh-caps=-all", "--ambient-caps=-all", "--bounding-set=-all"]

    def script(self, argv: list[str], env: dict[str, str]) -> str:
        r = shlex.quote(str(self.root))
        layers = shlex.quote(str(self.workdir / "layers"))
        lines = [
            "set -e",
            f"mount -t tmpfs tmpfs {layers}",
            f"mkdir {layers}/up {layers}/work",
            f"mount -t overlay overlay -o lowerdir=/,upperdir={layers}/up,workdir={layers}/work {r}",
            *(f"mount --rbind /{d} {r}/{d}" for d in ("proc", "sys", "dev")),
        ]
        for path, host in sorted(self.volumes.items()):
            target = shlex.quote(f"{self.root}{path}")
            lines += [f"mkdir -p {target}", f"mount --bind {shlex.quote(str(host))} {target}"]
            if path in self.read_only:
                lines.append(f"mount -o remount,bind,ro {target}")
        # This environment and checkout may live under a path a pod volume covers in the view
        # (CI's venv and clone are under /tmp, the pod's emptyDir): bound back, read-only.
        for host in (Path(sys.prefix).resolve(), Path(__file__).resolve().parents[2]):
            if any(host.is_relative_to(path) for path in self.volumes):
                target = shlex.quote(f"{self.root}{host}")
                lines += [f"mkdir -p {target}", f"mount --bind {shlex.quote(str(host))} {target}",
                          f"mount -o remount,bind,ro {target}"]
        # The interpreter here may live under a home only root may enter (pyenv in /root); the
        # image's is in /opt/venv, open to all. Let the user through that directory of the view
        # (a copy-up into the overlay's upper layer: this machine's /root is not changed).
        interpreter = Path(os.path.realpath(sys.executable))
        for parent in reversed(interpreter.parents):
            lines.append(f"chmod o+x {shlex.quote(f'{self.root}{parent}')}")
        assert self.container["securityContext"]["readOnlyRootFilesystem"] is True
        lines.append(f"mount -o remount,ro {r}")
        command = ["chroot", str(self.root), *self._setpriv(), "env", "-i",
                   *(f"{k}={v}" for k, v in env.items()), *argv]
        lines.append("exec " + shlex.join(command))
        return "\n".join(lines)

    def env(self) -> dict[str, str]:
        env = {var["name"]: var["value"] for var in self.container["env"]}
        # What the image's PATH and installed package are here: this interpreter's environment.
        env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), "/usr/bin", "/bin"])
        if os.environ.get("PYTHONPATH"):
            env["PYTHONPATH"] = os.environ["PYTHONPATH"]
        return env

    def start(self) -> None:
        self.root.mkdir()
        (self.workdir / "layers").mkdir()
        argv = [*self.container["command"], *self.container["args"]]
        argv = [self.ip if a == "0.0.0.0" else a for a in argv]
        argv[0] = str(Path(sys.executable).parent / argv[0])
        self.log = (self.workdir / "engine.log").open("wb")
        self.proc = subprocess.Popen(["unshare", "-m", "--propagation", "private", "sh", "-c",
                                      self.script(argv, self.env())],
                                     stdout=self.log, stderr=subprocess.STDOUT)

    def run_inside(self, code: str) -> subprocess.CompletedProcess:
        """Python `code` run in the engine's mount namespace and root, as the engine's user."""
        assert self.proc is not None
        cmd = ["nsenter", "-t", str(self.proc.pid), "-m", "-r", "-w", *self._setpriv(),
               sys.executable, "-c", code]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=60)

    def logs(self) -> str:
        return (self.workdir / "engine.log").read_text(errors="replace")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()


@pytest.fixture(scope="module")
def demo_pair(tmp_path_factory) -> Path:
    root = build_demo_pair(tmp_path_factory.mktemp("image") / "demo", yaml.safe_load(TINY_CPU_DEMO.read_text()))
    for path in [root, *root.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)  # as Dockerfile.engine's chmod -R a+rX
    return root


def test_rendered_engine_pod_serves_as_non_root_on_a_read_only_root(demo_pair, tmp_path):
    from openai import OpenAI

    pod, config_data = rendered_pod()
    sandbox = Sandbox(pod, config_data, {IMAGE_DEMO_DIR: demo_pair}, tmp_path)
    sandbox.start()
    try:
        base_url = f"http://{sandbox.ip}:8000"
        wait_for(lambda: sandbox.proc.poll() is None and httpx.get(f"{base_url}/ready").status_code == 200
                 or sandbox.proc.poll() is not None, timeout_s=240, interval_s=1, what="the engine ready")
        assert sandbox.proc.poll() is None, sandbox.logs()[-4000:]

        client = OpenAI(base_url=f"{base_url}/v1", api_key="unused")
        (model,) = [m.id for m in client.models.list().data]
        completion = client.completions.create(model=model, prompt="def fibonacci(n):", max_tokens=16)
        assert completion.choices[0].text and completion.usage.completion_tokens > 0

        # The serving process: the rendered uid and gid, no groups, no capabilities, no_new_privs.
        uid = pod["securityContext"]["runAsUser"]
        # (unshare, sh, chroot, setpriv and env each exec the next: the pid is the server's.)
        server = Path(f"/proc/{sandbox.proc.pid}")
        assert b"serve" in (server / "cmdline").read_bytes().split(b"\0")
        status = dict(line.split(":", 1) for line in (server / "status").read_text().splitlines() if ":" in line)
        assert status["Uid"].split()[:2] == [str(uid), str(uid)]
        assert status["Gid"].split()[:2] == [str(pod["securityContext"]["runAsGroup"])] * 2
        assert status["Groups"].strip() == ""
        assert int(status["CapEff"], 16) == int(status["CapPrm"], 16) == int(status["CapBnd"], 16) == 0
        assert status["NoNewPrivs"].strip() == "1"

        # In its root: only the rendered writable volumes take writes.
        writable = sorted(m["mountPath"] for m in pod["containers"][0]["volumeMounts"] if not m.get("readOnly"))
        probe = sandbox.run_inside(
            "import json, os\n"
            "out = {}\n"
            f"for d in {json.dumps(writable + ['/', '/etc', '/opt/specdeploy/demo', '/etc/specdeploy', '/var/cache', '/home', '/work'])}:\n"
            "    try:\n"
            "        open(os.path.join(d, 'probe'), 'w').close(); out[d] = 'written'\n"
            "    except OSError as e:\n"
            "        out[d] = e.strerror\n"
            "print(json.dumps(out))\n")
        assert probe.returncode == 0, probe.stderr
        result = json.loads(probe.stdout)
        assert {d for d, r in result.items() if r == "written"} == set(writable) - {"/etc/specdeploy"}
        assert result["/"] == result["/work"] == "Read-only file system"
        assert result["/etc/specdeploy"] == result["/opt/specdeploy/demo"] == "Read-only file system"
        assert set(writable) >= {"/tmp", "/home/specdeploy", "/var/cache/huggingface", "/dev/shm"}
    finally:
        sandbox.stop()
    assert sandbox.proc.returncode is not None

