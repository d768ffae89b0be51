"""`specdeploy plan -f resource.yaml`: a SpecDecodeDeployment file planned as the operator plans it.

The same reads (cluster/config_source.resolve_configs: inline config, a ConfigMap, or the hub's
config.json and safetensors headers) and the same planning (desired/planning.plan_engine, with the
CRD's defaults filled in by render.engine_settings), so what this prints is the plan.json the
operator would write into the engine's ConfigMap. What the operator reads from the cluster comes
from the file instead: a ConfigMap named by configMapRef and the hub token's Secret may be further
documents of the same file; without that Secret the token is $HF_TOKEN.

`--target-config` / `--draft-config` put a config.json file in place of the model's source, as if it
were given inline (no hub read for that model: its weights are then estimated by the plan, as the
operator does for an inline config).
"""

from __future__ import annotations

import argparse
import base64
import copy
import json
import os
import sys
from pathlib import Path
from typing import Any

from specdeploy.engine.planner.remote import DEFAULT_HUB_ENDPOINT
from specdeploy.operator import api


class ResourceError(ValueError):
    """The file is not one SpecDecodeDeployment this command can plan; the message says why."""


def _documents(path: Path) -> list[dict[str, Any]]:
    text = path.read_text()
    if path.suffix == ".json" or text.lstrip().startswith("{"):
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as err:
            raise ResourceError(f"{path}: not valid JSON ({err})") from None
        docs = doc.get("items", [doc]) if doc.get("kind") == "List" else [doc]
    else:
        try:
            import yaml
        except ImportError:
            raise ResourceError(f"{path}: reading YAML needs PyYAML (pip install 'specdeploy[operator]'), "
                                "or give the resource as JSON") from None
        try:
            docs = [d for d in yaml.safe_load_all(text) if d]
        except yaml.YAMLError as err:
            raise ResourceError(f"{path}: not valid YAML ({' '.join(str(err).split())})") from None
    if not all(isinstance(d, dict) for d in docs):
        raise ResourceError(f"{path}: every document must be a Kubernetes object")
    return docs


def load_resource(path: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(the one SpecDecodeDeployment of the file, the other documents)."""
    docs = _documents(path)
    sdds = [d for d in docs if d.get("kind") == api.KIND]
    if len(sdds) != 1:
        raise ResourceError(f"{path}: expected one {api.KIND}, found {len(sdds)}")
    sdd = copy.deepcopy(sdds[0])
    if sdd.get("apiVersion") != api.API_VERSION:
        raise ResourceError(f"{path}: apiVersion {sdd.get('apiVersion')!r}; expected {api.API_VERSION}")
    spec = sdd.get("spec")
    if not isinstance(spec, dict) or not isinstance(spec.get("target"), dict) \
            or not isinstance(spec.get("speculative"), dict):
        raise ResourceError(f"{path}: spec.target and spec.speculative are required")
    if not spec.get("gpu") and not spec.get("cpu"):
        raise ResourceError(f"{path}: spec.gpu or spec.cpu is required")
    sdd.setdefault("metadata", {}).setdefault("namespace", "default")
    return sdd, [d for d in docs if d is not sdds[0]]


class FileReader:
    """config_source.ClusterReader over the file's other documents (and $HF_TOKEN)."""

    def __init__(self, docs: list[dict[str, Any]], namespace: str):
        self.docs, self.namespace = docs, namespace

    def _find(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        for doc in self.docs:
            meta = doc.get("metadata") or {}
            if doc.get("kind") == kind and meta.get("name") == name and \
                    (meta.get("namespace") or self.namespace) == namespace:
                return doc
        return None

    def config_map_data(self, namespace: str, name: str) -> dict[str, str] | None:
        doc = self._find("ConfigMap", namespace, name)
        return None if doc is None else dict(doc.get("data") or {})

    def secret_data(self, namespace: str, name: str) -> dict[str, str] | None:
        doc = self._find("Secret", namespace, name)
        if doc is None:
            token = os.environ.get("HF_TOKEN")
            # The Secret is in the cluster, not here: the token the user has in the environment.
            return None if not token else _AnyKey(token)
        data = {k: base64.b64decode(v).decode() for k, v in (doc.get("data") or {}).items()}
        data.update(doc.get("stringData") or {})
        return data


class _AnyKey(dict):
    """$HF_TOKEN under whatever key the tokenSecretRef names."""

    def __init__(self, token: str):
        super().__init__()
        self.token = token

    def get(self, key, default=None):
        return self.token


def _inline(spec: dict[str, Any], role: str, config_file: str | None) -> None:
    if config_file is None:
        return
    if not spec.get(role):
        raise ResourceError(f"--{role}-config: the resource has no spec.{role}")
    try:
        config = json.loads(Path(config_file).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ResourceError(f"--{role}-config {config_file}: {err}") from None
    model = {k: v for k, v in spec[role].items() if k != "configMapRef"}
    spec[role] = {**model, "config": config}


def plan_resource(path: Path, *, hub_endpoint: str | None = None, target_config: str | None = None,
                  draft_config: str | None = None):
    """-> (the resource, desired/render.PlannedEngine), or ResourceError / ConfigSourceError /
    PlanningError (each with the reason the operator would set)."""
    from specdeploy.operator.cluster import config_source
    from specdeploy.operator.desired.planning import ModelWeights, plan_engine

    sdd, others = load_resource(path)
    _inline(sdd["spec"], "target", target_config)
    _inline(sdd["spec"], "draft", draft_config)
    reader = FileReader(others, sdd["metadata"]["namespace"])
    endpoint = hub_endpoint or os.environ.get("HF_ENDPOINT") or DEFAULT_HUB_ENDPOINT
    target, draft, weights = config_source.resolve_configs(sdd, reader, endpoint)
    return sdd, plan_engine(sdd["spec"], target.config, draft.config if draft else None, ModelWeights(*weights))


def run(args: argparse.Namespace) -> int:
    from specdeploy.engine.planner.cli import format_plan
    from specdeploy.engine.planner.plan import Plan

    try:
        sdd, planned = plan_resource(Path(args.filename), hub_endpoint=args.hub_endpoint,
                                     target_config=args.target_config, draft_config=args.draft_config)
    except (OSError, ResourceError) as err:
        print(f"specdeploy plan: {err}", file=sys.stderr)
        return 2
    except Exception as err:  # noqa: BLE001 - ConfigSourceError / PlanningError: the operator's reason
        reason = getattr(err, "reason", type(err).__name__)
        hint = ("; the Secret is in the cluster: set HF_TOKEN, or add the Secret to the file"
                if reason == api.REASON_TOKEN_NOT_FOUND else "")
        print(f"specdeploy plan: {reason}: {getattr(err, 'message', err)}{hint}", file=sys.stderr)
        return 2
    plans = planned.role_plans or {"": planned.plan}
    if args.json:
        print(json.dumps(planned.plan if not planned.role_plans else planned.role_plans, indent=2))
        return 0
    name = f"{sdd['metadata']['namespace']}/{sdd['metadata'].get('name', '?')}"
    for role, plan in plans.items():
        print(f"# {api.KIND} {name}" + (f", {role} role" if role else ""))
        print(format_plan(Plan.from_dict(plan)))
    return 0
