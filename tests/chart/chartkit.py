"""Helpers for the chart tests: the chart's paths, the cached helm, parsing rendered YAML."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "specdeploy"
CRD_SOURCE = ROOT / "manifests" / "crd" / "specdeploy.dev_specdecodedeployments.yaml"
EXAMPLES = ROOT / "manifests" / "examples"
INSTALL_YAML = ROOT / "manifests" / "install.yaml"


class Helm:
    """The cached helm binary, run offline with its config/cache/data in a temp dir."""

    def __init__(self, binary: Path, home: Path, kube_version: str):
        self.binary = binary
        # Checked against the chart's kubeVersion; a helm built without version stamps would
        # assume Kubernetes 1.20 otherwise.
        self.kube_version = kube_version
        self.env = dict(os.environ)
        for var, sub in (("HELM_CACHE_HOME", "cache"), ("HELM_CONFIG_HOME", "config"), ("HELM_DATA_HOME", "data")):
            self.env[var] = str(home / sub)

    def run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(
            [str(self.binary), *args], env=self.env, capture_output=True, text=True, timeout=120,
            stdin=subprocess.DEVNULL,
        )
        if check and result.returncode != 0:
            raise AssertionError(f"helm {' '.join(args)} failed ({result.returncode}):\n{result.stderr}")
        return result

    def template(self, *values: str, release: str = "specdeploy", namespace: str = "specdeploy",
                 include_crds: bool = False) -> str:
        """`helm template` of the chart; `values` are `--set` expressions."""
        args = ["template", release, str(CHART), "--namespace", namespace, "--kube-version", self.kube_version]
        if include_crds:
            args.append("--include-crds")
        for value in values:
            args += ["--set", value]
        return self.run(*args).stdout


def parse(text: str) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(text) if doc]


def by_kind(objs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objs if o["kind"] == kind]


def one(objs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = by_kind(objs, kind)
    assert len(found) == 1, f"expected one {kind}, got {[o['metadata']['name'] for o in found]}"
    return found[0]
