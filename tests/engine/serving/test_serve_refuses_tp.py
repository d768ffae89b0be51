"""`engine serve` refuses a tensor-parallel plan before it downloads anything."""

import json
import subprocess
import sys


def test_tensor_parallel_plan_is_refused_before_any_download(tmp_path):
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"tensor_parallel_size": 4}))
    # Port 9 on loopback refuses connections: a download attempt would fail with a connection
    # error instead of the plan's message.
    env = {"HF_ENDPOINT": "http://127.0.0.1:9", "HF_HOME": str(tmp_path / "hf"), "PATH": "/usr/bin:/bin"}
    proc = subprocess.run(
        [sys.executable, "-P", "-m", "specdeploy.cli", "engine", "serve",
         "--target", "meta-llama/Llama-3.3-70B-Instruct", "--algorithm", "NONE",
         "--plan", str(plan), "--host", "127.0.0.1", "--port", "0"],
        capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode != 0
    assert "tensor_parallel_size 4" in proc.stderr + proc.stdout
    assert not (tmp_path / "hf").exists() or not any((tmp_path / "hf").rglob("*.json"))
