# Fixtures shared by all test folders. The package `testcluster` lives in tests/cluster/, which
# pyproject.toml puts on the pytest pythonpath (that folder holds only test code).
import pytest

pytest_plugins = ["testcluster.plugin"]


@pytest.fixture(scope="module")
def agents():
    """Two Mooncake transfer engines on loopback (TCP): a prefill side's and a decode side's.
    Skips where Mooncake is not installed (the `disagg` extra; the GPU machine's image lacks it)."""
    pytest.importorskip("mooncake.engine", reason="needs Mooncake's transfer engine (pip install 'specdeploy[disagg]')")
    from specdeploy.engine.runtime.transfer import MooncakeAgent

    prefill, decode = MooncakeAgent("127.0.0.1"), MooncakeAgent("127.0.0.1")
    yield prefill, decode
    prefill.close()
    decode.close()
