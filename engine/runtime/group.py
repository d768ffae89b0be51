"""Ranks across pods: one tensor-parallel group over the pods of a LeaderWorkerSet group.

Every pod runs the same `specdeploy engine serve` command; LWS tells each where it stands through
LWS_LEADER_ADDRESS (the leader pod's DNS name), LWS_GROUP_SIZE (pods in the group) and
LWS_WORKER_INDEX (0 on the leader). With R = tensor_parallel_size / pods ranks per pod, pod i
holds ranks i*R .. i*R+R-1 on its GPUs 0..R-1; its first rank is its own process, the others its
children (distributed.Workers), as on one node. The leader's rank 0 owns HTTP and the scheduler.

Before torch.distributed is touched, the pods meet on a plain TCP port of the leader
(`port`, default GROUP_PORT): each worker pod resolves the leader's address (retrying while its
DNS record appears), connects, and says which pod it is; the leader waits until every worker pod
has joined, or fails after `timeout_s` with one line naming the ranks that never came. Only then
does every rank join the torch group (its store on the leader at port + 1), so a missing pod is
a named rendezvous error instead of torch's anonymous store timeout.

The same connections then watch the group: both ends send a heartbeat every HEARTBEAT_S and
treat a closed connection, or HEARTBEAT_TIMEOUT_S without a byte, as the other side gone. A worker
pod that dies closes its socket (the leader notices at once); a node that vanishes stops sending
(noticed within HEARTBEAT_TIMEOUT_S). Either way the leader stops with exit code 1, so LWS
(RecreateGroupOnPodRestart) recreates the whole group; a worker pod whose leader is gone exits
the same way. Nothing here imports torch: it runs before the group exists.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

log = logging.getLogger("specdeploy.engine.group")

LEADER_ADDRESS_ENV = "LWS_LEADER_ADDRESS"
GROUP_SIZE_ENV = "LWS_GROUP_SIZE"
WORKER_INDEX_ENV = "LWS_WORKER_INDEX"
NODE_NAME_ENV = "NODE_NAME"  # the pod's spec.nodeName (the operator sets it), for log lines

# The leader's rendezvous and watch port; torch's store listens on the next one.
GROUP_PORT = 8471
# How long the leader waits for every worker pod, and a worker pod for the leader (pods of a
# group are scheduled together, but each pulls its image and resolves DNS at its own pace).
RENDEZVOUS_TIMEOUT_S = 600.0
HEARTBEAT_S = 1.0
# A peer silent this long is gone: the bound on noticing a lost node (a dead process closes its
# socket, which is noticed at once).
HEARTBEAT_TIMEOUT_S = 10.0
RETRY_S = 0.5


class GroupError(RuntimeError):
    """The group cannot form; the message is the one line to log before exiting."""


@dataclass(frozen=True)
class PodGroup:
    """This pod's place in its LWS group."""

    leader_address: str
    size: int  # pods
    index: int  # this pod; 0 is the leader
    node: str
    port: int = GROUP_PORT

    @property
    def is_leader(self) -> bool:
        return self.index == 0

    def ranks(self, ranks_per_pod: int, index: int | None = None) -> range:
        """The global tensor-parallel ranks of pod `index` (default: this pod)."""
        first = (self.index if index is None else index) * ranks_per_pod
        return range(first, first + ranks_per_pod)

    def init_method(self, leader_ip: str | None = None) -> str:
        """torch.distributed's rendezvous: the store rank 0 serves on the leader (on every
        interface). The leader pod's own ranks reach it on loopback; a worker pod's at the address
        it resolved the leader to (so that torch never resolves the name a second time)."""
        host = "127.0.0.1" if self.is_leader else leader_ip or self.leader_address
        return f"tcp://{host}:{self.port + 1}"


def pod_group(env: Mapping[str, str] | None = None, port: int = GROUP_PORT) -> PodGroup | None:
    """This pod's group from LWS's variables; None outside a LeaderWorkerSet (none set). A
    variable that is set but unusable is a GroupError naming it."""
    env = os.environ if env is None else env
    names = (LEADER_ADDRESS_ENV, GROUP_SIZE_ENV, WORKER_INDEX_ENV)
    given = [n for n in names if env.get(n)]
    if not given:
        return None
    missing = [n for n in names if not env.get(n)]
    if missing:
        raise GroupError(f"{', '.join(given)} set but not {', '.join(missing)}: LeaderWorkerSet sets all three")
    size, index = _int(env, GROUP_SIZE_ENV), _int(env, WORKER_INDEX_ENV)
    if size < 1:
        raise GroupError(f"{GROUP_SIZE_ENV}={size}: a group has at least one pod")
    if not 0 <= index < size:
        raise GroupError(f"{WORKER_INDEX_ENV}={index} is not a pod of a group of {size} ({GROUP_SIZE_ENV})")
    if not 0 < port < 65535:
        raise GroupError(f"group port {port} is not a TCP port below 65535 (the store takes port + 1)")
    node = env.get(NODE_NAME_ENV) or socket.gethostname()
    return PodGroup(env[LEADER_ADDRESS_ENV], size, index, node, port)


def _int(env: Mapping[str, str], name: str) -> int:
    try:
        return int(env[name])
    except ValueError:
        raise GroupError(f"{name}={env[name]!r} is not an integer") from None


def resolve(address: str, deadline: float) -> str:
    """The leader's IP address, retrying until `deadline` (monotonic): its DNS record appears
    only once the leader pod has an address."""
    while True:
        try:
            return socket.getaddrinfo(address, None, type=socket.SOCK_STREAM)[0][4][0]
        except (socket.gaierror, UnicodeError) as err:
            if time.monotonic() >= deadline:
                raise GroupError(f"the leader address {address!r} ({LEADER_ADDRESS_ENV}) does not resolve: "
                                 f"{getattr(err, 'strerror', None) or err}") from None
            time.sleep(RETRY_S)


def _span(ranks: range) -> str:
    return f"rank {ranks.start}" if len(ranks) == 1 else f"ranks {ranks.start}-{ranks.stop - 1}"


class _Peer:
    """One end of a leader <-> worker-pod connection once the group has formed: heartbeats out,
    and a reader that calls `lost` when the other side closes or falls silent."""

    def __init__(self, sock: socket.socket, name: str, lost: Callable[[str], None]) -> None:
        self.sock, self.name, self._lost = sock, name, lost
        self.closing = threading.Event()
        sock.settimeout(HEARTBEAT_TIMEOUT_S)
        threading.Thread(target=self._beat, name=f"group-beat-{name}", daemon=True).start()
        threading.Thread(target=self._read, name=f"group-watch-{name}", daemon=True).start()

    def _beat(self) -> None:
        while not self.closing.wait(HEARTBEAT_S):
            try:
                self.sock.sendall(b"\n")
            except OSError:
                return  # the reader reports it

    def _read(self) -> None:
        while True:
            try:
                data = self.sock.recv(4096)
            except socket.timeout:
                why = f"no heartbeat for {HEARTBEAT_TIMEOUT_S:g} s"
                break
            except OSError as err:
                why = f"connection error: {err.strerror or err}"
                break
            if not data:
                why = "connection closed"
                break
            if b"bye" in data:  # the other side stops on purpose
                self.closing.set()
                return
        if not self.closing.is_set():
            self.closing.set()
            self._lost(f"{self.name}: {why}")

    def close(self, say_bye: bool = True) -> None:
        self.closing.set()
        with _quiet():
            if say_bye:
                self.sock.sendall(b"bye\n")
            self.sock.close()


class _quiet:
    def __enter__(self):
        return self

    def __exit__(self, kind, err, tb):
        return kind is not None and issubclass(kind, OSError)


def _send(sock: socket.socket, message: dict) -> None:
    sock.sendall(json.dumps(message).encode() + b"\n")


def _read_line(sock: socket.socket, deadline: float) -> dict:
    data = b""
    while b"\n" not in data:
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        chunk = sock.recv(4096)
        if not chunk:
            raise ConnectionError("closed before a full message")
        data += chunk
    return json.loads(data.split(b"\n", 1)[0])


class Leader:
    """The leader pod's side: listen, wait for every worker pod, release them, watch them."""

    def __init__(self, group: PodGroup, ranks_per_pod: int, lost: Callable[[str], None]) -> None:
        self.group, self.ranks_per_pod, self._lost = group, ranks_per_pod, lost
        self.peers: dict[int, _Peer] = {}
        self._server = socket.create_server(("", group.port), backlog=group.size, reuse_port=False)

    def wait_for_workers(self, timeout_s: float = RENDEZVOUS_TIMEOUT_S) -> dict[int, str]:
        """Accept each worker pod's hello until all have joined: -> pod index -> node. GroupError
        naming the pods (and ranks) that did not join within timeout_s."""
        deadline = time.monotonic() + timeout_s
        joined: dict[int, tuple[socket.socket, str]] = {}
        wanted = set(range(1, self.group.size))
        while wanted - set(joined):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                for sock, _ in joined.values():
                    sock.close()
                missing = sorted(wanted - set(joined))
                raise GroupError("rendezvous timeout: " + "; ".join(
                    f"worker {i} ({_span(self.group.ranks(self.ranks_per_pod, i))})" for i in missing)
                    + f" did not join the leader at port {self.group.port} within {timeout_s:g} s")
            self._server.settimeout(remaining)
            try:
                sock, addr = self._server.accept()
            except socket.timeout:
                continue
            try:
                hello = _read_line(sock, min(deadline, time.monotonic() + HEARTBEAT_TIMEOUT_S))
                index, node = int(hello["index"]), str(hello.get("node", "?"))
            except (OSError, ValueError, KeyError, TypeError) as err:
                log.warning("group: a connection from %s is not a worker pod (%s); ignored", addr[0], err)
                sock.close()
                continue
            if index not in wanted or index in joined:
                log.warning("group: worker %d from %s: %s; ignored", index, addr[0],
                            "joined already" if index in joined else f"not a pod of a group of {self.group.size}")
                _send(sock, {"error": f"worker index {index} refused"})
                sock.close()
                continue
            joined[index] = (sock, node)
            log.info("group: worker %d (%s, node %s) joined from %s; %d of %d pods", index,
                     _span(self.group.ranks(self.ranks_per_pod, index)), node, addr[0], len(joined) + 1,
                     self.group.size)
        self._server.close()
        for index, (sock, node) in sorted(joined.items()):
            _send(sock, {"start": True})
            name = f"worker {index} ({_span(self.group.ranks(self.ranks_per_pod, index))}, node {node})"
            self.peers[index] = _Peer(sock, name, self._lost)
        return {index: node for index, (_, node) in joined.items()}

    def close(self) -> None:
        """The server is stopping on purpose: tell the worker pods so before the ranks exit."""
        with _quiet():
            self._server.close()
        for peer in self.peers.values():
            peer.close()


class Member:
    """A worker pod's side: join the leader and watch it."""

    def __init__(self, group: PodGroup, ranks_per_pod: int, lost: Callable[[str], None]) -> None:
        self.group, self.ranks_per_pod, self._lost = group, ranks_per_pod, lost
        self.peer: _Peer | None = None
        self.leader_ip: str | None = None  # what the leader's address resolved to

    def join(self, timeout_s: float = RENDEZVOUS_TIMEOUT_S) -> None:
        """Resolve and reach the leader, say which pod this is, and wait until the leader starts
        the group; GroupError (one line) when that does not happen within timeout_s."""
        deadline = time.monotonic() + timeout_s
        address = self.leader_ip = resolve(self.group.leader_address, deadline)
        where = f"the leader {self.group.leader_address} ({address}) port {self.group.port}"
        while True:
            try:
                sock = socket.create_connection((address, self.group.port), timeout=RETRY_S * 4)
                break
            except OSError as err:
                if time.monotonic() >= deadline:
                    raise GroupError(f"rendezvous timeout: {where} did not answer within {timeout_s:g} s "
                                     f"({err.strerror or err})") from None
                time.sleep(RETRY_S)
        ranks = _span(self.group.ranks(self.ranks_per_pod))
        try:
            _send(sock, {"index": self.group.index, "node": self.group.node})
            # The leader answers once every pod has joined (its own timeout may end it first).
            reply = _read_line(sock, deadline + HEARTBEAT_TIMEOUT_S)
        except (OSError, ValueError) as err:
            sock.close()
            raise GroupError(f"rendezvous: {where} did not start the group for worker {self.group.index} "
                             f"({ranks}) within {timeout_s:g} s ({err})") from None
        if "error" in reply:
            sock.close()
            raise GroupError(f"rendezvous: {where} refused worker {self.group.index}: {reply['error']}")
        self.peer = _Peer(sock, f"the leader {self.group.leader_address}", self._lost)

    def close(self) -> None:
        if self.peer is not None:
            self.peer.close()
