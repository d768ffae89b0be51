"""spec.disaggregation -> the children of a disaggregated deployment (pure; docs/disaggregation.md).

    ConfigMap  NAME-prefill-engine, NAME-decode-engine   each role's own plan.json and engine.json
    Deployment NAME-prefill, NAME-decode                 `engine serve --role R --plan` (the role's
                                                         plan: GPUs = its tensor-parallel size),
                                                         --transfer-host = the pod IP (downward API)
    Service    NAME-prefill, NAME-decode                 headless: the router resolves every ready pod
    Deployment NAME-router                               `specdeploy router --prefill .. --decode ..`
    Service    NAME                                      the router: the address clients use, as
                                                         for an aggregated resource
    Secret     NAME-disagg                               the roles' shared secret (created once by
                                                         the operator, random; every role pod mounts
                                                         it: --disagg-secret-file)

Pods carry the ROLE_LABEL; router pods are app specdeploy-router (so metrics scrapes and the
engine selector find engine pods only). One config hash over every role's inputs is stamped on
all three Deployments: any change rolls them together, so a prefill and a decode pod of
different specs never pair.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from specdeploy.engine.planner.plan import MIB
from specdeploy.operator.api import (
    ENGINE_ROLES,
    LABEL_COMPONENT,
    LABEL_INSTANCE,
    LABEL_MANAGED_BY,
    LABEL_NAME,
    LABEL_PART_OF,
    MANAGED_BY,
    ROLE_LABEL,
    ROUTER_APP_NAME,
    SPLIT_ROLES,
)
from specdeploy.operator.desired import scheduling
from specdeploy.operator.desired.render import (
    ENGINE_PORT,
    ENGINE_PORT_NAME,
    EngineDefaults,
    PlannedEngine,
    _engine_env,
    _engine_resources,
    _http_probe,
    common_labels,
    secret_file_volume,
    with_api_keys,
    config_hash,
    deployment_object,
    progress_deadline_s,
    engine_args,
    engine_container,
    engine_pod_spec,
    engine_settings,
    finish_children,
    quantity_bytes,
    selector_labels,
    service_name,
    service_object,
)

ROUTER_CONTAINER = "router"
DEFAULT_TRANSFER_PROTOCOL = "tcp"
DISAGG_SECRET_KEY = "secret"
DISAGG_SECRET_VOLUME = "disagg-secret"
DISAGG_SECRET_MOUNT_PATH = "/var/run/secrets/specdeploy/disagg"
DISAGG_SECRET_FILE = "secret"


def disagg_secret_name(name: str) -> str:
    return f"{name}-disagg"


def disagg_secret_object(sdd: dict[str, Any], secret: str) -> dict[str, Any]:
    """The shared secret of a disaggregated resource's roles, as created (once: the operator
    never rewrites it, so pods keep pairing across reconciles). Owned by the resource."""
    name = sdd["metadata"]["name"]
    obj = {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
           "metadata": {"name": disagg_secret_name(name), "labels": common_labels(name)},
           "stringData": {DISAGG_SECRET_KEY: secret}}
    finish_children(sdd, [obj], common_labels(name))
    return obj


def _with_disagg_secret(name: str, container: dict[str, Any], pod_spec: dict[str, Any]) -> None:
    volume, mount, path = secret_file_volume(DISAGG_SECRET_VOLUME, disagg_secret_name(name), DISAGG_SECRET_KEY,
                                             DISAGG_SECRET_FILE, DISAGG_SECRET_MOUNT_PATH)
    container["args"] = [*container["args"], "--disagg-secret-file", path]
    container.setdefault("volumeMounts", []).append(mount)
    pod_spec.setdefault("volumes", []).append(volume)


def with_host_staging(resources: dict[str, Any], staging_bytes: int) -> dict[str, Any]:
    """A role pod's resources with its host staging arena (the plan's transfer_staging_bytes:
    pinned host memory outside the engine's usual footprint) added to the memory the user gave,
    request and limit alike, in whole MiB, so a limit sized for the aggregated engine does not
    OOM-kill the role pod. Where no memory is given there is nothing to raise; a value that is no
    quantity stays as it is, for the API server to refuse with its own message."""
    if not staging_bytes:
        return resources
    out = {key: dict(values) for key, values in resources.items()}
    for values in out.values():
        if "memory" in values:
            try:
                given = quantity_bytes(str(values["memory"]))
            except ValueError:
                continue
            values["memory"] = f"{-(-int(given + staging_bytes) // MIB)}Mi"
    return out


def is_disaggregated(spec: dict[str, Any]) -> bool:
    return bool(spec.get("disaggregation"))


def role_spec(spec: dict[str, Any], role: str) -> dict[str, Any]:
    return (spec.get("disaggregation") or {}).get(role) or {}


def role_deployment_name(name: str, role: str) -> str:
    return f"{name}-{role}"


def role_service_name(name: str, role: str) -> str:
    return f"{name}-{role}"


def role_config_map_name(name: str, role: str) -> str:
    return f"{name}-{role}-engine"


def role_selector(name: str, role: str) -> dict[str, str]:
    if role == "router":
        return {LABEL_NAME: ROUTER_APP_NAME, LABEL_INSTANCE: name}
    return {**selector_labels(name), ROLE_LABEL: role}


def role_labels(name: str, role: str) -> dict[str, str]:
    if role == "router":
        return {**role_selector(name, role), LABEL_COMPONENT: "router", LABEL_PART_OF: "specdeploy",
                LABEL_MANAGED_BY: MANAGED_BY}
    return {**common_labels(name), ROLE_LABEL: role}


def child_names(name: str) -> dict[str, list[str]]:
    """Every child a disaggregated resource may own, by kind (what switching back to an
    aggregated engine removes)."""
    return {
        "Deployment": [role_deployment_name(name, r) for r in SPLIT_ROLES],
        "ConfigMap": [role_config_map_name(name, r) for r in ENGINE_ROLES],
        "Service": [role_service_name(name, r) for r in ENGINE_ROLES],
    }


@dataclass(frozen=True)
class RoleChildren:
    objects: list[dict[str, Any]]     # apply order: ConfigMaps, Deployments, Services
    deployments: dict[str, str]       # role -> Deployment name
    config_hash: str

    def all(self) -> list[dict[str, Any]]:
        return list(self.objects)


def _role_args(settings: dict[str, Any], role: str, protocol: str) -> list[str]:
    return engine_args(settings) + ["--role", role, "--transfer-host", "$(POD_IP)",
                                    "--transfer-protocol", protocol]


def render_roles(sdd: dict[str, Any], planned: PlannedEngine, defaults: EngineDefaults) -> RoleChildren:
    """The children of a disaggregated SpecDecodeDeployment (module docstring)."""
    meta, spec = sdd["metadata"], sdd["spec"]
    name = meta["name"]
    engine = spec.get("engine") or {}
    hub_endpoint = (spec.get("hub") or {}).get("endpoint") or defaults.hub_endpoint
    image = engine.get("image") or defaults.image
    protocol = (spec.get("disaggregation") or {}).get("transferProtocol", DEFAULT_TRANSFER_PROTOCOL)
    plans = planned.role_plans or {}
    missing = [r for r in ENGINE_ROLES if r not in plans]
    if missing:
        raise ValueError(f"no plan for role(s) {', '.join(missing)}")

    config_maps: dict[str, dict[str, Any]] = {}
    containers: dict[str, dict[str, Any]] = {}
    for role in ENGINE_ROLES:
        plan = plans[role]
        settings = {**engine_settings(spec), "dtype": plan["target"]["dtype"]}
        config_maps[role] = {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": role_config_map_name(name, role), "labels": role_labels(name, role)},
            "data": {
                "plan.json": json.dumps(plan, indent=2, sort_keys=True) + "\n",
                "engine.json": json.dumps({**settings, "role": role, "image": image,
                                           "tensor_parallel_size": plan["tensor_parallel_size"]},
                                          indent=2, sort_keys=True) + "\n",
            },
        }
        env = _engine_env(spec, hub_endpoint, planned.cpu)
        # The transfer engine listens on the pod IP; peers write to it there.
        env.append({"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}})
        gpus = 0 if planned.cpu else plan["tensor_parallel_size"]
        containers[role] = engine_container(
            spec, image, _role_args(settings, role, protocol), env,
            with_host_staging(_engine_resources(spec, gpus, role_spec(spec, role).get("resources")),
                              int((plan.get("buffers") or {}).get("transfer_staging_bytes") or 0)),
        )
    router_container = {
        "name": ROUTER_CONTAINER,
        "image": image,
        "command": ["specdeploy", "router"],
        "args": ["--prefill", f"http://{role_service_name(name, 'prefill')}:{ENGINE_PORT}",
                 "--decode", f"http://{role_service_name(name, 'decode')}:{ENGINE_PORT}",
                 "--host", "0.0.0.0", "--port", str(ENGINE_PORT)],
        "ports": [{"name": ENGINE_PORT_NAME, "containerPort": ENGINE_PORT, "protocol": "TCP"}],
        "resources": _engine_resources(spec, 0, role_spec(spec, "router").get("resources") or {}),
        "livenessProbe": _http_probe("/health", 10, 3),
        "readinessProbe": _http_probe("/ready", 5, 3),
        # The router holds no GPU: the CUDA runtime must not hand it any.
        "env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"}],
    }
    if engine.get("imagePullPolicy"):
        router_container["imagePullPolicy"] = engine["imagePullPolicy"]
    pod_specs = {role: engine_pod_spec(spec, containers[role], role_config_map_name(name, role), planned)
                 for role in ENGINE_ROLES}
    router_pod = {
        "containers": [router_container],
        "enableServiceLinks": False,
        "automountServiceAccountToken": False,
        "terminationGracePeriodSeconds": 30,
    }
    # Clients meet the router: it checks their keys; the roles check the shared secret.
    with_api_keys(spec, router_container, router_pod)
    for role in ENGINE_ROLES:
        _with_disagg_secret(name, containers[role], pod_specs[role])
    _with_disagg_secret(name, router_container, router_pod)
    hash_value = config_hash(
        {r: config_maps[r]["data"] for r in ENGINE_ROLES},
        {"image": image, "args": {r: c["args"] for r, c in containers.items()},
         "router": router_container["args"]},
    )

    deployments: dict[str, dict[str, Any]] = {}
    services: dict[str, dict[str, Any]] = {}
    for role in ENGINE_ROLES:
        deployments[role] = deployment_object(
            role_deployment_name(name, role), role_labels(name, role), role_selector(name, role),
            role_spec(spec, role).get("replicas", 1), hash_value, pod_specs[role],
            progress_deadline_s(planned.role_plans[role] if planned.role_plans else planned.plan))
        services[role] = service_object(role_service_name(name, role), role_labels(name, role),
                                  role_selector(name, role), headless=True)
    deployments["router"] = deployment_object(
        role_deployment_name(name, "router"), role_labels(name, "router"), role_selector(name, "router"),
        role_spec(spec, "router").get("replicas", 1), hash_value, router_pod)
    for role, deployment in deployments.items():
        scheduling.customize_deployment(deployment, spec, role)
        if role in ENGINE_ROLES and role_spec(spec, role).get("autoscaling"):
            # Its autoscaler owns the replicas; server-side apply keeps the count it set.
            deployment["spec"].pop("replicas")
    services["router"] = service_object(service_name(name), role_labels(name, "router"), role_selector(name, "router"))

    objects: list[dict[str, Any]] = []
    for role in SPLIT_ROLES:
        group = [o for o in (config_maps.get(role), deployments[role], services[role]) if o is not None]
        finish_children(sdd, group, role_labels(name, role))
        objects += group
    order = {"ConfigMap": 0, "Deployment": 1, "Service": 2}
    objects.sort(key=lambda o: order[o["kind"]])
    return RoleChildren(objects, {r: deployments[r]["metadata"]["name"] for r in SPLIT_ROLES}, hash_value)
