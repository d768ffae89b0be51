"""`specdeploy plan ORG/NAME`'s hub reader (urllib) against a hostile hub on loopback: a drip
in the headers or the body ends at the total deadline though no read times out (the watchdog
shuts the socket down), an answer past the JSON cap or an index of too many shards is refused,
and a revision of '.'/'..' segments is refused before anything is asked."""

from __future__ import annotations

import time

import pytest
from hostile_hub import HostileHub

from specdeploy.engine.planner import remote
from specdeploy.engine.planner.errors import ConfigError

DEADLINE_S = 2.0


@pytest.fixture(scope="module")
def hub():
    hub = HostileHub(interval_s=0.5)
    yield hub
    hub.close()


def files(endpoint: str, revision: str = "main") -> remote.HubFiles:
    return remote.HubFiles("org/model", revision, endpoint=endpoint, token="tok", deadline_s=DEADLINE_S)


@pytest.mark.parametrize("mode", ["drip-body", "drip-headers"])
def test_a_drip_ends_at_the_total_deadline(hub, mode):
    t0 = time.monotonic()
    with pytest.raises(ConfigError, match=f"within the {DEADLINE_S:.0f} s deadline"):
        files(hub.endpoint(mode)).read_json("config.json")
    assert time.monotonic() - t0 < DEADLINE_S + 1.5
    t0 = time.monotonic()
    with pytest.raises(ConfigError, match="deadline"):
        files(hub.endpoint(mode)).read_range("model.safetensors", 0, 1 << 19)
    assert time.monotonic() - t0 < DEADLINE_S + 1.5


@pytest.mark.parametrize("mode", ["huge", "huge-declared"])
def test_json_past_the_cap_is_refused(hub, mode):
    with pytest.raises(ConfigError, match=f"larger than {remote.MAX_HUB_JSON_BYTES}"):
        files(hub.endpoint(mode)).read_json("config.json")


def test_an_index_of_too_many_shards_is_refused(hub):
    with pytest.raises(ConfigError, match="more than 4096"):
        remote.read_checkpoint_weights(files(hub.endpoint("many-shards")))


@pytest.mark.parametrize("revision", ["..", "a/../b", ".", "-rf", "a//b", "a b"])
def test_a_bad_revision_is_refused_first(hub, revision):
    before = len(hub.requests)
    with pytest.raises(ConfigError, match="revision"):
        files(hub.endpoint("huge"), revision)
    assert len(hub.requests) == before
    assert remote.revision_problem("refs/pr/7") is None and remote.revision_problem("v1.0") is None


def test_commits_are_40_hex_digits():
    assert remote.is_commit("0123456789abcdef0123456789abcdef01234567")
    for text in ("main", "0123456789abcdef", "../../../../0123456789abcdef0123456789abc", None,
                 "0123456789ABCDEF0123456789ABCDEF01234567"):
        assert not remote.is_commit(text)
