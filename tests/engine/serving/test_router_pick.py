"""The router's choice of backend (pure): the least loaded ready one, load being what this
router has in flight there plus what the server reports running and waiting, then the larger
share of free KV slots; URLs expanded to one backend per address their host resolves to."""

from __future__ import annotations

import pytest

from specdeploy.engine.serving.disagg.router import Backend, Pools, expand, pick


def backend(url, ready=True, running=0, waiting=0, in_flight=0, free=100, capacity=100):
    return Backend(url, "decode", ready=ready, running=running, waiting=waiting, in_flight=in_flight,
                   free_slots=free, capacity_slots=capacity)


def test_pick_least_loaded_ready_backend():
    a, b, c = backend("a", running=3), backend("b", running=1, waiting=1), backend("c", ready=False)
    assert pick([a, b, c]) is b
    b.in_flight = 2  # requests sent since the last status read count too
    assert pick([a, b, c]) is a
    # Equal queues: the larger share of free KV slots wins.
    d, e = backend("d", running=1, free=10), backend("e", running=1, free=60)
    assert pick([d, e]) is e
    assert pick([c]) is None and pick([]) is None


def test_expand_and_pool_membership():
    assert expand("http://127.0.0.1:8001/") == ["http://127.0.0.1:8001"]
    assert expand("http://no-such-host.invalid:8001") == ["http://no-such-host.invalid:8001"]
    with pytest.raises(ValueError, match="not an http"):
        expand("ftp://127.0.0.1")
    pools = Pools(["http://127.0.0.1:8001"], ["http://127.0.0.1:8002", "http://127.0.0.1:8002/"])
    pools.refresh_members()
    assert {b.url: b.role for b in pools.backends.values()} == {"http://127.0.0.1:8001": "prefill",
                                                                "http://127.0.0.1:8002": "decode"}
    kept = pools.backends["http://127.0.0.1:8002"]
    pools.decode_urls = ["http://127.0.0.1:8003"]
    pools.refresh_members()
    assert "http://127.0.0.1:8002" not in pools.backends and kept is not pools.backends.get("http://127.0.0.1:8003")
