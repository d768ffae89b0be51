"""Fixtures for the chart tests. Helpers live in tests/support/chartkit.py."""

from __future__ import annotations

import pytest
from chartkit import Helm


@pytest.fixture(scope="session")
def helm(kube_tools, tmp_path_factory) -> Helm:
    return Helm(kube_tools.helm, tmp_path_factory.mktemp("helm-home"), kube_tools.kube_version)
