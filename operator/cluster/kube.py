"""The operator's side effects on the cluster, in one place: reads, server-side apply, deletes and
optimistic-concurrency status writes, through the official Kubernetes client."""

from __future__ import annotations

import base64
import json
import os
import random
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import kubernetes
from kubernetes.client.exceptions import ApiException
from specdeploy.operator import api
from specdeploy.operator.api import GROUP, KIND, MANAGED_BY, PLURAL, VERSION
from specdeploy.operator.desired.render import (
    Children,
    config_map_name,
    deployment_name,
    quantity_bytes,
)

FIELD_MANAGER = MANAGED_BY
APPLY_PATCH = "application/apply-patch+yaml"
# Status writers conflict while a rollout streams Deployment events; each retry re-reads, so
# many cheap attempts with a little jitter converge quickly.
STATUS_WRITE_ATTEMPTS = 30
STATUS_WRITE_BACKOFF_S = 0.05


class ChildConflict(Exception):
    """A child cannot be applied as rendered: an object with its name exists but another owner
    controls it (the operator never takes over what it did not create), or the change is one the
    API refuses (a claim's storage class or access modes are fixed once it exists)."""

    def __init__(self, message: str, reason: str = api.REASON_CHILD_CONFLICT) -> None:
        super().__init__(message)
        self.reason = reason


class ChildInvalid(Exception):
    """The API server refuses a child as rendered (422 Invalid): the spec asks for something no
    Deployment, ConfigMap or Service may hold (e.g. an extended resource without a limit, an env
    name with '='). Permanent: the spec must change."""

    reason = api.REASON_ENGINE_SPEC_INVALID


def plain(value: Any) -> Any:
    """Deep copy of a kopf body (read-only mapping views) as plain dicts and lists."""
    if isinstance(value, Mapping):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        return [plain(v) for v in value]
    return value


def controller_owner(obj: Mapping[str, Any], kind: str = KIND) -> Mapping[str, Any] | None:
    for ref in obj.get("metadata", {}).get("ownerReferences") or []:
        if ref.get("controller") and ref.get("kind") == kind:
            return ref
    return None


def _api_message(err: ApiException) -> str:
    try:
        return json.loads(err.body).get("message", str(err.reason))
    except (TypeError, ValueError):
        return str(err.reason)


def new_api_client(pool_connections: int | None = None) -> kubernetes.client.ApiClient:
    """In-cluster credentials when running in a pod, else $KUBECONFIG / ~/.kube/config; up to
    `pool_connections` kept-alive connections (None: the client's default, 5 per CPU)."""
    configuration = kubernetes.client.Configuration()
    try:
        kubernetes.config.load_incluster_config(client_configuration=configuration)
    except kubernetes.config.ConfigException:
        # Read KUBECONFIG now: the client's own default was frozen when it was first imported.
        kubernetes.config.load_kube_config(config_file=os.environ.get("KUBECONFIG") or None,
                                           client_configuration=configuration)
    if pool_connections is not None:
        configuration.connection_pool_maxsize = pool_connections
    return kubernetes.client.ApiClient(configuration)


class KubeClient:
    def __init__(self, api_client: kubernetes.client.ApiClient) -> None:
        self.api_client = api_client
        self.core = kubernetes.client.CoreV1Api(api_client)
        self.apps = kubernetes.client.AppsV1Api(api_client)
        self.custom = kubernetes.client.CustomObjectsApi(api_client)

    def _dict(self, model: Any) -> dict[str, Any]:
        return self.api_client.sanitize_for_serialization(model)

    @staticmethod
    def _json(call: Callable, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """`call`'s answer as the plain JSON the API server sent. The client's models cost a
        Deployment's or a pod list's round trip through them 5 ms or more of CPU (and of the GIL
        every handler thread shares), against 0.02 ms for json.loads."""
        response = call(*args, _preload_content=False, **kwargs)
        try:
            return json.loads(response.data)
        finally:
            response.release_conn()

    # -- reads (config_source.ClusterReader) -------------------------------------------------

    def config_map_data(self, namespace: str, name: str) -> dict[str, str] | None:
        try:
            return self.core.read_namespaced_config_map(name, namespace).data or {}
        except ApiException as err:
            if err.status == 404:
                return None
            raise

    def secret_data(self, namespace: str, name: str) -> dict[str, str] | None:
        try:
            secret = self.core.read_namespaced_secret(name, namespace)
        except ApiException as err:
            if err.status == 404:
                return None
            raise
        decoded = {k: base64.b64decode(v).decode() for k, v in (secret.data or {}).items()}
        decoded.update(secret.string_data or {})
        return decoded

    def get_deployment(self, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return self._json(self.apps.read_namespaced_deployment, name, namespace)
        except ApiException as err:
            if err.status == 404:
                return None
            raise

    def list_pods(self, namespace: str, label_selector: str) -> list[dict[str, Any]]:
        return self._json(self.core.list_namespaced_pod, namespace, label_selector=label_selector)["items"]

    def pod_log_tail(self, namespace: str, pod: str, container: str, lines: int) -> list[str]:
        """The last `lines` lines of the container's previous run (a crashed engine's last words),
        else of its current one; [] when the kubelet has none to give."""
        for previous in (True, False):  # kubelets without the previous run's log give the current one
            try:
                text = self.core.read_namespaced_pod_log(pod, namespace, container=container, tail_lines=lines,
                                                         previous=previous, _request_timeout=5)
            except Exception:  # noqa: BLE001 - the status says what it can without them
                continue
            return str(text).splitlines()[-lines:]
        return []

    def list_sdds(self, namespaces: list[str] | None) -> list[dict[str, Any]]:
        if not namespaces:
            return self.custom.list_cluster_custom_object(GROUP, VERSION, PLURAL)["items"]
        return [
            item
            for ns in namespaces
            for item in self.custom.list_namespaced_custom_object(GROUP, VERSION, ns, PLURAL)["items"]
        ]

    def get_sdd(self, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return self.custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)
        except ApiException as err:
            if err.status == 404:
                return None
            raise

    # -- children ------------------------------------------------------------------------------

    def _existing(self, obj: dict[str, Any]) -> Any:
        meta = obj["metadata"]
        read = {
            "ConfigMap": self.core.read_namespaced_config_map,
            "PersistentVolumeClaim": self.core.read_namespaced_persistent_volume_claim,
            "Service": self.core.read_namespaced_service,
            "Deployment": self.apps.read_namespaced_deployment,
        }[obj["kind"]]
        try:
            return self._json(read, meta["name"], meta["namespace"])
        except ApiException as err:
            if err.status == 404:
                return None
            raise

    def check_not_foreign(self, obj: dict[str, Any]) -> None:
        """ChildConflict if an object of this name exists and the same owner does not control it."""
        meta = obj["metadata"]
        existing = self._existing(obj)
        if existing is not None:
            ours = controller_owner(obj)
            theirs = controller_owner(existing)
            if theirs is None or theirs.get("uid") != ours.get("uid"):
                owner = f"{theirs['kind']} {theirs['name']}" if theirs else "no controller"
                raise ChildConflict(
                    f"{obj['kind']} {meta['namespace']}/{meta['name']} already exists and is owned by"
                    f" {owner}; rename the SpecDecodeDeployment or remove that object"
                )

    def apply(self, obj: dict[str, Any]) -> dict[str, Any]:
        """Server-side apply with this operator's field manager: creates or converges, so a
        restarted operator re-applying the same children changes nothing and duplicates nothing."""
        self.check_not_foreign(obj)
        return self._apply_unchecked(obj)

    def _apply_unchecked(self, obj: dict[str, Any]) -> dict[str, Any]:
        meta = obj["metadata"]
        patch = {
            "ConfigMap": self.core.patch_namespaced_config_map,
            "PersistentVolumeClaim": self.core.patch_namespaced_persistent_volume_claim,
            "Service": self.core.patch_namespaced_service,
            "Deployment": self.apps.patch_namespaced_deployment,
        }[obj["kind"]]
        if obj["kind"] == "PersistentVolumeClaim":
            obj = self._never_shrink(obj)
        try:
            result = self._json(
                patch, meta["name"], meta["namespace"], obj,
                field_manager=FIELD_MANAGER, force=True, _content_type=APPLY_PATCH,
            )
        except ApiException as err:
            if err.status == 422 and obj["kind"] != "PersistentVolumeClaim":
                raise ChildInvalid(
                    f"the API server refuses the engine {obj['kind']} this spec renders: {_api_message(err)}"
                ) from None
            if err.status == 422 and obj["kind"] == "PersistentVolumeClaim":
                raise ChildConflict(
                    f"PersistentVolumeClaim {meta['namespace']}/{meta['name']} cannot be changed as"
                    f" spec.modelCache asks (storageClassName and accessModes are fixed once a claim exists,"
                    f" and its size can only grow where the storage class allows expansion): {_api_message(err)};"
                    " delete the claim to have it made again",
                    reason=api.REASON_MODEL_CACHE_IMMUTABLE,
                ) from None
            raise
        return result

    def _never_shrink(self, claim: dict[str, Any]) -> dict[str, Any]:
        """A claim's storage request can grow but never shrink (the API refuses): keep an existing
        claim's larger size, e.g. after the plan of a smaller model."""
        existing = self._existing(claim)
        have = (((existing or {}).get("spec") or {}).get("resources") or {}).get("requests", {}).get("storage")
        want = claim["spec"]["resources"]["requests"]["storage"]
        if have and quantity_bytes(have) > quantity_bytes(want):
            claim = {**claim, "spec": {**claim["spec"], "resources": {"requests": {"storage": have}}}}
        return claim

    def apply_children(self, children: Children) -> dict[str, Any]:
        """Apply ConfigMap, Deployment, Service; returns the Deployment as the server has it.
        Ownership of all three is checked before any is applied: a conflict found midway would
        leave GPU pods running without their Service (or their ConfigMap)."""
        for child in children.all():
            self.check_not_foreign(child)
        cache = children.model_cache or {}
        if cache.get("claimName") and not cache.get("managed"):
            namespace = children.deployment["metadata"]["namespace"]
            claim = {"kind": "PersistentVolumeClaim", "metadata": {"name": cache["claimName"], "namespace": namespace}}
            if self._existing(claim) is None:
                raise ChildConflict(
                    f"spec.modelCache.claimName: PersistentVolumeClaim {namespace}/{cache['claimName']} does not"
                    " exist; create it, or leave claimName out to have the operator make one",
                    reason=api.REASON_MODEL_CACHE_NOT_FOUND,
                )
        applied = {child["kind"]: self._apply_unchecked(child) for child in children.all()}
        return applied["Deployment"]

    def ensure_secret(self, obj: dict[str, Any]) -> bool:
        """Create the Secret `obj` unless it exists; never rewrite one that does (its value is
        generated once: pods holding it must keep pairing). ChildConflict when a Secret of that
        name is not this resource's. -> whether it was created now."""
        meta = obj["metadata"]
        try:
            existing = self._dict(self.core.read_namespaced_secret(meta["name"], meta["namespace"]))
        except ApiException as err:
            if err.status != 404:
                raise
            existing = None
        if existing is None:
            try:
                self.core.create_namespaced_secret(meta["namespace"], obj, field_manager=FIELD_MANAGER)
                return True
            except ApiException as err:
                if err.status != 409:  # created meanwhile (another operator replica): check it below
                    raise
            existing = self._dict(self.core.read_namespaced_secret(meta["name"], meta["namespace"]))
        theirs, ours = controller_owner(existing), controller_owner(obj)
        if theirs is None or theirs.get("uid") != ours.get("uid"):
            owner = f"{theirs['kind']} {theirs['name']}" if theirs else "no controller"
            raise ChildConflict(f"Secret {meta['namespace']}/{meta['name']} already exists and is owned by {owner};"
                                " rename the SpecDecodeDeployment or remove that Secret")
        return False

    def apply_objects(self, objects: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
        """apply_children for any list of ConfigMaps, Deployments and Services (a disaggregated
        resource's): ownership of all is checked first; -> the applied Deployments by name."""
        for obj in objects:
            self.check_not_foreign(obj)
        applied = [self._apply_unchecked(obj) for obj in objects]
        return {a["metadata"]["name"]: a for a, obj in zip(applied, objects) if obj["kind"] == "Deployment"}

    def delete_owned(self, namespace: str, names: dict[str, list[str]], owner_uid: str) -> list[str]:
        """Delete the named ConfigMaps, Deployments and Services that this resource controls
        (what another mode of it left: aggregated <-> disaggregated). Returns what went."""
        calls = {
            "Deployment": (self.apps.read_namespaced_deployment, self.apps.delete_namespaced_deployment),
            "ConfigMap": (self.core.read_namespaced_config_map, self.core.delete_namespaced_config_map),
            "Service": (self.core.read_namespaced_service, self.core.delete_namespaced_service),
        }
        deleted = []
        for kind, child_names in names.items():
            read, delete = calls[kind]
            for child_name in child_names:
                if self._delete_if_owned(read, delete, namespace, child_name, owner_uid):
                    deleted.append(f"{kind} {child_name}")
        return deleted

    def owned_deployment(self, namespace: str, name: str, owner_uid: str) -> dict[str, Any] | None:
        """The engine Deployment if this resource controls it (None for absent or foreign)."""
        deployment = self.get_deployment(namespace, deployment_name(name))
        owner = controller_owner(deployment) if deployment else None
        return deployment if owner is not None and owner.get("uid") == owner_uid else None

    def delete_engine(self, namespace: str, name: str, owner_uid: str) -> list[str]:
        """Delete the engine Deployment and its ConfigMap, if this resource controls them (the
        Service stays: its name is the stable address clients use, and it has no endpoints
        without pods). Returns what went."""
        deleted = []
        for kind, read, delete, child_name in (
            ("Deployment", self.apps.read_namespaced_deployment, self.apps.delete_namespaced_deployment, deployment_name(name)),
            ("ConfigMap", self.core.read_namespaced_config_map, self.core.delete_namespaced_config_map, config_map_name(name)),
        ):
            if self._delete_if_owned(read, delete, namespace, child_name, owner_uid):
                deleted.append(f"{kind} {child_name}")
        return deleted

    def _delete_if_owned(self, read: Callable, delete: Callable, namespace: str, child_name: str, owner_uid: str) -> bool:
        """Delete one child if the resource `owner_uid` controls it; True when it went. Absent
        (404) or changed underneath (409) is not an error."""
        try:
            child = self._json(read, child_name, namespace)
            owner = controller_owner(child)
            if owner is None or owner.get("uid") != owner_uid:
                return False  # not ours: never delete what the resource does not control
            # The uid precondition guards against a same-named replacement in between.
            delete(
                child_name, namespace,
                body=kubernetes.client.V1DeleteOptions(
                    propagation_policy="Background",
                    preconditions=kubernetes.client.V1Preconditions(uid=child["metadata"]["uid"]),
                ),
            )
            return True
        except ApiException as err:
            if err.status not in (404, 409):
                raise
            return False

    # -- status ----------------------------------------------------------------------------------

    def update_status(
        self,
        namespace: str,
        name: str,
        compute: Callable[[dict[str, Any], dict[str, Any]], dict[str, Any]],
    ) -> tuple[dict[str, Any], dict[str, Any]] | None:
        """Read the resource, `compute(current_status, resource)` the new status, write it with
        the read resourceVersion; on a conflict read and compute again.

        Both the reconciler and the Deployment watcher write status; the version check keeps
        either from overwriting what the other wrote from a newer view. Returns (old, new)
        status, or None when the resource is gone.
        """
        for attempt in range(STATUS_WRITE_ATTEMPTS):
            if attempt:
                time.sleep(random.uniform(0, STATUS_WRITE_BACKOFF_S * min(attempt, 10)))
            obj = self.get_sdd(namespace, name)
            if obj is None:
                return None
            old = obj.get("status") or {}
            new = compute(old, obj)
            if "kopf" in old:
                new = {**new, "kopf": old["kopf"]}
            if new == old:
                return old, new
            obj["status"] = new
            try:
                self.custom.replace_namespaced_custom_object_status(
                    GROUP, VERSION, namespace, PLURAL, name, obj, field_manager=FIELD_MANAGER
                )
                return old, new
            except ApiException as err:
                if err.status == 404:
                    return None
                if err.status != 409:
                    raise
        raise RuntimeError(f"status of {namespace}/{name}: still conflicting after {STATUS_WRITE_ATTEMPTS} attempts")
