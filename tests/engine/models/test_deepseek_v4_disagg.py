"""DeepSeek-V4 split into a prefill and a decode runner, through Mooncake's transfer engine (TCP
on loopback, host staging regions): only the rows each pool keeps for a committed request move
(a recent pool's last `keep` positions, an entries pool's window closers), with the MTP draft's
pools and its carried hc_mult x hidden_size streams in the metadata row. Greedy MTP tokens equal
one runner's; the decode runner starts from exactly the state one runner's prefill leaves; every
slot and pool row comes back on both sides, after aborts too."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from one_runner import reference, staged_transfer  # tests/support/one_runner.py

from specdeploy.engine.planner.deepseek_v4 import read_v4_config, v4_kept_positions, v4_pools, v4_staged_bytes
from specdeploy.engine.planner.plan import Limits, SpecSettings, custom_gpu, plan_from_configs, staging_aligned
from specdeploy.engine.memory.kv import PoolExhausted
from specdeploy.engine.runtime.runner import NoCapacity, Request, Runner
from specdeploy.engine.runtime.transfer import StagingArena

from v4_tiny import SMALL_VOCAB, TINY, target_and_mtp

pytest.importorskip("transformers.models.deepseek_v4")

CONFIG = {**copy.deepcopy(TINY), "vocab_size": SMALL_VOCAB}
LIMITS = Limits(max_running_requests=4, context_length=96, cuda_graph_max_bs=4)
SPEC = SpecSettings("MTP", 2, 1, 3)


@pytest.fixture(scope="module")
def models():
    return target_and_mtp(CONFIG)


def plan(role):
    return dataclasses.replace(plan_from_configs(CONFIG, None, SPEC, custom_gpu(40), LIMITS, role=role),
                               max_total_tokens=400)


def prompts():
    g = torch.Generator().manual_seed(11)
    # 1, 3 and 5 tokens close no 4- or 8-token window; 29 closes several of each.
    return [Request(str(i), torch.randint(0, CONFIG["vocab_size"], (n,), generator=g).tolist(), max_tokens=16)
            for i, n in enumerate((29, 5, 1, 17))]


def kept_state(runner: Runner, req_id: str):
    """What decoding starts from: the kept rows of every pool (target and MTP), the first token,
    the draft's carried streams."""
    seq = runner._running.get(req_id) or runner._held[req_id]
    slots = runner.table.req_to_slot[seq.row, :seq.length]
    rows = [t[:, index].clone() for kv in (runner.target_kv, runner.draft_kv)
            for t, index in kv.staged_pieces(slots, seq.length)]
    return rows, seq.root, runner.draft_hidden[seq.row].clone()


def pool_rows(runner: Runner):
    return runner.num_free_slots, [{n: kv.free_rows(n) for n in kv.pools} for kv in (runner.target_kv, runner.draft_kv)]


def test_split_roles_plan_v4s_kept_rows_and_the_hc_streams():
    v4 = read_v4_config(CONFIG)
    for role in ("prefill", "decode"):
        p = plan(role)
        assert p.buffers.metadata_hidden_states_shape == (4, 4 * CONFIG["hidden_size"])
        one = staging_aligned(v4_staged_bytes(v4, "target", 4, 96) + v4_staged_bytes(v4, "MTP", 4, 96))
        assert p.buffers.transfer_staging_bytes == 2 * one


def test_disaggregated_mtp_equals_one_runner(models, agents):
    target, mtp = models
    reqs = prompts()
    want, want_state = reference(Runner(target, mtp, plan=plan("both")), reqs, kept_state)

    prefill, decode = Runner(target, mtp, plan=plan("prefill"), role="prefill"), Runner(target, mtp, plan=plan("decode"), role="decode")
    assert decode.metadata.hidden.shape[1] == 4 * CONFIG["hidden_size"]
    arenas = [StagingArena(r.staged_kv(96).nbytes * 2 + 8192) for r in (prefill, decode)]
    for runner, agent, arena in ((prefill, agents[0], arenas[0]), (decode, agents[1], arenas[1])):
        agent.register(arena.buffer)
        for t in runner.metadata.tensors:
            agent.register(t)
    baseline = pool_rows(prefill), pool_rows(decode)
    v4 = read_v4_config(CONFIG)
    got = {r.id: [] for r in reqs}
    for r in reqs:
        n = len(r.prompt_ids)
        before = pool_rows(decode)
        row, dst_slots = decode.receive(r)
        # The decode side took n slots, and in each pool only the rows a committed request keeps.
        after = pool_rows(decode)
        assert after[0] == before[0] - n
        for kv_before, kv_after, role in zip(before[1], after[1], ("target", "MTP")):
            for q in v4_pools(v4, role):
                assert kv_before[q.name] - kv_after[q.name] == len(v4_kept_positions(q, n))
        layout = decode.staged_kv(n)
        assert layout.nbytes == v4_staged_bytes(v4, "target", 4, n) + v4_staged_bytes(v4, "MTP", 4, n)
        dst_region = arenas[1].alloc(layout.nbytes)
        prefill.add(dataclasses.replace(r, max_tokens=1))
        while prefill.num_held == 0:
            prefill.step()
        src_row, src_slots = prefill.export_held(r.id)
        sent_state = kept_state(prefill, r.id)
        assert prefill.staged_kv(len(src_slots)) == layout
        staged_transfer(prefill, decode, agents, arenas, r.id, (src_row, src_slots), row, dst_region, layout.nbytes)
        for o in decode.activate(r.id, dst_region):
            got[o.req_id] += o.token_ids
        arenas[1].release(dst_region)
        # Bit for bit what the prefill side sent; what one runner's batched prefill computed up
        # to float32 rounding (its batch held every prompt).
        state = kept_state(decode, r.id)
        for (rows, root, hidden), (want_rows, want_root, want_hidden), tol in (
                (state, sent_state, 0.0), (state, want_state[r.id], 1e-5)):
            assert root == want_root
            torch.testing.assert_close(hidden, want_hidden, rtol=tol, atol=tol)
            for a, b in zip(rows, want_rows, strict=True):
                torch.testing.assert_close(a, b, rtol=tol, atol=tol)
    assert pool_rows(prefill) == baseline[0]
    while decode.num_running:
        for o in decode.step():
            got[o.req_id] += o.token_ids
    assert got == want
    assert decode.num_draft_tokens_accepted > 0
    assert pool_rows(decode) == baseline[1]
    assert all(a.free_bytes == a.nbytes for a in arenas)


def test_aborts_give_every_slot_and_row_back(models):
    target, mtp = models
    prefill, decode = Runner(target, mtp, plan=plan("prefill"), role="prefill"), Runner(target, mtp, plan=plan("decode"), role="decode")
    baseline = pool_rows(prefill), pool_rows(decode)
    r = prompts()[0]
    decode.receive(r)
    assert pool_rows(decode) != baseline[1]
    decode.abort(r.id)  # before its state arrived
    prefill.add(dataclasses.replace(r, max_tokens=1))
    while prefill.num_held == 0:
        prefill.step()
    prefill.abort(r.id)  # held, before its transfer
    assert (pool_rows(prefill), pool_rows(decode)) == baseline


def test_a_receive_a_pool_cannot_hold_takes_nothing(models):
    """Where one pool is short of the rows a prompt keeps (other requests hold them), receive
    raises NoCapacity (the scheduler keeps the request queued) and takes nothing: the table's
    slots, the row and every pool's rows are as before, and the request fits once the rows are
    back."""
    target, mtp = models
    decode = Runner(target, mtp, plan=plan("decode"), role="decode")
    window = decode.draft_kv._free["window"]
    held = window.pop(window.num_free - 2)  # the MTP layer's window pool keeps 5 rows of a long prompt
    baseline = pool_rows(decode)
    with pytest.raises(NoCapacity, match="window exhausted"):
        decode.receive(Request("big", [1] * 40, max_tokens=4))
    assert pool_rows(decode) == baseline and decode.num_receiving == 0
    # A step's slots likewise: every slot gets a row in every pool, or none anywhere.
    with pytest.raises(PoolExhausted, match="window exhausted"):
        decode.table.alloc(3)
    assert pool_rows(decode) == baseline
    window.push(held)
    decode.receive(Request("big", [1] * 40, max_tokens=4))
    assert decode.num_receiving == 1
