"""Running `specdeploy cluster ...` as a user does, in a test's own environment (its XDG_STATE_HOME
names where the clusters live, so these helpers ask from inside that environment)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def specdeploy(env: dict[str, str], *args: str, timeout_s: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-P", "-m", "specdeploy.cli", *args], env=env, capture_output=True,
                          text=True, timeout=timeout_s, stdin=subprocess.DEVNULL, cwd=REPO)


def leftovers(env: dict[str, str], name: str) -> list[str]:
    """What of cluster `name` is still on this machine (processes, netns, links, mounts, its directory)."""
    probe = f"import json; from specdeploy.localcluster.cluster import leftovers; print(json.dumps(leftovers({name!r})))"
    out = subprocess.run([sys.executable, "-P", "-c", probe], env=env, capture_output=True, text=True, timeout=60, check=True)
    return json.loads(out.stdout)
