"""The decode steps by row (rows.py) can be captured: their bodies (plain decode, decode with
the feature, the speculative step greedy and sampling, chain and tree, EAGLE and MTP, hc_mult 1
and 4) run on the "meta" device, where no tensor has data, under the dispatch mode of
tests/support/host_sync.py that refuses host syncs, boolean-mask indexing and CPU tensors: the
gathers from the row state and the in-graph commit included."""

import pytest
import torch
from host_sync import NoHostSync

from specdeploy.engine.models.draft import build_draft
from specdeploy.engine.models.llama import build_target
from specdeploy.engine.runtime.calls import ModelCalls
from specdeploy.engine.memory.kv import KVPool, SlotTable
from specdeploy.engine.runtime.rows import RowState, plain_body, spec_body
from specdeploy.engine.demo.toy import tiny_config


META = "meta"
ROWS, CTX, SLOTS = 6, 40, 512


def meta_state(algorithm, hc_mult, steps, topk, n):
    cfg = tiny_config(hc_mult=hc_mult)
    kind = {"NONE": None, "EAGLE": "eagle", "MTP": "mtp"}[algorithm]
    target = build_target(cfg, torch.float32, META, kind)
    draft = None
    if algorithm != "NONE":
        dcfg = cfg.__class__(**{**cfg.__dict__, "num_layers": 1})
        draft = build_draft(algorithm, dcfg, target, torch.float32, META)
    tkv = KVPool(cfg.num_layers, SLOTS, cfg.num_kv_heads, cfg.head_dim, torch.float32, META)
    dkv = None if draft is None else KVPool(draft.num_kv_layers(), SLOTS, dcfg.num_kv_heads, dcfg.head_dim,
                                            torch.float32, META)
    table = SlotTable(SLOTS, ROWS, CTX, META)
    hidden = None if draft is None else torch.zeros(ROWS + 1, draft.carried_size, device=META)
    catch = (torch.zeros(ROWS + 1, 3, dtype=torch.int64, device=META),
             torch.zeros(ROWS + 1, 3, target.feature_size, device=META),
             torch.zeros(ROWS + 1, dtype=torch.int64, device=META)) if draft is not None else None
    st = RowState(table, hidden, catch)
    return ModelCalls(target, draft, tkv, dkv, steps, topk, n), st


@pytest.mark.parametrize("b", [1, 3])
@pytest.mark.parametrize("hc_mult", [1, 4])
def test_plain_steps_by_row_need_no_host(b, hc_mult):
    for algorithm, feature in (("NONE", False), ("EAGLE", True)):
        calls, st = meta_state(algorithm, hc_mult, 0, 1, 1)
        packed = torch.zeros(b, 2, dtype=torch.int64, device=META)
        with torch.no_grad(), NoHostSync():
            tokens, logits = plain_body(calls, st, packed, CTX, feature)
        assert tokens.shape == (b, 1) and logits.shape[0] == b


@pytest.mark.parametrize("sampling", [False, True])
@pytest.mark.parametrize("algorithm,hc_mult,steps,topk,n", [("EAGLE", 1, 3, 1, 4), ("EAGLE", 4, 3, 2, 5),
                                                           ("MTP", 1, 2, 3, 6)])
def test_speculative_step_by_row_needs_no_host(algorithm, hc_mult, steps, topk, n, sampling):
    calls, st = meta_state(algorithm, hc_mult, steps, topk, n)
    b = 3
    f32 = dict(dtype=torch.float32, device=META)
    packed = torch.zeros(b, 1 + (steps - 1) * topk + n, dtype=torch.int64, device=META)
    params = (torch.ones(b, **f32), torch.zeros(b, dtype=torch.int64, device=META), torch.ones(b, **f32))
    uniforms = torch.full((b, n + 1 + steps), 0.5, **f32)
    hidden_buf = torch.zeros(b * topk, calls.draft.carried_size, device=META)
    with torch.no_grad(), NoHostSync():
        out = spec_body(calls, st, packed, CTX, sampling, *params, uniforms, hidden_buf)
    assert out.shape == (b, 2 + steps + 1 + n)
