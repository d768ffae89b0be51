"""Pod IPs that the Endpoints and EndpointSlice controllers accept: a network namespace per pod.

Needs root and iproute2's `ip`. A cluster gets a bridge (`sdb-<tag>`) holding the first address
of a private /24 that no route or address of this machine overlaps (picked from 10.213.0.0/16 at
`setup()`); each pod gets a namespace (`sd-<tag>-<n>`) with loopback and one veth end carrying
the pod's address, the other end on the bridge. A pod's namespace has no default route: it can
reach the bridge's /24 (the node, the other pods) and nothing else, so no packet leaves this
machine or the namespaces made here. The node's address (the bridge's) is the node's InternalIP:
the kubelet API, probes and the operator's scrapes go there and to pod IPs.

Everything made carries the cluster's tag, so `teardown(tag)` removes it whatever state a crashed
node left: every `sd-<tag>-*` namespace (its veth goes with it) and the bridge.

The address plan (`pick_subnet`, `interface_names`) is pure; the rest runs `ip`.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import os
import shutil
import subprocess
import threading
from pathlib import Path

log = logging.getLogger("specdeploy.localcluster.netns")

# 10.213.0.0/16: inside 10.0.0.0/8 (private, RFC 1918), a block few networks use; each cluster
# takes one /24 of it that nothing on this machine routes already.
CANDIDATE_BLOCK = ipaddress.ip_network("10.213.0.0/16")
NETNS_DIR = Path("/run/netns")
IFNAMSIZ = 15


class NetworkUnavailable(RuntimeError):
    """Namespaces cannot be made here (not root, or no `ip`): one line saying which."""


def pick_subnet(taken: list[ipaddress.IPv4Network], block: ipaddress.IPv4Network = CANDIDATE_BLOCK) -> ipaddress.IPv4Network:
    """The first /24 of `block` that overlaps none of `taken`."""
    for subnet in block.subnets(new_prefix=24):
        if not any(subnet.overlaps(t) for t in taken):
            return subnet
    raise NetworkUnavailable(f"every /24 of {block} overlaps a route or address of this machine")


def interface_names(tag: str, index: int) -> tuple[str, str, str]:
    """(bridge, host-side veth, namespace) names; interface names fit IFNAMSIZ."""
    bridge, veth = f"sdb-{tag}", f"sdv{tag}-{index}"
    if len(veth) > IFNAMSIZ or len(bridge) > IFNAMSIZ:
        raise ValueError(f"tag {tag!r} too long for interface names")
    return bridge, veth, f"sd-{tag}-{index}"


def available() -> str | None:
    """None when namespaces can be made here, else why not."""
    if os.geteuid() != 0:
        return "pod network namespaces need root"
    if shutil.which("ip") is None:
        return "pod network namespaces need iproute2's `ip` on PATH"
    return None


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL)
    if check and result.returncode != 0:
        raise NetworkUnavailable(f"ip {' '.join(args)}: {result.stderr.strip() or result.returncode}")
    return result


def taken_networks() -> list[ipaddress.IPv4Network]:
    taken = []
    for entry in json.loads(_ip("-j", "-4", "route", "show", "table", "all").stdout or "[]"):
        dst = entry.get("dst", "")
        if dst and dst != "default":
            try:
                taken.append(ipaddress.ip_network(dst, strict=False))
            except ValueError:
                pass
    for link in json.loads(_ip("-j", "-4", "addr").stdout or "[]"):
        for a in link.get("addr_info", []):
            taken.append(ipaddress.ip_network(f"{a['local']}/{a.get('prefixlen', 32)}", strict=False))
    return taken


class NamespaceNetwork:
    """One cluster's bridge and its pods' namespaces."""

    def __init__(self, tag: str, subnet: ipaddress.IPv4Network | None = None):
        self.tag = tag
        self.subnet = subnet
        self._lock = threading.Lock()
        self._next = 2  # .1 is the node
        self._free: list[int] = []

    @property
    def node_ip(self) -> str:
        assert self.subnet is not None
        return str(self.subnet.network_address + 1)

    @property
    def bridge(self) -> str:
        return interface_names(self.tag, 0)[0]

    def setup(self) -> "NamespaceNetwork":
        why = available()
        if why:
            raise NetworkUnavailable(why)
        teardown(self.tag)  # what a crashed node of this cluster left
        if self.subnet is None:
            self.subnet = pick_subnet(taken_networks())
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.node_ip}/{self.subnet.prefixlen}", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        log.info("pod network %s on bridge %s (node %s)", self.subnet, self.bridge, self.node_ip)
        return self

    def add_pod(self) -> tuple[str, str]:
        """A new namespace with its address: -> (namespace name, pod IP)."""
        assert self.subnet is not None
        with self._lock:
            index = self._free.pop(0) if self._free else self._next
            if index == self._next:
                self._next += 1
        if index >= self.subnet.num_addresses - 1:
            raise NetworkUnavailable(f"no address left in {self.subnet}")
        bridge, veth, ns = interface_names(self.tag, index)
        ip = str(self.subnet.network_address + index)
        _ip("netns", "del", ns, check=False)
        _ip("netns", "add", ns)
        try:
            _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("link", "set", veth, "master", bridge, "up")
            _ip("-n", ns, "addr", "add", f"{ip}/{self.subnet.prefixlen}", "dev", "eth0")
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "link", "set", "eth0", "up")
        except NetworkUnavailable:
            _ip("netns", "del", ns, check=False)
            raise
        return ns, ip

    def remove_pod(self, ns: str) -> None:
        _ip("netns", "del", ns, check=False)  # its eth0 goes, and with it the veth's other end
        index = int(ns.rsplit("-", 1)[1])
        with self._lock:
            self._free.append(index)


def namespaces_of(tag: str) -> list[str]:
    prefix = f"sd-{tag}-"
    try:
        return sorted(p.name for p in NETNS_DIR.iterdir() if p.name.startswith(prefix))
    except OSError:
        return []


def teardown(tag: str) -> list[str]:
    """Remove every namespace and the bridge of cluster `tag`; -> what was removed."""
    if available():
        return []
    removed = []
    for ns in namespaces_of(tag):
        _ip("netns", "del", ns, check=False)
        removed.append(ns)
    bridge = interface_names(tag, 0)[0]
    if _ip("link", "show", bridge, check=False).returncode == 0:
        _ip("link", "del", bridge, check=False)
        removed.append(bridge)
    # A namespace still held open by a process that outlived its pod keeps its veth pair after
    # `netns del`: the host side goes too (deleting one end removes the pair).
    for link in links_of(tag):
        if link.startswith(f"sdv{tag}-"):
            _ip("link", "del", link, check=False)
            removed.append(link)
    return removed


def links_of(tag: str) -> list[str]:
    """This cluster's interfaces still on the host (for `down`'s check that nothing is left)."""
    if shutil.which("ip") is None:
        return []
    names = [link.get("ifname", "") for link in json.loads(_ip("-j", "link", check=False).stdout or "[]")]
    return [n for n in names if n in (f"sdb-{tag}",) or n.startswith(f"sdv{tag}-")]
