"""Where a local cluster keeps its files, and what `cluster up` records about it (pure).

One directory per cluster name, `$XDG_STATE_HOME/specdeploy/clusters/<name>` (default
~/.local/state/...), holding everything the cluster made, so that `down` removes it all by
removing the directory and stopping what runs from it:

    state.json        what `up` decided: ports, the node's address and pod network, image paths
    kubeconfig        the admin kubeconfig (client certificate, system:masters)
    bin/              kubectl and helm of the server's version (links to the cached tools)
    control-plane/    kwokctl's work directory: PKI, etcd data, component logs
    node/             the local node: its pods' directories (logs, volumes), its certificate
    node.pid, logs/node.log
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

DEFAULT_NAME = "local"
DEFAULT_APISERVER_PORT = 6443
NODE_NAME = "local-0"
# The node lifecycle controller marks a silent node NotReady after this many seconds (50 on a
# real cluster); the local node beats every 5 s, so 20 s is four missed beats.
NODE_GRACE_S = 20
_NAME = re.compile(r"[a-z0-9]([a-z0-9-]{0,18}[a-z0-9])?")


def validate_name(name: str) -> str:
    if not _NAME.fullmatch(name):
        raise ValueError(f"cluster name {name!r}: 1-20 lowercase letters, digits and '-', not at either end")
    return name


def clusters_root() -> Path:
    base = Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state")
    return base / "specdeploy" / "clusters"


@dataclass
class ClusterState:
    name: str
    tag: str  # names the cluster's network namespaces and bridge (netns.interface_names)
    apiserver_port: int
    network: str  # "netns" or "loopback"
    subnet: str = ""
    node_ip: str = "127.0.0.1"
    image_paths: dict[str, str] = field(default_factory=dict)
    entrypoints: dict[str, list[str]] = field(default_factory=dict)
    path: str = ""  # PATH of the node's containers

    @property
    def kwok_name(self) -> str:
        return f"specdeploy-{self.name}"

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str) -> "ClusterState":
        return cls(**json.loads(text))


@dataclass(frozen=True)
class Layout:
    root: Path

    @property
    def state_file(self) -> Path:
        return self.root / "state.json"

    @property
    def kubeconfig(self) -> Path:
        return self.root / "kubeconfig"

    @property
    def bin_dir(self) -> Path:
        return self.root / "bin"

    @property
    def control_plane(self) -> Path:
        return self.root / "control-plane"

    @property
    def node_dir(self) -> Path:
        return self.root / "node"

    @property
    def node_pid(self) -> Path:
        return self.root / "node.pid"

    @property
    def node_log(self) -> Path:
        return self.root / "logs" / "node.log"

    def export_line(self) -> str:
        return f"export KUBECONFIG={self.kubeconfig} PATH={self.bin_dir}:$PATH"


def tag_for(root: Path) -> str:
    """Six characters naming the cluster's interfaces: stable for its directory, so `down` finds a
    crashed node's leftovers again, and distinct for two clusters of one name in two state
    directories (a user's and a test's)."""
    import hashlib

    return hashlib.sha256(str(root).encode()).hexdigest()[:6]
