"""What keeps an engine from being ready, read from its pods (pure: pods and log lines in, one
reason and one message out).

The Deployment says only how many replicas are ready; why the others are not is in the pods,
where `kubectl describe pod` would find it. In order of what a person must fix first:
  OOMKilled          the container was killed for its memory limit (last state), with the limit
  CrashLoopBackOff   the engine exits: its exit code and the last lines it logged
  ImagePullBackOff / ErrImagePull / InvalidImageName   the image cannot be pulled, with the kubelet's message
  Unschedulable      no node fits, with the scheduler's message ("0/4 nodes are available: ...")
  EngineLoading      running, not ready yet: the engine loads the plan's weights (startup progress
                     when the engine reports it: bytes loaded of the plan's weight bytes)
Pods that are ready, or still being created, block nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from specdeploy.operator import api

ENGINE_CONTAINER = "engine"
# Log lines of a crashed engine quoted in the condition (the last ones: its one-line error).
LOG_LINES = 3
MAX_LOG_LINE_CHARS = 240
IMAGE_REASONS = (api.REASON_IMAGE_PULL_BACK_OFF, api.REASON_ERR_IMAGE_PULL, "InvalidImageName")


@dataclass(frozen=True)
class Blocked:
    reason: str
    message: str
    pod: str = ""

    def to_dict(self) -> dict[str, str]:
        return {"reason": self.reason, "message": self.message}


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def _engine_status(pod: dict[str, Any]) -> dict[str, Any]:
    statuses = (pod.get("status") or {}).get("containerStatuses") or []
    return next((s for s in statuses if s.get("name") == ENGINE_CONTAINER), statuses[0] if statuses else {})


def _memory_limit(pod: dict[str, Any]) -> str | None:
    for c in (pod.get("spec") or {}).get("containers") or []:
        if c.get("name") == ENGINE_CONTAINER:
            return ((c.get("resources") or {}).get("limits") or {}).get("memory")
    return None


def needs_logs(pod: dict[str, Any]) -> bool:
    """Whether the diagnosis of this pod quotes its previous container's log (a crash loop)."""
    waiting = (_engine_status(pod).get("state") or {}).get("waiting") or {}
    return waiting.get("reason") == api.REASON_CRASH_LOOP_BACK_OFF


def pod_blocked(pod: dict[str, Any], log_lines: list[str] | None = None,
                progress: dict[str, int] | None = None, weight_bytes: int = 0) -> Blocked | None:
    """Why this one pod is not ready, or None (ready, or simply not started yet)."""
    name = (pod.get("metadata") or {}).get("name", "?")
    st = pod.get("status") or {}
    if pod.get("metadata", {}).get("deletionTimestamp"):
        return None
    container = _engine_status(pod)
    if container.get("ready"):
        return None
    state, last = container.get("state") or {}, container.get("lastState") or {}
    waiting, terminated = state.get("waiting") or {}, last.get("terminated") or state.get("terminated") or {}
    restarts = int(container.get("restartCount") or 0)
    if terminated.get("reason") == api.REASON_OOM_KILLED:
        limit = _memory_limit(pod)
        return Blocked(api.REASON_OOM_KILLED,
                       f"pod {name}: the engine was killed for exceeding its memory limit"
                       f"{f' ({limit})' if limit else ''}, {restarts} restart(s); raise "
                       "spec.engine.resources.limits.memory or lower the context length / running requests", name)
    if waiting.get("reason") == api.REASON_CRASH_LOOP_BACK_OFF:
        code = terminated.get("exitCode", "?")
        lines = [line.strip()[:MAX_LOG_LINE_CHARS] for line in (log_lines or []) if line.strip()][-LOG_LINES:]
        said = f"; last log lines: {' | '.join(lines)}" if lines else ""
        return Blocked(api.REASON_CRASH_LOOP_BACK_OFF,
                       f"pod {name}: the engine exited with code {code} ({restarts} restart(s)){said}", name)
    if waiting.get("reason") in IMAGE_REASONS:
        image = container.get("image", "")
        return Blocked(waiting["reason"], f"pod {name}: image {image}: {waiting.get('message') or waiting['reason']}", name)
    scheduled: dict[str, Any] = next((c for c in st.get("conditions") or [] if c.get("type") == "PodScheduled"), {})
    if scheduled.get("status") == "False" and scheduled.get("reason") == api.REASON_UNSCHEDULABLE:
        return Blocked(api.REASON_UNSCHEDULABLE, f"pod {name}: {scheduled.get('message') or 'no node fits'}", name)
    running = state.get("running")
    if running is not None:
        # RFC 3339 as kubectl prints it (the Kubernetes client hands datetimes over as +00:00)
        since = str(running.get("startedAt") or "").replace("+00:00", "Z")
        if progress and progress.get("total_bytes"):
            done = f"{_gib(progress['loaded_bytes'])} of {_gib(progress['total_bytes'])} of weights loaded"
        elif weight_bytes:
            done = f"loading the plan's {_gib(weight_bytes)} of weights"
        else:
            done = "loading"
        return Blocked(api.REASON_ENGINE_LOADING, f"pod {name}: the engine is starting, {done}"
                       f"{f' (running since {since})' if since else ''}", name)
    return None


# Which reason speaks for the resource when pods disagree: what needs a person first.
_ORDER = (api.REASON_OOM_KILLED, api.REASON_CRASH_LOOP_BACK_OFF, *IMAGE_REASONS, api.REASON_UNSCHEDULABLE,
          api.REASON_ENGINE_LOADING)


def blocked(pods: list[dict[str, Any]], logs: dict[str, list[str]] | None = None,
            progress: dict[str, dict[str, int]] | None = None, weight_bytes: int = 0) -> Blocked | None:
    """What blocks the resource's engine pods (the most urgent of them), or None. `logs` and
    `progress` are by pod name."""
    found = [b for p in pods
             if (b := pod_blocked(p, (logs or {}).get(p["metadata"]["name"]),
                                  (progress or {}).get(p["metadata"]["name"]), weight_bytes)) is not None]
    if not found:
        return None
    found.sort(key=lambda b: _ORDER.index(b.reason) if b.reason in _ORDER else len(_ORDER))
    first = found[0]
    others = sum(1 for b in found if b.reason == first.reason) - 1
    return Blocked(first.reason, first.message + (f" (and {others} more pod(s) alike)" if others else ""), first.pod)
