"""The few namespaces a container process of a local node gets (Linux, root for the last two).

- It dies with the node: PR_SET_PDEATHSIG, so a killed node leaves no orphans running (its pods
  go NotReady with the node, as on a machine that lost power).
- Its pod's network namespace (`netns.py`): setns before exec.
- Its own mount namespace with the pod's run directory bound over /run and the pod's hosts file
  over /etc/hosts: what a container finds under /run and /var/run (above all its ServiceAccount
  token, whose path client libraries read literally) is the pod's, `kubernetes.default.svc`
  resolves to the node's relay to the apiserver (as the cluster DNS would), and the mounts go when
  the process does (no mount is ever made on the host's side);
- the image's paths (`image_binds`: /opt/specdeploy/demo and the like) at their own names, so a
  container sees the paths its image would have: the host directory is bound there; where the
  path's parent does not exist on this machine, the deepest existing ancestor is covered with a
  tmpfs that links back to every entry the ancestor had (kept visible under the pod's directory).

Everything else is this machine's: the filesystem, users, cgroups (no limits), the PID space.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
from pathlib import Path
from typing import Callable

PR_SET_PDEATHSIG = 1
CLONE_NEWNS = 0x00020000
CLONE_NEWNET = 0x40000000
MS_BIND, MS_REC, MS_PRIVATE = 0x1000, 0x4000, 0x40000

# Loaded before any fork: a child between fork and exec must not load libraries.
_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def preexec(netns: str | None = None, run_dir: Path | None = None, hosts_file: Path | None = None,
            image_binds: list[tuple[str, Path]] = (), shadow_dir: Path | None = None) -> Callable[[], None]:
    """The function Popen runs in the child before exec (`image_binds` need `run_dir`'s mount namespace)."""
    netns_path = f"/run/netns/{netns}".encode() if netns else None
    run = str(run_dir).encode() if run_dir else None
    hosts = str(hosts_file).encode() if hosts_file else None
    binds = [(c, str(h)) for c, h in image_binds]

    def enter() -> None:
        _check(_libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl(PR_SET_PDEATHSIG)")
        if netns_path:
            fd = os.open(netns_path, os.O_RDONLY)
            try:
                _check(_libc.setns(fd, CLONE_NEWNET), f"setns {netns_path.decode()}")
            finally:
                os.close(fd)
        if run:
            _check(_libc.unshare(CLONE_NEWNS), "unshare(CLONE_NEWNS)")
            _check(_libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None), "mount --make-rprivate /")
            _check(_libc.mount(run, b"/run", None, MS_BIND | MS_REC, None), f"bind {run.decode()} over /run")
            if hosts:
                _check(_libc.mount(hosts, b"/etc/hosts", None, MS_BIND, None), "bind the pod's hosts file over /etc/hosts")
            covered: set[str] = set()
            for container_path, host_path in binds:
                if not os.path.exists(container_path):
                    _make_path(container_path, shadow_dir, covered)
                _check(_libc.mount(host_path.encode(), container_path.encode(), None, MS_BIND | MS_REC, None),
                       f"bind {host_path} at {container_path}")

    return enter


def _make_path(path: str, shadow_dir: Path | None, covered: set[str]) -> None:
    """Make `path` exist inside this mount namespace only (see the module's note)."""
    ancestor = os.path.dirname(path)
    while not os.path.exists(ancestor):
        ancestor = os.path.dirname(ancestor)
    if ancestor not in covered:
        if shadow_dir is None:
            raise OSError(f"{path}: no such directory here, and no shadow directory to keep {ancestor} visible")
        original = os.path.join(str(shadow_dir), ancestor.lstrip("/"))
        os.makedirs(original, exist_ok=True)
        _check(_libc.mount(ancestor.encode(), original.encode(), None, MS_BIND | MS_REC, None), f"bind {ancestor} aside")
        _check(_libc.mount(b"tmpfs", ancestor.encode(), b"tmpfs", 0, b"mode=755"), f"tmpfs over {ancestor}")
        for name in os.listdir(original):
            os.symlink(os.path.join(original, name), os.path.join(ancestor, name))
        covered.add(ancestor)
    os.makedirs(path, exist_ok=True)
