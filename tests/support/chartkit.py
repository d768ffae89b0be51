"""Helpers for the chart tests: the chart's paths, the cached helm, parsing rendered YAML."""

from __future__ import annotations

import json
import os
import re
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


# ---- the example SpecDecodeDeployments and their plan comments ------------------------------

# "#   <key>: <value>" lines of an example's plan comment. Keys are the plan's JSON keys
# (`specdeploy plan --json`), dotted for nested ones.
PLAN_LINE = re.compile(r"^#\s+([a-z_]+(?:\.[a-z_]+)*):(\s+)(-?\d+)\s*$", re.MULTILINE)
CONFIG_LINE = re.compile(r"^#\s+(target|draft) config\.json:\s+(\S+)\s*$", re.MULTILINE)
PLAN_KEYS = {
    "tensor_parallel_size",
    "spec_hidden_size",
    "draft_input_hidden_size",
    "max_total_tokens",
    "required_tokens",
    "memory_per_gpu.weight_bytes",
    "memory_per_gpu.kv_cache_bytes_per_token",
}
# Keys an example may add to its plan comment (a multi-node example says its nodes).
OPTIONAL_PLAN_KEYS = {"nodes"}


def example_files() -> list[Path]:
    return sorted(EXAMPLES.glob("*.yaml"))


def load_sdd(path: Path) -> dict[str, Any]:
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    (sdd,) = [d for d in docs if d["kind"] == "SpecDecodeDeployment"]
    return sdd


def config_sources(path: Path) -> dict[str, Path]:
    """role -> config.json file named in the comment (for configs the operator reads from the hub)."""
    return {role: ROOT / rel for role, rel in CONFIG_LINE.findall(path.read_text())}


def model_configs(path: Path) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The target and draft config.json the operator will see: inline, else the named copy."""
    spec = load_sdd(path)["spec"]
    files = config_sources(path)

    def resolve(role: str) -> dict[str, Any] | None:
        part = spec.get(role)
        if part is None:
            return None
        if "config" in part:
            assert role not in files, f"{path.name}: {role} config is inline; drop its config.json line"
            return part["config"]
        assert role in files, f"{path.name}: name the {role} config.json the hub serves in the comment"
        return json.loads(files[role].read_text())

    return resolve("target"), resolve("draft")


def operator_plan(path: Path) -> dict[str, Any]:
    from specdeploy.operator.desired.planning import plan_engine

    target, draft = model_configs(path)
    return plan_engine(load_sdd(path)["spec"], target, draft).plan


def plan_value(plan: dict[str, Any], dotted: str) -> Any:
    value: Any = plan
    for part in dotted.split("."):
        value = value[part]
    return value


def commented_plan(path: Path) -> dict[str, int]:
    return {key: int(value) for key, _, value in PLAN_LINE.findall(path.read_text())}
