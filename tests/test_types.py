"""The pure layers type-check: mypy over engine/planner, engine/speculative's pure module,
operator/api.py and operator/desired, as pyproject.toml's [tool.mypy] names them.

mypy resolves `specdeploy.engine...` through a tree laid out here the way pyproject.toml's
package-dir maps the folders (an editable install's import hook is nothing mypy can follow).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytest.importorskip("mypy", reason="needs mypy (the dev extra: pip install -e '.[dev]')")


def _package_tree(at: Path) -> Path:
    """specdeploy/<folder> -> the checkout's folder, for each package-dir mapping."""
    package_dir = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    for package, folder in package_dir.items():
        if package == "specdeploy":
            continue
        link = at.joinpath(*package.split("."))
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(ROOT / folder, target_is_directory=True)
    return at


def test_the_pure_layers_type_check(tmp_path):
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]
    assert "specdeploy.engine.planner" in config["packages"] and "specdeploy.operator.api" in config["modules"]
    env = {**os.environ, "MYPYPATH": str(_package_tree(tmp_path / "path"))}
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--python-executable", sys.executable, "--cache-dir", str(tmp_path / "cache"),
         "--config-file", str(ROOT / "pyproject.toml")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "no issues found" in result.stdout
