"""Locate the control-plane binaries that hack/build-tools.sh caches outside the repo."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[3]
VERSIONS_FILE = REPO_ROOT / "hack" / "tools-versions.env"
BUILD_HINT = "run `make tools` (hack/build-tools.sh) to build them; the first build takes about 12 minutes on 2 cores"


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
