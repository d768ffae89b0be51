"""engine/kernels/launch.py's settings on CPU: the weight prefetch size, the PDL trigger and the
one-row epilogues, read from the environment."""

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


def test_tail_trigger_and_epilogue_settings(fresh):
    fresh.delenv(launch.PDL_ENV, raising=False)
    fresh.delenv(launch.EPILOGUES_ENV, raising=False)
    assert not launch.pdl_tail()
    assert launch.epilogues() is (launch.EPILOGUES == "1")
    fresh.setenv(launch.PDL_ENV, "tail")
    fresh.setenv(launch.EPILOGUES_ENV, "1" if launch.EPILOGUES == "0" else "0")
    launch.reset()
    assert launch.pdl_tail()
    assert launch.epilogues() is (launch.EPILOGUES == "0")


def test_attention_prefetch_setting(fresh):
    fresh.delenv(launch.ATTN_PREFETCH_ENV, raising=False)
    assert launch.attention_prefetch() is (launch.ATTN_PREFETCH == "1")
    fresh.setenv(launch.ATTN_PREFETCH_ENV, "1" if launch.ATTN_PREFETCH == "0" else "0")
    launch.reset()
    assert launch.attention_prefetch() is (launch.ATTN_PREFETCH == "0")
    fresh.setenv(launch.ATTN_PREFETCH_ENV, "true")
    launch.reset()
    with pytest.raises(ValueError, match=launch.ATTN_PREFETCH_ENV):
        launch.attention_prefetch()


def test_empty_epilogues_setting_is_the_default(fresh):
    fresh.setenv(launch.EPILOGUES_ENV, " ")
    assert launch.epilogues() is (launch.EPILOGUES == "1")


@pytest.mark.parametrize("value", ["yes", "2", "on"])
def test_epilogues_setting_refuses_other_values(fresh, value):
    fresh.setenv(launch.EPILOGUES_ENV, value)
    with pytest.raises(ValueError, match=launch.EPILOGUES_ENV):
        launch.epilogues()
