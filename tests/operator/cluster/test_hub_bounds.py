"""The operator's hub reads against a hostile hub on loopback (tests/support/hostile_hub.py):
a drip of one byte every half second, in the body or in the headers, ends at the total deadline
although no single read ever times out; answers larger than the caps, an index of too many
shards or of a path for a shard are refused with a reason; a token goes only to a trusted
endpoint; a revision with '.'/'..' segments never reaches the hub."""

from __future__ import annotations

import time

import pytest
from hostile_hub import HostileHub

from specdeploy.engine.planner.remote import MAX_HUB_JSON_BYTES
from specdeploy.operator import api
from specdeploy.operator.cluster import config_source as cs

DEADLINE_S = 2.0
MODEL = {"model": "org/model"}


@pytest.fixture(scope="module")
def hub():
    hub = HostileHub(interval_s=0.5)  # well inside the 10 s per-read timeout
    yield hub
    hub.close()


def config(endpoint: str, model=MODEL, **kw):
    return cs.resolve_model_config(model, "spec.target", "ns", None, hub_endpoint=endpoint, hub_token="tok",
                                   deadline_s=DEADLINE_S, **kw)


def weights(endpoint: str, model=MODEL):
    return cs.resolve_model_weights(model, "spec.target", hub_endpoint=endpoint, hub_token="tok",
                                    deadline_s=DEADLINE_S)


@pytest.mark.parametrize("mode", ["drip-body", "drip-headers"])
@pytest.mark.parametrize("read", [config, weights], ids=["config", "weights"])
def test_a_drip_ends_at_the_total_deadline(hub, mode, read):
    t0 = time.monotonic()
    with pytest.raises(cs.ConfigSourceError) as err:
        read(hub.endpoint(mode))
    elapsed = time.monotonic() - t0
    assert DEADLINE_S - 0.1 <= elapsed < DEADLINE_S + 1.5, elapsed
    assert err.value.reason == api.REASON_HUB_UNREACHABLE and err.value.transient
    assert f"within the {DEADLINE_S:.0f} s deadline" in err.value.message


@pytest.mark.parametrize("mode", ["huge", "huge-declared"])
def test_an_answer_past_the_cap_is_refused(hub, mode):
    with pytest.raises(cs.ConfigSourceError) as err:
        config(hub.endpoint(mode))
    assert err.value.reason == api.REASON_HUB_ANSWER_TOO_LARGE and not err.value.transient
    assert str(MAX_HUB_JSON_BYTES) in err.value.message
    with pytest.raises(cs.ConfigSourceError) as err:
        weights(hub.endpoint(mode), model={"model": "org/other"})
    assert err.value.reason == api.REASON_HUB_ANSWER_TOO_LARGE


def test_an_index_of_too_many_or_strange_shards_is_refused(hub):
    with pytest.raises(cs.ConfigSourceError, match="5000 shard files, more than 4096") as err:
        weights(hub.endpoint("many-shards"))
    assert err.value.reason == api.REASON_CONFIG_INVALID and not err.value.transient
    with pytest.raises(cs.ConfigSourceError, match="not a plain .safetensors file name"):
        weights(hub.endpoint("bad-shard"))
    assert not [p for p, _ in hub.requests if "secrets" in p], "the shard path was requested"


@pytest.mark.parametrize("revision", ["..", "main/../x", ".", "-x", "a//b"])
def test_a_revision_of_dot_segments_never_reaches_the_hub(hub, revision):
    before = len(hub.requests)
    for read in (config, weights):
        with pytest.raises(cs.ConfigSourceError) as err:
            read(hub.endpoint("huge"), model={**MODEL, "revision": revision})
        assert err.value.reason == api.REASON_CONFIG_INVALID and "spec.target.revision" in err.value.message
    assert len(hub.requests) == before


def test_the_token_goes_only_to_trusted_endpoints():
    trusted = cs.trusted_endpoints("http://mirror.internal:8080/hub", ("https://hub.corp.example",))
    assert trusted[0] == "https://huggingface.co"
    for endpoint in ("https://huggingface.co", "https://HuggingFace.co:443/", "http://mirror.internal:8080/hub/",
                     "https://hub.corp.example"):
        cs.check_token_endpoint(endpoint, trusted, allow_any=False)
    for endpoint in ("https://huggingface.co.evil.example", "http://huggingface.co", "http://mirror.internal:8081/hub",
                     "http://mirror.internal:8080/other", "https://attacker.example"):
        with pytest.raises(cs.ConfigSourceError) as err:
            cs.check_token_endpoint(endpoint, trusted, allow_any=False)
        assert err.value.reason == api.REASON_HUB_NOT_TRUSTED and not err.value.transient
        assert "--trusted-hub-endpoint" in err.value.message
    cs.check_token_endpoint("https://attacker.example", trusted, allow_any=True)
