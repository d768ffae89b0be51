"""engine/runtime/group.py on loopback: LWS's variables read (or refused, one line each), the
leader waiting for its worker pods (a missing one named with its ranks), an unresolvable leader,
and a lost peer noticed within the bound: at once when its socket closes, within
HEARTBEAT_TIMEOUT_S when it falls silent."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from specdeploy.engine.runtime import group as g


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


ENV = {"LWS_LEADER_ADDRESS": "lws-0.lws.ns", "LWS_GROUP_SIZE": "2", "LWS_WORKER_INDEX": "1", "NODE_NAME": "node-b"}


def test_outside_a_group():
    assert g.pod_group({}) is None


def test_group_from_lws_variables():
    pod = g.pod_group(ENV, port=9000)
    assert pod == g.PodGroup("lws-0.lws.ns", 2, 1, "node-b", 9000)
    assert not pod.is_leader
    assert pod.ranks(8) == range(8, 16) and pod.ranks(8, 0) == range(0, 8)
    assert pod.init_method("10.0.0.7") == "tcp://10.0.0.7:9001"
    assert g.PodGroup("lws-0.lws.ns", 2, 0, "node-a", 9000).init_method() == "tcp://127.0.0.1:9001"


@pytest.mark.parametrize(("env", "message"), [
    ({"LWS_GROUP_SIZE": "2"}, "LWS_GROUP_SIZE set but not LWS_LEADER_ADDRESS, LWS_WORKER_INDEX: LeaderWorkerSet sets all three"),
    ({**ENV, "LWS_GROUP_SIZE": "two"}, "LWS_GROUP_SIZE='two' is not an integer"),
    ({**ENV, "LWS_GROUP_SIZE": "0"}, "LWS_GROUP_SIZE=0: a group has at least one pod"),
    ({**ENV, "LWS_WORKER_INDEX": "2"}, "LWS_WORKER_INDEX=2 is not a pod of a group of 2 (LWS_GROUP_SIZE)"),
    ({**ENV, "LWS_WORKER_INDEX": "-1"}, "LWS_WORKER_INDEX=-1 is not a pod of a group of 2 (LWS_GROUP_SIZE)"),
])
def test_bad_variables_are_one_line(env, message):
    with pytest.raises(g.GroupError) as err:
        g.pod_group(env)
    assert str(err.value) == message


def test_unresolvable_leader_is_one_line():
    t0 = time.monotonic()
    with pytest.raises(g.GroupError) as err:
        g.resolve("no-such-leader.invalid", time.monotonic() + 1.0)
    assert str(err.value).startswith("the leader address 'no-such-leader.invalid' (LWS_LEADER_ADDRESS) does not resolve")
    assert "\n" not in str(err.value)
    assert time.monotonic() - t0 < 10


def pods(size: int, port: int) -> list[g.PodGroup]:
    return [g.PodGroup("127.0.0.1", size, i, f"node-{i}", port) for i in range(size)]


def test_leader_waits_for_every_worker_pod_then_watches_them():
    port = free_port()
    lost: list[str] = []  # the leader's
    member_lost: list[str] = []  # the first worker pod's
    leader_pod, *workers = pods(3, port)
    leader = g.Leader(leader_pod, 2, lost.append)
    members = [g.Member(workers[0], 2, member_lost.append), g.Member(workers[1], 2, lambda _: None)]
    threads = [threading.Thread(target=m.join, args=(30,)) for m in members]
    for t in threads:
        t.start()
    assert leader.wait_for_workers(30) == {1: "node-1", 2: "node-2"}
    for t in threads:
        t.join(30)
    assert all(m.peer is not None for m in members)
    time.sleep(3 * g.HEARTBEAT_S)  # heartbeats keep quiet peers alive
    assert lost == [] and member_lost == []
    # A worker pod that dies closes its socket: the leader knows at once.
    t0 = time.monotonic()
    members[1].peer.sock.shutdown(socket.SHUT_RDWR)  # as the kernel does for a process that dies
    while not lost and time.monotonic() - t0 < 5:
        time.sleep(0.01)
    assert lost[0].startswith("worker 2 (ranks 4-5, node node-2): connection")  # closed, or reset
    assert time.monotonic() - t0 < 1
    # Stopping on purpose is not a loss on either side.
    leader.close()
    time.sleep(3 * g.HEARTBEAT_S)
    members[0].close()
    assert len(lost) == 1 and member_lost == []


def test_a_silent_peer_is_lost_within_the_heartbeat_timeout(monkeypatch):
    monkeypatch.setattr(g, "HEARTBEAT_TIMEOUT_S", 2.0)
    port = free_port()
    lost: list[str] = []
    leader_pod, worker_pod = pods(2, port)
    leader = g.Leader(leader_pod, 1, lost.append)
    # A "worker" that joins and then never sends another byte (a node gone without a FIN).
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(b'{"index": 1, "node": "node-1"}\n')
    leader.wait_for_workers(10)
    t0 = time.monotonic()
    while not lost and time.monotonic() - t0 < 10:
        time.sleep(0.05)
    assert lost == ["worker 1 (rank 1, node node-1): no heartbeat for 2 s"]
    assert 1.5 < time.monotonic() - t0 < 4
    sock.close()
    leader.close()


def test_a_worker_that_never_joins_is_named():
    port = free_port()
    leader = g.Leader(pods(3, port)[0], 8, lambda _: None)
    member = g.Member(pods(3, port)[1], 8, lambda _: None)
    joined = threading.Thread(target=member.join, args=(30,))
    joined.start()
    with pytest.raises(g.GroupError) as err:
        leader.wait_for_workers(1.5)
    assert str(err.value) == (f"rendezvous timeout: worker 2 (ranks 16-23) did not join the leader at port {port} "
                              "within 1.5 s")
    joined.join(30)


def test_a_leader_that_never_answers_is_a_timeout():
    port = free_port()  # nothing listens there
    member = g.Member(pods(2, port)[1], 1, lambda _: None)
    with pytest.raises(g.GroupError) as err:
        member.join(1.0)
    assert str(err.value).startswith(f"rendezvous timeout: the leader 127.0.0.1 (127.0.0.1) port {port} did not "
                                     "answer within 1 s")


def test_strangers_and_unknown_pods_are_turned_away():
    port = free_port()
    leader_pod, worker_pod = pods(2, port)
    leader = g.Leader(leader_pod, 1, lambda _: None)
    stranger = socket.create_connection(("127.0.0.1", port))
    stranger.sendall(b"GET / HTTP/1.1\r\n\r\n")  # not a worker pod: ignored
    unknown = socket.create_connection(("127.0.0.1", port))
    unknown.sendall(b'{"index": 7, "node": "x"}\n')  # not a pod of this group: refused
    member = g.Member(worker_pod, 1, lambda _: None)
    joined = threading.Thread(target=member.join, args=(10,))
    joined.start()
    assert leader.wait_for_workers(10) == {1: "node-1"}
    joined.join(10)
    unknown.settimeout(5)
    assert b"worker index 7 refused" in unknown.recv(4096)
    for sock in (stranger, unknown):
        sock.close()
    leader.close()
    member.close()
