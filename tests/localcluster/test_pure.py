"""The local cluster's pure parts: pod-spec meaning, the kubelet API's log queries, SPDY framing,
the pod network's address plan, the state directory."""

from __future__ import annotations

import ipaddress
import struct
from pathlib import Path

import pytest

from specdeploy.localcluster import kubelet_api, netns, podspec, spdy, state


def test_command_of_uses_a_known_image_entrypoint_only_when_the_container_names_none():
    entry = podspec.DEFAULT_ENTRYPOINTS
    assert podspec.command_of({"name": "c", "image": "x", "command": ["python"], "args": ["-V"]}, entry) == ["python", "-V"]
    assert podspec.command_of({"name": "op", "image": "ghcr.io/specdeploy/operator:0.1.0", "args": ["operator"]},
                              entry) == ["specdeploy", "operator"]
    with pytest.raises(ValueError, match="entrypoint of image 'nginx' is not known"):
        podspec.command_of({"name": "web", "image": "nginx"}, entry)


def test_expand_vars_and_map_path():
    assert podspec.expand_vars("$(A)-$(B)-$$(A)", {"A": "1"}) == "1-$(B)-$(A)"
    mounts = [("/etc/specdeploy", Path("/tmp/p/cfg")), ("/opt", Path("/img"))]
    assert podspec.map_path("--plan=/etc/specdeploy/plan.json", mounts) == "--plan=/tmp/p/cfg/plan.json"
    assert podspec.map_path("/opt/specdeploy/demo", mounts) == "/img/specdeploy/demo"
    assert podspec.map_path("/optional", mounts) == "/optional"


def test_under_run_and_hosts_file():
    assert podspec.under_run(podspec.SERVICE_ACCOUNT_DIR) == "secrets/kubernetes.io/serviceaccount"
    assert podspec.under_run("/run/x/") == "x" and podspec.under_run("/etc/x") is None
    hosts = podspec.pod_hosts_file("10.213.0.7", "web-1", "10.213.0.1")
    assert "10.213.0.7\tweb-1\n" in hosts
    assert "10.213.0.1\tkubernetes kubernetes.default kubernetes.default.svc " in hosts


def test_backoff_doubles_up_to_five_minutes():
    delays = [podspec.BACKOFF_INITIAL_S]
    for _ in range(8):
        delays.append(podspec.next_backoff(delays[-1]))
    assert delays[:4] == [10, 20, 40, 80] and delays[-1] == podspec.BACKOFF_MAX_S == 300


def test_node_status_offers_only_the_internal_ip_and_the_kubelet_port():
    status = podspec.node_status(now="t", since="s", node_ip="10.213.0.1", hostname="local-0", kubelet_port=10250,
                                 cpu="2", memory="8Gi", kernel="k")
    assert status["addresses"][0] == {"type": "InternalIP", "address": "10.213.0.1"}
    assert status["daemonEndpoints"] == {"kubeletEndpoint": {"Port": 10250}}
    assert {c["type"]: c["status"] for c in status["conditions"]}["Ready"] == "True"


@pytest.mark.parametrize("data,lines,expected", [
    (b"a\nb\nc\n", 2, b"b\nc\n"), (b"a\nb\nc", 2, b"b\nc"), (b"a\nb\n", 5, b"a\nb\n"),
    (b"a\nb\n", 0, b""), (b"", 3, b""), (b"one\n", 1, b"one\n"),
])
def test_tail_offset(data, lines, expected):
    assert data[kubelet_api.tail_offset(data, lines):] == expected


def test_log_query():
    q = kubelet_api.LogQuery.parse("follow=true&tailLines=10&previous=false&limitBytes=5")
    assert q == kubelet_api.LogQuery(follow=True, previous=False, tail_lines=10, limit_bytes=5)
    assert kubelet_api.LogQuery.parse("") == kubelet_api.LogQuery()
    for bad in ("tailLines=x", "tailLines=-1"):
        with pytest.raises(ValueError):
            kubelet_api.LogQuery.parse(bad)


def test_spdy_frames_and_header_blocks_round_trip():
    client, server = spdy.HeaderCodec(), spdy.HeaderCodec()
    # A SYN_STREAM as the apiserver sends one: stream id, associated id, priority, header block.
    headers = {"streamtype": "data", "port": "8000", "requestid": "0"}
    frame = spdy.control_frame(spdy.SYN_STREAM, 0, struct.pack(">IIH", 3, 0, 0) + client.encode(headers))
    reader = spdy.FrameReader()
    assert reader.feed(frame[:5]) == []  # incomplete: nothing yet
    (got,) = reader.feed(frame[5:] + spdy.data_frame(3, b"hello", fin=True)[:4])
    stream_id, block = spdy.syn_stream_fields(got.payload)
    assert got.control and got.type == spdy.SYN_STREAM and stream_id == 3
    assert server.decode(block) == headers
    # The second block reuses the zlib stream (SPDY/3 keeps one per direction).
    assert server.decode(client.encode({"streamtype": "error", "requestid": "0"}))["streamtype"] == "error"
    (data,) = reader.feed(spdy.data_frame(3, b"hello", fin=True)[4:])
    assert not data.control and data.stream_id == 3 and data.payload == b"hello" and data.flags & spdy.FLAG_FIN
    with pytest.raises(spdy.ProtocolError):
        spdy.FrameReader().feed(struct.pack(">HHI", 0x8000 | 2, spdy.PING, 4) + b"\0\0\0\1")


def test_header_dictionary_is_spdy3s():
    import hashlib

    assert len(spdy.HEADER_DICTIONARY) == 1423
    assert hashlib.sha1(spdy.HEADER_DICTIONARY).hexdigest() == "d68ca9b208de9c3754703445a22cf668a5abebb3"


def test_pick_subnet_avoids_every_network_of_the_machine():
    net = ipaddress.ip_network
    assert netns.pick_subnet([net("10.0.0.0/16"), net("192.168.1.0/24")]) == net("10.213.0.0/24")
    assert netns.pick_subnet([net("10.213.0.0/24"), net("10.213.1.5/32")]) == net("10.213.2.0/24")
    with pytest.raises(netns.NetworkUnavailable):
        netns.pick_subnet([net("10.0.0.0/8")])


def test_interface_names_fit_linux_limits():
    bridge, veth, ns = netns.interface_names(state.tag_for(Path("/root/.local/state/specdeploy/clusters/local")), 253)
    assert state.tag_for(Path("/a/local")) != state.tag_for(Path("/b/local"))
    assert len(bridge) <= 15 and len(veth) <= 15 and ns.startswith("sd-")


def test_state_round_trips_and_names_are_checked(tmp_path):
    s = state.ClusterState(name="local", tag="abc123", apiserver_port=6443, network="netns", subnet="10.213.0.0/24",
                           node_ip="10.213.0.1", image_paths={"/opt/x": "/y"})
    assert state.ClusterState.from_json(s.to_json()) == s
    assert state.Layout(tmp_path).export_line() == f"export KUBECONFIG={tmp_path}/kubeconfig PATH={tmp_path}/bin:$PATH"
    for bad in ("", "Local", "-x", "a" * 21, "a/b"):
        with pytest.raises(ValueError):
            state.validate_name(bad)
