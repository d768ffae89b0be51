"""LeaderWorkerSets on the cluster: whether the API is served, and reads, server-side applies and
owner-checked deletes of the engine's group (desired/leaderworkerset.py renders it).

The operator does not install LWS; a cluster without it is told how (api.LWS_INSTALL) through the
resource's conditions. Whether the API is served is asked through discovery, which every
authenticated client may read, so the answer needs no extra RBAC.
"""

from __future__ import annotations

from typing import Any

import kubernetes
from kubernetes.client.exceptions import ApiException
from specdeploy.operator.api import LWS_GROUP, LWS_PLURAL, LWS_VERSION
from specdeploy.operator.cluster.kube import (
    APPLY_PATCH,
    FIELD_MANAGER,
    ChildConflict,
    ChildInvalid,
    KubeClient,
    _api_message,
    controller_owner,
)


class LeaderWorkerSets:
    def __init__(self, kube: KubeClient) -> None:
        self.kube = kube
        self.custom = kube.custom

    def served(self) -> bool:
        """Is leaderworkerset.x-k8s.io/v1 served (the CRD installed and established)?"""
        try:
            resources = self.custom.get_api_resources(LWS_GROUP, LWS_VERSION)
        except ApiException as err:
            if err.status == 404:
                return False
            raise
        return any(r.name == LWS_PLURAL for r in resources.resources or [])

    def get(self, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return self.custom.get_namespaced_custom_object(LWS_GROUP, LWS_VERSION, namespace, LWS_PLURAL, name)
        except ApiException as err:
            if err.status == 404:
                return None
            raise

    def apply(self, group: dict[str, Any]) -> dict[str, Any]:
        """Server-side apply of the group, after checking that no other owner holds its name."""
        self.check_not_foreign(group)
        meta = group["metadata"]
        try:
            return self.custom.patch_namespaced_custom_object(
                LWS_GROUP, LWS_VERSION, meta["namespace"], LWS_PLURAL, meta["name"], group,
                field_manager=FIELD_MANAGER, force=True, _content_type=APPLY_PATCH,
            )
        except ApiException as err:
            if err.status == 422:
                raise ChildInvalid(
                    f"the API server refuses the engine LeaderWorkerSet this spec renders: {_api_message(err)}"
                ) from None
            raise

    def check_not_foreign(self, group: dict[str, Any]) -> None:
        """ChildConflict if a LeaderWorkerSet of this name exists and the same owner does not
        control it."""
        meta = group["metadata"]
        existing = self.get(meta["namespace"], meta["name"])
        if existing is not None:
            ours, theirs = controller_owner(group), controller_owner(existing)
            if theirs is None or theirs.get("uid") != ours.get("uid"):
                owner = f"{theirs['kind']} {theirs['name']}" if theirs else "no controller"
                raise ChildConflict(
                    f"LeaderWorkerSet {meta['namespace']}/{meta['name']} already exists and is owned by"
                    f" {owner}; rename the SpecDecodeDeployment or remove that object")

    def delete_if_owned(self, namespace: str, name: str, owner_uid: str) -> bool:
        """Delete the group if the resource `owner_uid` controls it (its pods go with it); True
        when it went. A cluster without LWS has none to delete."""
        try:
            group = self.get(namespace, name)
        except ApiException as err:
            if err.status == 404:
                return False
            raise
        owner = controller_owner(group) if group else None
        if owner is None or owner.get("uid") != owner_uid:
            return False
        try:
            self.custom.delete_namespaced_custom_object(
                LWS_GROUP, LWS_VERSION, namespace, LWS_PLURAL, name,
                body=kubernetes.client.V1DeleteOptions(
                    propagation_policy="Background",
                    preconditions=kubernetes.client.V1Preconditions(uid=group["metadata"]["uid"])),
            )
            return True
        except ApiException as err:
            if err.status not in (404, 409):
                raise
            return False
