"""The engine's hub download (serving/hub.py) against a hostile hub on loopback: the revision
listing under a total deadline and a byte cap, a commit that is no 40-hex commit and a file name
that leaves the snapshot refused before anything is written; `engine serve` refuses revisions of
'.'/'..' segments and model names starting with '-' in one line."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
from hostile_hub import HostileHub

from specdeploy.engine.serving import hub as hub_files

DEADLINE_S = 2.0


@pytest.fixture(scope="module")
def hostile():
    hub = HostileHub(interval_s=0.5)
    yield hub
    hub.close()


@pytest.mark.parametrize("mode", ["drip-body", "drip-headers"])
def test_a_drip_ends_at_the_deadline(hostile, tmp_path, mode):
    t0 = time.monotonic()
    with pytest.raises(hub_files.HubError, match=f"within the {DEADLINE_S:.0f} s deadline"):
        hub_files.fetch_model("org/m", endpoint=hostile.endpoint(mode), cache=tmp_path, deadline_s=DEADLINE_S)
    assert time.monotonic() - t0 < DEADLINE_S + 1.5
    assert not list(tmp_path.rglob("*"))


def test_a_listing_past_the_cap_is_refused(hostile, tmp_path):
    with pytest.raises(hub_files.HubError, match="larger than"):
        hub_files.fetch_model("org/m", endpoint=hostile.endpoint("huge"), cache=tmp_path, deadline_s=30)


def test_a_commit_that_is_no_commit_is_refused(hostile, tmp_path):
    with pytest.raises(hub_files.HubError, match="named no commit"):
        hub_files.fetch_model("org/m", endpoint=hostile.endpoint("bad-commit"), cache=tmp_path / "cache")
    assert not (tmp_path / "tmp").exists() and not list(tmp_path.rglob("evil"))


def test_file_names_that_leave_the_snapshot_are_not_fetched():
    names = ["config.json", "../../etc/passwd.json", "/abs.json", ".hidden.json", "a\\b.json", "tokenizer.json",
             "model.safetensors", "..", "sub/../../x.json"]
    assert hub_files.wanted_files(names) == ["config.json", "model.safetensors", "tokenizer.json"]


@pytest.mark.parametrize("flags,message", [
    (["--target-revision", "../../x"], "--target-revision: revision '../../x': must not have"),
    (["--draft-revision=-x"], "--draft-revision: revision '-x': must not be empty or start with '-'"),
    (["--target=-rf"], "--target '-rf': a model name cannot be empty or start with '-'"),
])
def test_serve_refuses_bad_names_in_one_line(flags, message):
    argv = [sys.executable, "-P", "-m", "specdeploy.cli", "engine", "serve", "--target", "org/m", "--algorithm", "NONE",
            *flags]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert out.returncode == 2 and len(lines) == 1 and message in lines[0], out.stderr
