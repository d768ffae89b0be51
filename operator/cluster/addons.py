"""Applying a resource's addons (operator/desired/addons.py): discovery of the optional APIs,
server-side apply of any kind through the REST paths, and deletion of what this resource owns
but no longer wants. Failures become conditions, never a failed reconcile: the engine serves
whether or not its autoscaler or InferencePool could be applied."""

from __future__ import annotations

import json
import logging
from typing import Any

from kubernetes.client.exceptions import ApiException
from specdeploy.operator import api
from specdeploy.operator.api import LABEL_INSTANCE
from specdeploy.operator.cluster.kube import APPLY_PATCH, FIELD_MANAGER, KubeClient, _api_message, controller_owner
from specdeploy.operator.desired import addons as desired
from specdeploy.operator.desired import status


def _path(api_version: str, plural: str, namespace: str, name: str | None = None) -> str:
    base = f"/apis/{api_version}/namespaces/{namespace}/{plural}"
    return f"{base}/{name}" if name else base


def _call(kube: KubeClient, method: str, path: str, *, body: Any = None,
          query_params: list[tuple[str, str]] | None = None, headers: dict[str, str] | None = None) -> Any:
    """One REST call through the client's configuration and credentials; -> the JSON answer.
    ApiException for anything but 2xx, as the typed APIs raise."""
    client = kube.api_client
    method, url, header_params, serialized, post_params = client.param_serialize(
        method=method, resource_path=path, query_params=query_params or [], body=body,
        header_params={"Accept": "application/json", **(headers or {})}, auth_settings=["BearerToken"])
    response = client.call_api(method, url, header_params=header_params, body=serialized, post_params=post_params)
    response.read()
    if not 200 <= response.status < 300:
        raise ApiException(http_resp=response)
    return json.loads(response.data) if response.data else None


def serves(kube: KubeClient, kind: tuple[str, str]) -> bool:
    """Whether the cluster serves (apiVersion, kind): API discovery of its group version."""
    api_version, name = kind
    try:
        found = _call(kube, "GET", f"/apis/{api_version}")
    except ApiException as err:
        if err.status == 404:
            return False
        raise
    return any(r.get("kind") == name for r in (found or {}).get("resources") or [])


def converge_addons(kube: KubeClient, sdd: dict[str, Any], logger: logging.Logger,
                    *, remove_unwanted: bool = True) -> dict[str, desired.Condition]:
    """Apply the resource's addons, delete the unwanted ones it owns (unless `remove_unwanted` is
    False: a resource that owns nothing yet); -> the conditions to report."""
    meta = sdd["metadata"]
    namespace, uid = meta["namespace"], meta["uid"]
    cache: dict[tuple[str, str], bool] = {}

    def available(kind: tuple[str, str]) -> bool:
        if kind not in cache:
            cache[kind] = kind in desired.BUILT_IN or serves(kube, kind)
        return cache[kind]

    plan = desired.desired_addons(sdd, available)
    conditions = dict(plan.conditions)
    wanted: set[tuple[str, str, str]] = set()
    for obj in plan.objects:
        kind = (obj["apiVersion"], obj["kind"])
        plural = desired.MANAGED[kind]
        name = obj["metadata"]["name"]
        wanted.add((*kind, name))
        feature = plan.features.get(kind)
        try:
            existing = _get(kube, obj["apiVersion"], plural, namespace, name)
            owner = controller_owner(existing) if existing else None
            if existing is not None and (owner is None or owner.get("uid") != uid):
                raise _Conflict(f"{obj['kind']} {namespace}/{name} exists and is not this resource's; rename or remove it")
            _call(kube, "PATCH", _path(obj["apiVersion"], plural, namespace, name), body=obj,
                  query_params=[("fieldManager", FIELD_MANAGER), ("force", "true")],
                  headers={"Content-Type": APPLY_PATCH})
        except (_Conflict, ApiException) as err:
            message = str(err) if isinstance(err, _Conflict) else f"{obj['kind']} {name}: {_api_message(err)}"
            logger.warning(f"addon not applied: {message}")
            if feature is None:
                continue  # a budget or policy: logged; the engine serves without it
            reason = api.REASON_CHILD_CONFLICT if isinstance(err, _Conflict) else api.REASON_ENGINE_SPEC_INVALID
            conditions[feature] = desired.Condition(feature, False, reason, message)
    for kind, plural in desired.MANAGED.items() if remove_unwanted else ():
        if kind in plan.untouched or not available(kind):
            continue
        for item in _owned(kube, kind[0], plural, namespace, meta["name"], uid):
            if (*kind, item["metadata"]["name"]) not in wanted:
                _delete(kube, kind[0], plural, namespace, item)
                logger.info(f"removed {kind[1]} {item['metadata']['name']}: no longer asked for")
    return conditions


def report(kube: KubeClient, sdd: dict[str, Any], conditions: dict[str, desired.Condition]) -> None:
    meta = sdd["metadata"]
    generation = meta.get("generation", 1)
    kube.update_status(meta["namespace"], meta["name"], lambda cur, _o: desired.status_conditions(
        cur, conditions, generation=generation, now=status.now_rfc3339()))


class _Conflict(Exception):
    pass


def _get(kube: KubeClient, api_version: str, plural: str, namespace: str, name: str) -> dict[str, Any] | None:
    try:
        return _call(kube, "GET", _path(api_version, plural, namespace, name))
    except ApiException as err:
        if err.status == 404:
            return None
        raise


def _owned(kube: KubeClient, api_version: str, plural: str, namespace: str, name: str, uid: str) -> list[dict[str, Any]]:
    found = _call(kube, "GET", _path(api_version, plural, namespace), query_params=[("labelSelector", f"{LABEL_INSTANCE}={name}")])
    return [item for item in (found or {}).get("items") or []
            if (controller_owner(item) or {}).get("uid") == uid]


def _delete(kube: KubeClient, api_version: str, plural: str, namespace: str, item: dict[str, Any]) -> None:
    try:
        _call(kube, "DELETE", _path(api_version, plural, namespace, item["metadata"]["name"]),
              body={"preconditions": {"uid": item["metadata"]["uid"]}, "propagationPolicy": "Background"})
    except ApiException as err:
        if err.status not in (404, 409):
            raise
