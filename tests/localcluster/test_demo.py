"""The README's first command, `specdeploy demo`, through the operator: models (here the test's
pair, put where the demo caches its own), the local cluster, the chart, tiny-cpu-demo to Ready,
completions through its Service until `kubectl get sdd` shows the live accept length and tok/s,
the commands to look further; with --down nothing is left."""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path

from local_cluster_cli import leftovers, specdeploy  # tests/support

from specdeploy.engine.demo.cli import DEMO_VERSION, Recipe


def test_demo_runs_the_operator_loop_and_cleans_up(cluster_env, capsys):
    cache = Path(cluster_env["XDG_CACHE_HOME"]) / "specdeploy" / "demo" / DEMO_VERSION
    (cache / "complete.json").write_text(json.dumps({"recipe": asdict(Recipe())}))  # "trained": the test's pair
    t0 = time.monotonic()
    result = specdeploy(cluster_env, "demo", "--down", timeout_s=300)
    elapsed_s = time.monotonic() - t0
    with capsys.disabled():
        print(f"\n{result.stdout}\n(specdeploy demo took {elapsed_s:.0f} s)")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    for step in ("[1/5] models", "[2/5] cluster: specdeploy cluster up", "[3/5] operator: helm upgrade --install",
                 "[4/5] model: kubectl apply", "[5/5] requests through its Service"):
        assert step in out
    assert "cached pair found" in out and "pods in network namespaces" in out
    assert "operator running: starting: namespaces specdeploy" in out
    table = out[out.index("NAME "):].splitlines()
    header, row = table[0], table[1].split()
    assert "ACCEPT LENGTH" in header and row[:3] == ["tiny-cpu-demo", "True", "Ready"]
    assert float(row[5]) > 1 and float(row[6]) > 0  # accept length and tok/s from the live engine
    for command in ("kubectl get sdd -n specdeploy", "kubectl logs -n specdeploy deploy/specdeploy",
                    "kubectl port-forward -n specdeploy service/tiny-cpu-demo 8000:8000", "specdeploy cluster down"):
        assert f"  {command}" in out
    assert "cluster local removed" in out
    assert leftovers(cluster_env, "local") == []
    assert elapsed_s < 120  # warm caches: the README promises under two minutes
