"""The pods' security contexts and the writable volumes a read-only root filesystem needs (pure).

Every pod the operator renders runs as the image's non-root user (65532, Dockerfile.engine), with
the Pod Security Standards' "restricted" profile: runAsNonRoot, no privilege escalation, every
capability dropped, seccomp RuntimeDefault, and a read-only root filesystem. What the engine
writes goes to volumes of the pod's own:

    /tmp                 emptyDir   TMPDIR: Python's tempfile, Mooncake's scratch
    /home/specdeploy     emptyDir   HOME: Triton's compiled kernels (~/.triton), torch's caches (~/.cache)
    /var/cache/huggingface          the model cache (render.py: emptyDir or a claim), HF_HOME
    /dev/shm             emptyDir   memory-backed, NCCL's buffers (render.py)

fsGroup 65532 makes a claim's files writable by that user. spec.pod.securityContext and
spec.pod.containerSecurityContext are merged over these defaults field by field (a cluster that
assigns uids itself, as OpenShift's restricted SCC does, wants the uid the namespace allows set
there as runAsUser, runAsGroup and fsGroup). A split role on RDMA
(transferProtocol rdma) keeps IPC_LOCK: registering pinned memory with the NIC needs it.
"""

from __future__ import annotations

import copy
from typing import Any

ENGINE_UID = 65532  # Dockerfile.engine's USER
ENGINE_HOME = "/home/specdeploy"
TMP_PATH = "/tmp"
TMP_VOLUME = "tmp"
HOME_VOLUME = "home"
RDMA_CAPABILITIES = ("IPC_LOCK",)


def pod_security_context(user: dict[str, Any] | None = None) -> dict[str, Any]:
    context: dict[str, Any] = {
        "runAsNonRoot": True,
        "runAsUser": ENGINE_UID,
        "runAsGroup": ENGINE_UID,
        "fsGroup": ENGINE_UID,
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    context.update(copy.deepcopy(user or {}))
    return context


def container_security_context(user: dict[str, Any] | None = None, add: tuple[str, ...] = ()) -> dict[str, Any]:
    context: dict[str, Any] = {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "capabilities": {"drop": ["ALL"], **({"add": list(add)} if add else {})},
    }
    context.update(copy.deepcopy(user or {}))
    return context


def writable_volumes() -> list[dict[str, Any]]:
    return [{"name": TMP_VOLUME, "emptyDir": {}}, {"name": HOME_VOLUME, "emptyDir": {}}]


def harden(pod: dict[str, Any], settings: dict[str, Any], add_capabilities: tuple[str, ...] = ()) -> None:
    """Security contexts, the writable volumes and HOME/TMPDIR on a pod spec, in place.
    `settings`: scheduling.pod_settings() (its securityContext and containerSecurityContext)."""
    pod["securityContext"] = pod_security_context(settings.get("securityContext"))
    names = {v["name"] for v in pod.get("volumes") or []}
    pod["volumes"] = [*(pod.get("volumes") or []), *(v for v in writable_volumes() if v["name"] not in names)]
    for container in pod["containers"]:
        container["securityContext"] = container_security_context(settings.get("containerSecurityContext"),
                                                                  add_capabilities)
        mounts = container.setdefault("volumeMounts", [])
        for name, path in ((TMP_VOLUME, TMP_PATH), (HOME_VOLUME, ENGINE_HOME)):
            if not any(m["mountPath"] == path for m in mounts):
                mounts.append({"name": name, "mountPath": path})
        env = container.setdefault("env", [])
        given = {var["name"] for var in env}
        env += [{"name": k, "value": v} for k, v in (("HOME", ENGINE_HOME), ("TMPDIR", TMP_PATH)) if k not in given]
