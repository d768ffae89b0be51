"""engine/kernels/launch.py's settings on CPU: the weight prefetch size read from the environment."""

import pytest

from specdeploy.engine.kernels import launch


@pytest.fixture
def fresh(monkeypatch):
    launch.reset()
    yield monkeypatch
    launch.reset()


def test_prefetch_bytes_default_and_override(fresh):
    fresh.delenv(launch.PREFETCH_ENV, raising=False)
    assert launch.prefetch_bytes() == launch.PREFETCH_BYTES == 0
    fresh.setenv(launch.PREFETCH_ENV, "2048")
    assert launch.prefetch_bytes() == 0  # read once, until reset
    launch.reset()
    assert launch.prefetch_bytes() == 2048


@pytest.mark.parametrize("value", ["-1", "2k", "1.5"])
def test_prefetch_bytes_refuses_what_is_not_a_byte_count(fresh, value):
    fresh.setenv(launch.PREFETCH_ENV, value)
    with pytest.raises(ValueError, match=launch.PREFETCH_ENV):
        launch.prefetch_bytes()


def test_pdl_is_off_on_cpu(fresh):
    import torch
    assert launch.pdl_args(torch.zeros(1)) == {"USE_GDC": False}
