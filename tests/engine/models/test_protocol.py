"""Every target family is a TargetModel (models/protocol.py) and says where its KV lives: the
runner allocates slot-row pools for SLOT_ROWS models and asks OWN_POOLS ones for theirs."""

from __future__ import annotations

import typing

from specdeploy.engine.demo.toy import predictable_target, tiny_config
from specdeploy.engine.models.deepseek_v4 import DeepseekV4Model, DeepseekV4MTP
from specdeploy.engine.models.draft import Eagle3Head, EagleHead, MTPHead
from specdeploy.engine.models.llama import LlamaModel
from specdeploy.engine.models.protocol import OWN_POOLS, SLOT_ROWS, OwnPoolsModel, TargetModel

from v4_tiny import TINY, target_and_mtp


def members(protocol) -> set[str]:
    return {name for name in vars(protocol) if not name.startswith("_")} | set(typing.get_type_hints(protocol)) \
        | {"__call__"}


def test_the_families_declare_their_kv_layout():
    assert LlamaModel.kv_layout == SLOT_ROWS
    assert DeepseekV4Model.kv_layout == OWN_POOLS and DeepseekV4MTP.kv_layout == OWN_POOLS
    assert {EagleHead.kv_layout, Eagle3Head.kv_layout, MTPHead.kv_layout} == {SLOT_ROWS}
    # Only OWN_POOLS families make pools: the layout, not the presence of a method, says which.
    assert not hasattr(LlamaModel, "make_kv")
    for own in (DeepseekV4Model, DeepseekV4MTP):
        assert all(callable(getattr(own, name)) for name in vars(OwnPoolsModel) if not name.startswith("_"))


def test_every_target_family_has_what_the_protocol_names():
    llama, _ = predictable_target(tiny_config(), seed=0)
    v4, _ = target_and_mtp(TINY)
    for target in (llama, v4):
        missing = [name for name in members(TargetModel) if not hasattr(target, name)]
        assert not missing, (type(target).__name__, missing)
        assert target.kv_layout in (SLOT_ROWS, OWN_POOLS)
