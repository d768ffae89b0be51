"""Fixtures for the chart tests. Helpers live in chartkit.py, importable from the test modules."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

# pytest's importlib mode puts no test folder on sys.path; this one holds only test helpers.
sys.path.insert(0, str(Path(__file__).resolve().parent))

from chartkit import Helm  # noqa: E402


@pytest.fixture(scope="session")
def helm(kube_tools, tmp_path_factory) -> Helm:
    return Helm(kube_tools.helm, tmp_path_factory.mktemp("helm-home"), kube_tools.kube_version)
