"""The example configs under manifests/models: identical to the fixtures, and plannable."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specdeploy.cli import main

REPO = Path(__file__).resolve().parents[3]
SHIPPED = sorted((REPO / "manifests" / "models").glob("*/config.json"))
FIXTURES = Path(__file__).resolve().parents[2] / "configs"


def test_models_are_shipped():
    names = {path.parent.name for path in SHIPPED}
    assert {"llama-3.1-8b-instruct", "eagle3-llama3.1-instruct-8b", "deepseek-v4-flash"} <= names


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.parent.name)
def test_shipped_config_equals_fixture(path):
    assert json.loads(path.read_text()) == json.loads((FIXTURES / f"{path.parent.name}.json").read_text())


@pytest.mark.parametrize("gpu", ["h200", "h100"])
def test_readme_command_plans(capsys, gpu):
    models = REPO / "manifests" / "models"
    argv = [
        "plan", "--target", str(models / "llama-3.1-8b-instruct" / "config.json"),
        "--draft", str(models / "eagle3-llama3.1-instruct-8b" / "config.json"),
        "--algorithm", "EAGLE3", "--gpu", gpu, "--json",
    ]
    assert main(argv) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["tensor_parallel_size"] == 1
    assert d["max_total_tokens"] >= d["required_tokens"] == 8192 * 32
