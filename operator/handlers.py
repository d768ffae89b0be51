"""kopf handlers: thin shells that call the pure decision path

    spec -> config_source (configs) -> planning (shapes, plan) -> render (children) -> status

and carry out its verdict through kube.KubeClient. Handlers are registered on an explicit
registry by `build_registry`, so importing this module changes nothing.

Decisions worth knowing:
- Status is written by KubeClient.update_status (read, compute, replace with resourceVersion), not
  by returning values: the Deployment watcher writes status too, and neither may clobber the other.
- A spec that no longer plans (does not fit, bad config) removes the engine Deployment: pods of an
  old spec must not keep serving under a resource that says something else. Transient failures
  (hub down, ConfigMap not there yet) keep what serves and retry.
- Paused resources: nothing is applied or deleted; status says Paused.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import kopf
from kubernetes.client.exceptions import ApiException
from specdeploy.operator import api
from specdeploy.operator.api import GROUP, LABEL_MANAGED_BY, MANAGED_BY, PLURAL, VERSION
from specdeploy.engine.planner.remote import DEFAULT_HUB_ENDPOINT
from specdeploy.operator.cluster import addons, config_source, serving_metrics
from specdeploy.operator.cluster.leaderworkerset import LeaderWorkerSets
from specdeploy.operator.cluster.kube import (
    ChildConflict,
    ChildInvalid,
    KubeClient,
    controller_owner,
    new_api_client,
    plain,
)
from specdeploy.operator.desired import addons as desired_addons
from specdeploy.operator.desired import status
from specdeploy.operator.desired.planning import (
    ModelWeights,
    PlanningError,
    plan_engine,
    plan_summary,
)
from specdeploy.operator.desired import leaderworkerset, roles
from specdeploy.operator.desired import pods as engine_pods
from specdeploy.operator.desired.render import (
    EngineDefaults,
    PlannedEngine,
    config_map_name,
    deployment_name,
    is_paused,
    render_children,
    selector_labels,
)

log = logging.getLogger("specdeploy.operator")

# Handlers that run on every Deployment / engine pod status change.
DEPLOYMENT_HANDLER_ID = "engine-deployment"
POD_HANDLER_ID = "engine-pods"
GROUP_HANDLER_ID = "engine-leaderworkerset"
GROUP_POLL_ID = "engine-leaderworkerset-poll"
# How often a plan across nodes reads its LeaderWorkerSet besides the watch (group_poll).
GROUP_POLL_S = 10.0

# Retry delays for failures that can resolve without the resource changing.
TRANSIENT_RETRY_DELAY_S = 30
CONFLICT_RETRY_DELAY_S = 15
# Threads for the synchronous handlers (I/O bound: each mostly waits on the API server).
HANDLER_THREADS = 32
# How often engine pods' /metrics are read for the Accept length column.
METRICS_INTERVAL_S = 30


@dataclass(frozen=True)
class OperatorOptions:
    engine_image: str = "ghcr.io/specdeploy/engine:latest"
    hub_endpoint: str = DEFAULT_HUB_ENDPOINT
    transient_retry_delay_s: float = TRANSIENT_RETRY_DELAY_S
    metrics_interval_s: float = METRICS_INTERVAL_S  # 0: off
    namespaces: list[str] | None = None  # None: all
    # Endpoints a hub token may go to besides the public hub and hub_endpoint (docs/operator.md);
    # trust_resource_hub_endpoints: any spec.hub.endpoint (a cluster whose users are all trusted).
    trusted_hub_endpoints: tuple[str, ...] = ()
    trust_resource_hub_endpoints: bool = False


def _event(body: Any, *, warning: bool, reason: str, message: str) -> None:
    # kopf.event, not kopf.info: posted whatever settings.posting.level says (it keeps the
    # handlers' INFO log lines from becoming events: configure()).
    kopf.event(body, type="Warning" if warning else "Normal", reason=reason, message=message[:1024])


def resolve_configs(
    sdd: dict[str, Any], kube: KubeClient, options: OperatorOptions
) -> tuple[dict[str, Any], dict[str, Any] | None, list[str], ModelWeights]:
    """Both models' config.json, where each came from, and the checkpoints' weight bytes where
    they come from the hub."""
    trusted = config_source.trusted_endpoints(options.hub_endpoint, options.trusted_hub_endpoints)
    target, draft, (target_weights, draft_weights) = config_source.resolve_configs(
        sdd, kube, options.hub_endpoint, trusted_endpoints=trusted, trust_any_endpoint=options.trust_resource_hub_endpoints)
    origins = [target.origin] + ([draft.origin] if draft else [])
    weights = ModelWeights(target_weights, draft_weights)
    return target.config, draft.config if draft else None, origins, weights


def reconcile(body: kopf.Body, logger: logging.Logger, memo: kopf.Memo, reason: Any = None, retry: int = 0,
              **_: Any) -> None:
    """create / update / resume: bring the children in line with the spec, or say why not."""
    # The first attempt at a new resource: no object is controlled by its uid yet, so there are
    # no children of another mode, nor addons no longer asked for, to look up and remove.
    fresh = reason == kopf.Reason.CREATE and not retry
    converge(plain(body), memo.kube, memo.options, logger, fresh=fresh)


def converge(sdd: dict[str, Any], kube: KubeClient, options: OperatorOptions, logger: logging.Logger,
             *, fresh: bool = False) -> None:
    """`fresh`: nothing is controlled by this resource yet (its first create attempt): the
    lookups of leftovers to delete are skipped (a dozen GETs of a create that answer 404)."""
    meta = sdd["metadata"]
    name, namespace, generation = meta["name"], meta["namespace"], meta.get("generation", 1)
    now = status.now_rfc3339

    if is_paused(meta):
        kube.update_status(namespace, name, lambda cur, _o: status.paused(cur, generation=generation, now=now()))
        logger.info("paused by annotation: children left untouched")
        _event(sdd, warning=False, reason=api.EVENT_PAUSED, message="reconciliation paused; children left untouched")
        return

    spec = sdd["spec"]
    if any(m and "config" not in m for m in (spec["target"], spec.get("draft"))):
        # Configs from a ConfigMap or the hub take round trips (seconds, for a hub): say Planning
        # meanwhile. Inline configs plan in milliseconds; the status write would only cost a GET
        # and a PUT per resource (a burst of creates queues behind them).
        kube.update_status(namespace, name, lambda cur, _o: status.planning(cur, generation=generation, now=now()))
    try:
        target_config, draft_config, origins, weights = resolve_configs(sdd, kube, options)
        config_source.check_api_key_secret(sdd["spec"], namespace, kube)
        planned: PlannedEngine = plan_engine(sdd["spec"], target_config, draft_config, weights)
    except (config_source.ConfigSourceError, PlanningError) as err:
        transient = getattr(err, "transient", False)
        _refuse(kube, sdd, err.reason, err.message, transient=transient, logger=logger)
        if transient:
            raise kopf.TemporaryError(f"{err.reason}: {err.message}", delay=options.transient_retry_delay_s) from err
        raise kopf.PermanentError(f"{err.reason}: {err.message}") from err

    summary = plan_summary(planned)
    logger.info(f"planned from {', '.join(origins)}: {summary}")
    _event(sdd, warning=False, reason=api.EVENT_PLANNED, message=summary)

    if roles.is_disaggregated(sdd["spec"]):
        _converge_roles(sdd, kube, options, logger, planned, summary)
        return
    if planned.nodes > 1:
        _converge_group(sdd, kube, options, logger, planned, summary)
        return
    children = render_children(sdd, planned, EngineDefaults(options.engine_image, options.hub_endpoint))
    plan_ready = _plan_ready(sdd, planned, summary, children.config_hash, children.model_cache)
    with _applying(sdd, kube, logger, plan_ready):
        deployment = kube.apply_children(children)
    # CPU mode (spec.cpu) requests no GPU: the plan's one "device" is the pod's memory.
    per_replica = "CPU" if planned.cpu else f"{planned.tensor_parallel_size} GPU"
    _applied(sdd, logger,
             f"applied ConfigMap, {'PersistentVolumeClaim, ' if children.model_cache_claim else ''}Deployment"
             f" ({sdd['spec'].get('replicas', 1)} x {per_replica}, config hash {children.config_hash}) and Service {name}",
             f"engine Deployment {name}: {per_replica} per replica, config hash {children.config_hash}")
    # Read the Deployment again on every attempt: the watcher ignores Deployment events until
    # this write lands, so this write must not carry an older view than the last such event.
    result = _planned_status(kube, sdd, plan_ready, lambda new: status.serving(
        new, kube.get_deployment(namespace, name) or deployment, generation=generation, now=now()))
    if result is not None:
        _phase_changed(kube, namespace, name, *result, logger)
    if not fresh:
        # A resource that was disaggregated before: its role children go.
        gone = kube.delete_owned(namespace, roles.child_names(name), meta["uid"])
        if gone:
            logger.info(f"removed the disaggregated children: {', '.join(gone)}")
        # A resource whose replicas spanned nodes before: its LeaderWorkerSet goes.
        if LeaderWorkerSets(kube).delete_if_owned(namespace, leaderworkerset.leaderworkerset_name(name), meta["uid"]):
            logger.info(f"removed the LeaderWorkerSet {name}: the plan fits one node")
    _converge_addons(sdd, kube, logger, fresh=fresh)


# ---- the apply / blocked / status sequence every converge path shares ---------------------------

StatusStep = Callable[[dict[str, Any]], dict[str, Any]]


def _plan_ready(sdd: dict[str, Any], planned: PlannedEngine, summary: str, config_hash: str,
                model_cache: dict[str, Any] | None = None) -> StatusStep:
    """The status of this plan, ready to apply: PlanReady with the plan, its hash and summary."""
    generation = sdd["metadata"].get("generation", 1)
    return lambda current: status.plan_ready(current, generation=generation, plan=planned.plan, config_hash=config_hash,
                                             message=summary, now=status.now_rfc3339(), model_cache=model_cache)


def _apply_blocked(sdd: dict[str, Any], kube: KubeClient, logger: logging.Logger, plan_ready: StatusStep,
                   reason: str, message: str) -> None:
    """The plan is ready, its children not applied (retried): a warning, an event and the status."""
    meta = sdd["metadata"]
    generation = meta.get("generation", 1)
    logger.warning(f"not applied (will retry): {message}")
    _event(sdd, warning=True, reason=reason, message=message)
    kube.update_status(meta["namespace"], meta["name"], lambda current, _obj: status.apply_blocked(
        plan_ready(current), generation=generation, reason=reason, message=message, now=status.now_rfc3339()))


@contextmanager
def _applying(sdd: dict[str, Any], kube: KubeClient, logger: logging.Logger, plan_ready: StatusStep, *,
              conflict_reason: str | None = None, refuse_invalid: bool = True) -> Iterator[None]:
    """Around applying the children: a child the API server refuses is refused as a spec that
    does not plan (what served the previous spec goes, the status says why; PermanentError); a
    conflict is ApplyBlocked and retried (TemporaryError)."""
    try:
        yield
    except ChildInvalid as err:
        if not refuse_invalid:
            raise
        _refuse(kube, sdd, err.reason, str(err), transient=False, logger=logger)
        raise kopf.PermanentError(f"{err.reason}: {err}") from None
    except ChildConflict as err:
        _apply_blocked(sdd, kube, logger, plan_ready, conflict_reason or err.reason, str(err))
        raise kopf.TemporaryError(str(err), delay=CONFLICT_RETRY_DELAY_S) from None


def _applied(sdd: dict[str, Any], logger: logging.Logger, log_line: str, event_message: str) -> None:
    logger.info(log_line)
    _event(sdd, warning=False, reason=api.EVENT_APPLIED, message=event_message)


def _planned_status(kube: KubeClient, sdd: dict[str, Any], plan_ready: StatusStep, serving: StatusStep,
                    ) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """Write the plan's status and what now serves (`serving`, computed on every attempt from the
    children as they are then); -> (old, new) status, or None."""
    meta = sdd["metadata"]
    return kube.update_status(meta["namespace"], meta["name"], lambda current, _obj: serving(plan_ready(current)))


def _converge_group(
    sdd: dict[str, Any], kube: KubeClient, options: OperatorOptions, logger: logging.Logger,
    planned: PlannedEngine, summary: str,
) -> None:
    """converge() for a plan of more than one node: ConfigMap, LeaderWorkerSet and Service
    (desired/leaderworkerset.py), or LeaderWorkerSetMissing until the cluster serves LWS."""
    meta = sdd["metadata"]
    name, namespace, generation = meta["name"], meta["namespace"], meta.get("generation", 1)
    now = status.now_rfc3339
    groups = LeaderWorkerSets(kube)
    children = leaderworkerset.render_group(sdd, planned, EngineDefaults(options.engine_image, options.hub_endpoint))
    plan_ready = _plan_ready(sdd, planned, summary, children.config_hash, children.model_cache)
    if not groups.served():
        message = (f"the plan spans {planned.nodes} nodes, which run as one {api.LWS_KIND} group per replica, and "
                   f"this cluster does not serve {api.LWS_API_VERSION}: install LeaderWorkerSet ({api.LWS_INSTALL})")
        _apply_blocked(sdd, kube, logger, plan_ready, api.REASON_LWS_MISSING, message)
        raise kopf.TemporaryError(message, delay=options.transient_retry_delay_s)
    with _applying(sdd, kube, logger, plan_ready):
        for child in (children.config_map, children.service):
            kube.check_not_foreign(child)
        groups.check_not_foreign(children.deployment)
        kube._apply_unchecked(children.config_map)
        group = groups.apply(children.deployment)
        kube._apply_unchecked(children.service)
    per_pod = "CPU" if planned.cpu else f"{planned.tensor_parallel_size // planned.nodes} GPU"
    applied = (f"{api.LWS_KIND} {name}: {sdd['spec'].get('replicas', 1)} group(s) of {planned.nodes} pods x {per_pod},"
               f" config hash {children.config_hash}")
    _applied(sdd, logger, f"applied ConfigMap, {applied} and Service {name}", f"engine {applied}")
    _planned_status(kube, sdd, plan_ready, lambda new: status.serving(
        new, leaderworkerset.deployment_view(groups.get(namespace, name) or group), generation=generation, now=now()))
    # What served the single-node plan, or the disaggregated one, goes.
    gone = kube.delete_owned(namespace, {"Deployment": [deployment_name(name)]}, meta["uid"])
    gone += kube.delete_owned(namespace, roles.child_names(name), meta["uid"])
    if gone:
        logger.info(f"removed {', '.join(gone)}: the plan spans nodes")


def _spans_nodes(current: dict[str, Any]) -> bool:
    """Does the resource's current plan run as a LeaderWorkerSet?"""
    return int((current.get("plan") or {}).get("nodes") or 1) > 1


def _converge_roles(
    sdd: dict[str, Any], kube: KubeClient, options: OperatorOptions, logger: logging.Logger,
    planned: PlannedEngine, summary: str,
) -> None:
    """converge() for spec.disaggregation: prefill and decode engines, the router, their Services."""
    meta = sdd["metadata"]
    name, namespace, generation = meta["name"], meta["namespace"], meta.get("generation", 1)
    now = status.now_rfc3339
    children = roles.render_roles(sdd, planned, EngineDefaults(options.engine_image, options.hub_endpoint))
    plan_ready = _plan_ready(sdd, planned, summary, children.config_hash)
    with _applying(sdd, kube, logger, plan_ready, conflict_reason=api.REASON_CHILD_CONFLICT, refuse_invalid=False):
        # Made once, random; an existing one is left as it is (pods holding it keep pairing).
        if kube.ensure_secret(roles.disagg_secret_object(sdd, secrets.token_urlsafe(32))):
            logger.info(f"created Secret {roles.disagg_secret_name(name)}: the roles' shared secret")
        applied = kube.apply_objects(children.all())
    counts = ", ".join(f"{role} {roles.role_spec(sdd['spec'], role).get('replicas', 1)}" for role in api.SPLIT_ROLES)
    _applied(sdd, logger, f"applied the disaggregated children ({counts}; config hash {children.config_hash})",
             f"disaggregated: {counts} replicas, config hash {children.config_hash}")
    # A resource that was aggregated before: its engine Deployment and ConfigMap go (the Service
    # stays: it now selects the router).
    gone = kube.delete_owned(namespace, {"Deployment": [deployment_name(name)], "ConfigMap": [config_map_name(name)]},
                             meta["uid"])
    if gone:
        logger.info(f"removed the aggregated engine: {', '.join(gone)}")

    _planned_status(kube, sdd, plan_ready, lambda new: status.serving_roles(
        new, {role: kube.get_deployment(namespace, dep) or applied.get(dep) for role, dep in children.deployments.items()},
        generation=generation, now=now(), role_plans=planned.role_plans))
    _converge_addons(sdd, kube, logger)


def _converge_addons(sdd: dict[str, Any], kube: KubeClient, logger: logging.Logger, *, fresh: bool = False) -> None:
    """Budgets, policies, autoscalers, InferencePool (operator/desired/addons.py): their failures
    are conditions; an API error here leaves the engine as applied and is retried next time.
    `fresh`: nothing of this resource exists to remove, and no addon condition to clear."""
    try:
        conditions = addons.converge_addons(kube, sdd, logger, remove_unwanted=not fresh)
        if conditions or not fresh:
            addons.report(kube, sdd, conditions)
    except ApiException as err:
        logger.warning(f"addons not converged (retried at the next reconcile): {err.status} {err.reason}")


def role_deployments(kube: KubeClient, namespace: str, name: str) -> dict[str, dict[str, Any] | None]:
    return {role: kube.get_deployment(namespace, roles.role_deployment_name(name, role)) for role in api.SPLIT_ROLES}


def _refuse(
    kube: KubeClient, sdd: dict[str, Any], reason: str, message: str,
    *, transient: bool, logger: logging.Logger,
) -> None:
    meta = sdd["metadata"]
    name, namespace, generation = meta["name"], meta["namespace"], meta.get("generation", 1)
    if transient:
        engine_kept = kube.owned_deployment(namespace, name, meta["uid"]) is not None
        logger.warning(f"{reason} (will retry{', previous engine keeps serving' if engine_kept else ''}): {message}")
    else:
        engine_kept = False
        deleted = kube.delete_engine(namespace, name, meta["uid"])
        if LeaderWorkerSets(kube).delete_if_owned(namespace, leaderworkerset.leaderworkerset_name(name), meta["uid"]):
            deleted.append(f"{api.LWS_KIND} {name}")
        deleted += kube.delete_owned(namespace, {k: v for k, v in roles.child_names(name).items() if k != "Service"},
                                     meta["uid"])
        logger.warning(f"{reason}: {message}" + (f"; deleted {', '.join(deleted)}" if deleted else "; nothing deployed"))
    _event(sdd, warning=True, reason=reason, message=message)
    kube.update_status(
        namespace, name,
        lambda cur, _o: status.plan_failed(
            cur, generation=generation, reason=reason, message=message,
            transient=transient, engine_kept=engine_kept, now=status.now_rfc3339(),
        ),
    )


def _child_event(event: dict[str, Any], body: kopf.Body, logger: logging.Logger, memo: kopf.Memo,
                 fold: Callable[[dict[str, Any], dict[str, Any], dict[str, Any] | None], dict[str, Any]],
                 ) -> tuple[dict[str, Any], dict[str, Any] | None] | None:
    """An engine child (Deployment, LeaderWorkerSet) changed: `fold(current, sdd, child)` it into
    its owner's status (child None: deleted) and say a phase change; -> (owner, child), or None
    for a child no resource controls."""
    owner = controller_owner(body)
    if owner is None:
        return None
    kube: KubeClient = memo.kube
    namespace = body["metadata"]["namespace"]
    child = None if event.get("type") == "DELETED" else plain(body)

    def compute(current: dict[str, Any], sdd: dict[str, Any]) -> dict[str, Any]:
        if sdd["metadata"].get("uid") != owner.get("uid"):
            return current  # a new resource with the old name; its own reconcile decides
        return fold(current, sdd, child)

    result = kube.update_status(namespace, owner["name"], compute)
    if result is not None:
        # The child carries the resource's name, so kopf's "[namespace/name]" prefix fits.
        _phase_changed(kube, namespace, owner["name"], *result, logger)
    return owner, child


def deployment_event(
    event: dict[str, Any], body: kopf.Body, logger: logging.Logger, memo: kopf.Memo, **_: Any
) -> None:
    """An engine Deployment changed: fold its replica counts into the owner's status."""
    kube: KubeClient = memo.kube
    namespace, name = body["metadata"]["namespace"], body["metadata"]["name"]

    def fold(current: dict[str, Any], sdd: dict[str, Any], deployment: dict[str, Any] | None) -> dict[str, Any]:
        owner_name, generation = sdd["metadata"]["name"], sdd["metadata"].get("generation", 1)
        if roles.is_disaggregated(sdd["spec"]):
            return status.serving_roles(current, role_deployments(kube, namespace, owner_name),
                                        generation=generation, now=status.now_rfc3339())
        if name != deployment_name(owner_name) or _spans_nodes(current):
            return current  # a leftover of the other mode, about to be deleted
        new = status.serving(current, deployment, generation=generation, now=status.now_rfc3339())
        if deployment is not None and new.get("phase") != current.get("phase"):
            # Events trail the reconciler's own read of the Deployment: a phase change is decided on
            # the Deployment as it is now, never on an older view (a Ready -> Deploying flicker).
            latest = kube.get_deployment(namespace, name)
            new = status.serving(current, latest, generation=generation, now=status.now_rfc3339())
        return new

    seen = _child_event(event, body, logger, memo, fold)
    if seen is not None and seen[1] is None:
        _restore_deleted_engine(namespace, seen[0], kube, memo.options, logger, name)


def pod_event(event: dict[str, Any], body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    """An engine pod changed: say in its resource's status what keeps the engine from being ready
    (desired/pods.py), or nothing once nothing does. Pods that block nothing, of a resource whose
    status says nothing is blocked, cost no API call (most pod events: a scale test's hundreds)."""
    meta = body["metadata"]
    namespace, name = meta["namespace"], (meta.get("labels") or {}).get(api.LABEL_INSTANCE)
    if not name or (meta.get("labels") or {}).get(api.ROLE_LABEL):
        return  # disaggregated roles' pods: their counts only (serving_roles)
    key = (namespace, name)
    pod = None if event.get("type") == "DELETED" else plain(body)
    this = engine_pods.pod_blocked(pod) if pod is not None else None
    if (this is None or this.reason == api.REASON_ENGINE_LOADING) and not memo.blocked_engines.get(key):
        # Starting pods (most pod events) are the metrics loop's to report as loading.
        return
    kube: KubeClient = memo.kube
    selector = ",".join(f"{k}={v}" for k, v in selector_labels(name).items())
    pods = kube.list_pods(namespace, selector)
    logs = {p["metadata"]["name"]: kube.pod_log_tail(namespace, p["metadata"]["name"], engine_pods.ENGINE_CONTAINER,
                                                     engine_pods.LOG_LINES)
            for p in pods if engine_pods.needs_logs(p)}

    def compute(current: dict[str, Any], sdd: dict[str, Any]) -> dict[str, Any]:
        if roles.is_disaggregated(sdd["spec"]):
            return current
        weights = int((current.get("plan") or {}).get("weightBytes") or 0)
        found = engine_pods.blocked(pods, logs, weight_bytes=weights)
        deployment = kube.get_deployment(namespace, deployment_name(name))
        return status.engine_pods(current, deployment, found.to_dict() if found else None,
                                  generation=sdd["metadata"].get("generation", 1), now=status.now_rfc3339())

    result = kube.update_status(namespace, name, compute)
    if result is None:
        memo.blocked_engines.pop(key, None)
        return
    old, new = result
    memo.blocked_engines[key] = "blockedBy" in new
    if old.get("blockedBy") != new.get("blockedBy") and new.get("blockedBy"):
        # Logged, not posted as an event on the pod (kopf would post a pod handler's lines there).
        log.info(f"[{namespace}/{name}] engine not ready: {new['blockedBy']['reason']}: {new['blockedBy']['message']}")
    # The pod that stops blocking may be the one whose event turns the resource Ready first (the
    # Deployment's event then finds the phase already written): said here too, once.
    _phase_changed(kube, namespace, name, old, new, log, prefix=f"[{namespace}/{name}] ")


def group_poll(body: kopf.Body, logger: logging.Logger, memo: kopf.Memo, **_: Any) -> None:
    """A plan across nodes: read its LeaderWorkerSet every GROUP_POLL_S and fold it in as
    group_event does. kopf watches LeaderWorkerSets only once discovery lists the API, and it
    looks again only on the CRD's events: where discovery lags the CRD's last event (LWS
    installed while the operator runs), the watch never starts and the status would stay as the
    apply left it. Nothing is written when nothing changed."""
    meta = body["metadata"]
    group = LeaderWorkerSets(memo.kube).get(meta["namespace"], meta["name"])
    if group is not None and controller_owner(group) is not None:
        group_event({"type": "MODIFIED"}, group, logger, memo)


def group_event(
    event: dict[str, Any], body: kopf.Body, logger: logging.Logger, memo: kopf.Memo, **_: Any
) -> None:
    """An engine LeaderWorkerSet changed: fold its group counts into the owner's status."""

    def fold(current: dict[str, Any], sdd: dict[str, Any], group: dict[str, Any] | None) -> dict[str, Any]:
        if not _spans_nodes(current):
            return current  # a leftover about to be deleted
        return status.serving(current, leaderworkerset.deployment_view(group),
                              generation=sdd["metadata"].get("generation", 1), now=status.now_rfc3339())

    seen = _child_event(event, body, logger, memo, fold)
    if seen is not None and seen[1] is None:
        _restore_deleted_engine(body["metadata"]["namespace"], seen[0], memo.kube, memo.options, logger,
                                body["metadata"]["name"], group=True)


def _phase_changed(kube: KubeClient, namespace: str, name: str, old: dict[str, Any], new: dict[str, Any],
                   logger: logging.Logger, prefix: str = "") -> None:
    """One log line per phase change, whoever wrote it (the reconciler or a watch); an event when
    the resource turns Ready. prefix: the "[namespace/name] " a logger that is not the
    resource's own (kopf's) lacks."""
    if old.get("phase") == new.get("phase") or new.get("phase") is None:
        return
    ready = (status.get_condition(new, api.READY) or {}).get("message", "")
    logger.info(f"{prefix}status: phase {old.get('phase') or 'new'} -> {new.get('phase')} ({ready})")
    if new.get("phase") == api.PHASE_READY:
        sdd = kube.get_sdd(namespace, name)
        if sdd is not None:
            _event(sdd, warning=False, reason=api.EVENT_READY, message=ready)


def _restore_deleted_engine(
    namespace: str, owner: dict[str, Any], kube: KubeClient, options: OperatorOptions, logger: logging.Logger,
    deleted: str, *, group: bool = False,
) -> None:
    """Someone deleted the engine Deployment (`group`: LeaderWorkerSet) of a resource that should
    be serving: apply it again. (Deletions the operator made itself, or by garbage collection,
    leave no planned, live owner.)"""
    sdd = kube.get_sdd(namespace, owner["name"])
    if sdd is None or sdd["metadata"].get("uid") != owner.get("uid") or sdd["metadata"].get("deletionTimestamp"):
        return
    current = sdd.get("status") or {}
    if _spans_nodes(current) != group:
        return  # the other mode's child, removed by converge
    if not group:
        if roles.is_disaggregated(sdd["spec"]):
            wanted = [roles.role_deployment_name(owner["name"], role) for role in api.SPLIT_ROLES]
        else:
            wanted = [deployment_name(owner["name"])]
        if deleted not in wanted:
            return  # the other mode's leftover, deleted by converge
    plan_ready = status.get_condition(current, api.PLAN_READY) or {}
    if (
        is_paused(sdd["metadata"])
        or plan_ready.get("status") != "True"
        or current.get("observedGeneration") != sdd["metadata"].get("generation")
    ):
        return
    message = f"engine {api.LWS_KIND if group else 'Deployment'} deleted from outside; applying it again"
    logger.warning(message)
    if not group:
        _event(sdd, warning=True, reason=api.EVENT_DEPLOYMENT_DELETED, message=message)
    try:
        converge(sdd, kube, options, logger)
    except (kopf.TemporaryError, kopf.PermanentError):
        pass  # converge has written the reason to status; the next spec change or restart retries


def collect_engine_metrics(kube: KubeClient, namespaces: list[str] | None,
                           rates: serving_metrics.TokenRate | None = None) -> None:
    """Scrape the ready engine pods' /metrics of every serving resource into status.serving
    (the Accept length column). An operator-wide loop rather than a kopf timer: timers need a
    finalizer on each resource, and deleting a resource must never wait for the operator."""
    scraped: list[str] = []
    with serving_metrics.http_client() as http:
        for sdd in kube.list_sdds(namespaces):
            scraped += _collect_one(kube, sdd, rates, http)
    if rates is not None:
        rates.forget_except(scraped)


def _collect_one(kube: KubeClient, sdd: dict[str, Any], rates: serving_metrics.TokenRate | None,
                 http: Any) -> list[str]:
    """One resource's round of collect_engine_metrics; -> the URLs that answered."""
    meta = sdd["metadata"]
    if is_paused(meta) or (sdd.get("status") or {}).get("phase") not in (api.PHASE_READY, api.PHASE_DEPLOYING):
        return []
    # A LeaderWorkerSet's worker pods serve no HTTP: only its leaders have /metrics.
    labels = (leaderworkerset.leader_selector(meta["name"]) if _spans_nodes(sdd.get("status") or {})
              else selector_labels(meta["name"]))
    selector = ",".join(f"{k}={v}" for k, v in labels.items())
    pods = kube.list_pods(meta["namespace"], selector)
    _report_loading(kube, sdd, pods, http)
    urls = serving_metrics.ready_pod_metrics_urls(pods)
    answered: list[str] = []
    samples, errors = serving_metrics.scrape(urls, answered=answered, client=http)
    for error in errors:
        log.debug(f"[{meta['namespace']}/{meta['name']}] metrics not scraped: {error}")
    now_s = time.monotonic()
    per_pod = [rates.rate(url, now_s, sample) for url, sample in zip(answered, samples)] if rates else None
    figures = serving_metrics.summarize(samples, per_pod)
    if figures:
        kube.update_status(meta["namespace"], meta["name"], lambda cur, _o, f=figures: status.engine_metrics(cur, f))
    verdict = desired_addons.exported_metric_check(sdd, [set(s.names) for s in samples])
    if verdict is not None:
        log.warning(f"[{meta['namespace']}/{meta['name']}] {verdict.reason}: {verdict.message}")
        generation = meta.get("generation", 1)
        kube.update_status(meta["namespace"], meta["name"], lambda cur, _o, v=verdict, g=generation:
                           desired_addons.set_addon_condition(cur, v, generation=g, now=status.now_rfc3339()))
    return answered


def _report_loading(kube: KubeClient, sdd: dict[str, Any], pods: list[dict[str, Any]], http: Any = None) -> None:
    """A resource still Deploying whose pods only load: say so (the pod watch reports the rest)."""
    current = sdd.get("status") or {}
    if current.get("phase") != api.PHASE_DEPLOYING or roles.is_disaggregated(sdd["spec"]):
        return
    weights = int((current.get("plan") or {}).get("weightBytes") or 0)
    found = engine_pods.blocked(pods, weight_bytes=weights)
    was = current.get("blockedBy")
    if found is None or found.reason != api.REASON_ENGINE_LOADING or (was and was["reason"] != found.reason):
        return
    # How far the loading pods are, from their /health (the engine's bytes loaded of the plan's).
    progress = serving_metrics.loading_progress(serving_metrics.loading_pod_health_urls(pods), client=http)
    if progress:
        found = engine_pods.blocked(pods, progress=progress, weight_bytes=weights) or found
    if was == found.to_dict():
        return
    meta = sdd["metadata"]

    def compute(cur: dict[str, Any], obj: dict[str, Any]) -> dict[str, Any]:
        deployment = kube.get_deployment(meta["namespace"], deployment_name(meta["name"]))
        return status.engine_pods(cur, deployment, found.to_dict(), generation=obj["metadata"].get("generation", 1),
                                  now=status.now_rfc3339())

    kube.update_status(meta["namespace"], meta["name"], compute)


async def _metrics_loop(kube: KubeClient, options: OperatorOptions) -> None:
    rates = serving_metrics.TokenRate()
    while True:
        await asyncio.sleep(options.metrics_interval_s)
        try:
            await asyncio.to_thread(collect_engine_metrics, kube, options.namespaces, rates)
        except Exception as err:  # noqa: BLE001 - one failed round must not end the loop
            log.warning(f"engine metrics round failed: {type(err).__name__}: {err}")


def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, options: OperatorOptions, **_: Any) -> None:
    # Events for every decision (handlers.py's _event, posted whatever the level) and for every
    # warning logged, signed by this operator (not "kopf"). The INFO log lines are not posted:
    # they repeat the decision events (and kopf's bookkeeping would be posted too, four or five
    # POSTs per create competing with the creates under a burst: docs/reliability.md).
    settings.posting.level = logging.WARNING
    settings.posting.reporting_component = MANAGED_BY
    settings.posting.reporting_instance = socket.gethostname()
    settings.posting.event_name_prefix = "specdeploy-"
    # kopf keeps its handler bookkeeping in annotations only, so that it never competes with
    # update_status for the status subresource.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage()
    settings.watching.server_timeout = 300
    # The handlers are synchronous and spend their time waiting on the API server (a reconcile is
    # about ten requests, a Deployment event two or three): asyncio's default pool of cpu + 4
    # threads queued hundreds of resources behind a few in-flight requests (create -> Deployment
    # p99 41 s for 200 resources on 2 cores; tests/operator/test_scale.py).
    settings.execution.max_workers = HANDLER_THREADS
    memo.options = options
    # A kept-alive connection per thread that calls the API (the handlers', the metrics loop's):
    # the client's default pool, 5 per CPU, is 10 on two cores, and every thread beyond it
    # opened and closed a TLS connection per request.
    memo.kube = KubeClient(new_api_client(pool_connections=HANDLER_THREADS + 2))
    memo.blocked_engines = {}  # (namespace, name) -> whether its status names a blocked engine


def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
    """kopf's own credential readers: the pod's service account, else KUBECONFIG as it is now."""
    return kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)


def build_registry(options: OperatorOptions) -> kopf.OperatorRegistry:
    registry = kopf.OperatorRegistry()
    kopf.on.login(registry=registry)(login)

    async def startup(settings: kopf.OperatorSettings, memo: kopf.Memo, **kwargs: Any) -> None:
        configure(settings, memo, options, **kwargs)
        if options.metrics_interval_s > 0:
            memo.metrics_task = asyncio.create_task(_metrics_loop(memo.kube, options))

    async def cleanup(memo: kopf.Memo, **_: Any) -> None:
        task = getattr(memo, "metrics_task", None)
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    kopf.on.startup(registry=registry)(startup)
    kopf.on.cleanup(registry=registry)(cleanup)
    for cause, on in (("create", kopf.on.create), ("update", kopf.on.update), ("resume", kopf.on.resume)):
        # No deletion handler, hence no finalizer: children go by garbage collection, and a
        # resource deleted while the operator is down is not stuck waiting for it.
        on(GROUP, VERSION, PLURAL, registry=registry, id=f"reconcile-{cause}")(reconcile)
    kopf.on.event(
        "apps", "v1", "deployments", registry=registry, id=DEPLOYMENT_HANDLER_ID,
        labels={LABEL_MANAGED_BY: MANAGED_BY},
    )(deployment_event)
    kopf.on.event(
        "", "v1", "pods", registry=registry, id=POD_HANDLER_ID, labels={LABEL_MANAGED_BY: MANAGED_BY},
    )(pod_event)
    # Watched only while the cluster serves the API (kopf follows CRDs coming and going).
    kopf.on.event(
        api.LWS_GROUP, api.LWS_VERSION, api.LWS_PLURAL, registry=registry, id=GROUP_HANDLER_ID,
        labels={LABEL_MANAGED_BY: MANAGED_BY},
    )(group_event)
    kopf.timer(
        GROUP, VERSION, PLURAL, registry=registry, id=GROUP_POLL_ID, interval=GROUP_POLL_S,
        when=lambda status, **_: _spans_nodes(status or {}),
    )(group_poll)
    return registry
