"""The control-plane binaries: found where hack/build-tools.sh caches them outside the repo, or
built there (from Go module packages; minutes the first time, then cached by version).

The versions live in hack/tools-versions.env of the source checkout, so the local cluster runs
from a clone (the README's set-up), not from a wheel.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

# realpath: the package may be reached through a symlink; the checkout is the folder above it.
REPO_ROOT = Path(os.path.realpath(__file__)).parents[1]
VERSIONS_FILE = REPO_ROOT / "hack" / "tools-versions.env"
BUILD_SCRIPT = REPO_ROOT / "hack" / "build-tools.sh"
BUILD_HINT = "run `make tools` (hack/build-tools.sh) to build them; the first build takes about 12 minutes on 2 cores"
GO_HINT = "building the Kubernetes control plane needs Go >= 1.26 on PATH (https://go.dev/dl, or your distribution's golang package)"


class ToolsMissing(RuntimeError):
    """The cached control-plane binaries are not there (or not executable)."""


def read_versions(path: Path = VERSIONS_FILE) -> dict[str, str]:
    """Parse the KEY=VALUE lines of hack/tools-versions.env."""
    versions: dict[str, str] = {}
    for lineno, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        m = re.fullmatch(r"([A-Z0-9_]+)=([A-Za-z0-9._+-]+)", line)
        if not m:
            raise ValueError(f"{path}:{lineno}: expected KEY=VALUE, got {raw!r}")
        versions[m.group(1)] = m.group(2)
    return versions


def tools_dir() -> Path:
    """Cache root, the same rule as hack/build-tools.sh."""
    env = os.environ.get("SPECDEPLOY_TOOLS_DIR")
    return Path(env) if env else Path.home() / ".cache" / "specdeploy" / "tools"


@dataclass(frozen=True)
class Tools:
    """Absolute paths of the cached binaries, and the versions they were built at."""

    kube_apiserver: Path
    kube_controller_manager: Path
    kube_scheduler: Path
    kubectl: Path
    etcd: Path
    kwok: Path
    kwokctl: Path
    helm: Path
    versions: dict[str, str]

    @property
    def kube_version(self) -> str:
        return self.versions["K8S_VERSION"]

    @classmethod
    def find(cls, root: Path | None = None) -> "Tools":
        """Return the cached tools, or raise ToolsMissing naming every missing binary."""
        root = root or tools_dir()
        v = read_versions()
        k8s = root / f"kubernetes-{v['K8S_VERSION']}"
        etcd = root / f"etcd-{v['ETCD_VERSION']}"
        kwok = root / f"kwok-{v['KWOK_VERSION']}"
        helm = root / f"helm-{v['HELM_VERSION']}"
        tools = cls(
            kube_apiserver=k8s / "kube-apiserver",
            kube_controller_manager=k8s / "kube-controller-manager",
            kube_scheduler=k8s / "kube-scheduler",
            kubectl=k8s / "kubectl",
            etcd=etcd / "etcd",
            kwok=kwok / "kwok",
            kwokctl=kwok / "kwokctl",
            helm=helm / "helm",
            versions=v,
        )
        missing = [str(p) for p in tools.binaries() if not os.access(p, os.X_OK)]
        if missing:
            raise ToolsMissing(
                "Kubernetes test binaries are missing:\n  " + "\n  ".join(missing) + f"\n{BUILD_HINT}."
            )
        return tools

    def binaries(self) -> list[Path]:
        return [
            self.kube_apiserver,
            self.kube_controller_manager,
            self.kube_scheduler,
            self.kubectl,
            self.etcd,
            self.kwok,
            self.kwokctl,
            self.helm,
        ]


def ensure_tools(progress: Callable[[str], None], root: Path | None = None) -> Tools:
    """The cached tools, built first when any is missing (hack/build-tools.sh, its lines passed
    to `progress`). Raises ToolsMissing with one line when Go is not there or the build fails."""
    try:
        return Tools.find(root)
    except ToolsMissing:
        pass
    if shutil.which("go") is None:
        raise ToolsMissing(GO_HINT)
    if not BUILD_SCRIPT.exists():
        raise ToolsMissing(f"{BUILD_SCRIPT} not found: run from a source checkout of specdeploy")
    progress("building etcd, kube-apiserver, controller-manager, scheduler, kubectl, kwok and helm from Go "
             f"modules into {root or tools_dir()}: about 11 minutes on 2 cores the first time, cached after")
    env = dict(os.environ)
    if root is not None:
        env["SPECDEPLOY_TOOLS_DIR"] = str(root)
    proc = subprocess.Popen(["bash", str(BUILD_SCRIPT)], cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, stdin=subprocess.DEVNULL)
    assert proc.stdout is not None
    tail: list[str] = []
    for line in proc.stdout:
        line = line.rstrip()
        tail = (tail + [line])[-5:]
        if line:
            progress(line)
    if proc.wait() != 0:
        raise ToolsMissing(f"hack/build-tools.sh exited {proc.returncode}: {tail[-1] if tail else ''}")
    return Tools.find(root)
