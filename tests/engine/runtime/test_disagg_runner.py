"""Prefill/decode disaggregation at the runner level, through Mooncake's transfer engine (TCP on
loopback): a prefill runner computes the prompt's KV, the first token and the draft's carried
state; a decode runner receives them into the slots and the metadata row it took and finishes the
request. Greedy tokens equal one runner's, for target-only, EAGLE, EAGLE-3 and MTP, hc_mult 1 and
4; every slot comes back on both sides. The metadata row is the plan's spec_hidden_size wide: a
plan with hidden_size there is refused for an hc_mult 4 target."""

import dataclasses

import pytest
import torch
from one_runner import reference, staged_transfer  # tests/support/one_runner.py
from specdeploy.engine.demo.toy import (
    copy_draft,
    predictable_target,
    random_requests,
    run_to_completion,
    tiny_config,
)
from specdeploy.engine.planner.plan import (
    GPUS,
    TRANSFER_STAGING_ALIGN_BYTES,
    Limits,
    SpecSettings,
    plan_from_configs,
    transfer_staging_request_bytes,
)
from specdeploy.engine.runtime.runner import Request, Runner
from specdeploy.engine.runtime.transfer import (
    STAGED_PIECE_BYTES,
    PoolLayout,
    StagingArena,
    StagingFull,
    kv_copies,
    slot_runs,
)


def config_json(cfg, **extra):
    return dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=cfg.hidden_size,
                intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
                num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
                head_dim=cfg.head_dim, vocab_size=cfg.vocab_size, torch_dtype="float32",
                hc_mult=cfg.hc_mult, max_position_embeddings=cfg.max_position_embeddings, **extra)


def tiny_plan(cfg, algorithm, steps=3, topk=1, n=4, slots=400):
    draft_cfg = config_json(tiny_config(num_layers=1))
    if algorithm == "EAGLE3":
        draft_cfg["architectures"] = ["LlamaForCausalLMEagle3"]
    target_cfg = config_json(cfg, num_nextn_predict_layers=1) if algorithm == "MTP" else config_json(cfg)
    spec = SpecSettings("NONE", 0, 0, 0) if algorithm == "NONE" else SpecSettings(algorithm, steps, topk, n)
    plan = plan_from_configs(target_cfg, None if algorithm in ("MTP", "NONE") else draft_cfg, spec,
                             GPUS["h200"], Limits(max_running_requests=4, context_length=96, cuda_graph_max_bs=4))
    return dataclasses.replace(plan, max_total_tokens=slots)


_TARGETS = {}


def target_for(hc_mult):
    if hc_mult not in _TARGETS:
        _TARGETS[hc_mult] = predictable_target(tiny_config(hc_mult=hc_mult), seed=0, layer_scale=0.5)
    return _TARGETS[hc_mult]


def register(agent, runner):
    for pool in (runner.target_kv, runner.draft_kv):
        if pool is not None:
            agent.register(pool.k)
            agent.register(pool.v)
    for t in runner.metadata.tensors:
        agent.register(t)


def transfer(prefill: Runner, decode: Runner, agent, session: str, req: Request) -> int:
    """One request through both runners, as the two servers do it; -> bytes moved."""
    row, dst_slots = decode.receive(req)
    prefill.add(dataclasses.replace(req, max_tokens=1))
    while prefill.num_held == 0:
        prefill.step()
    src_row, src_slots = prefill.export_held(req.id)
    moved = 0
    for src, dst in ((prefill.target_kv, decode.target_kv), (prefill.draft_kv, decode.draft_kv)):
        if src is not None:
            moved += agent.write(session, *kv_copies(PoolLayout.of(src), src_slots, PoolLayout.of(dst), dst_slots))
    moved += agent.write(session, *prefill.metadata.row_copies(src_row, decode.metadata.row_addresses(row)))
    prefill.release_held(req.id)
    return moved


CASES = [("NONE", 1), ("NONE", 4), ("EAGLE", 1), ("EAGLE", 4), ("EAGLE3", 1), ("MTP", 1), ("MTP", 4)]


def state_after_prefill(runner: Runner, req_id: str):
    """What a request's decoding starts from: its prompt's target and draft KV, the first token
    (the next root) and the draft's carried row."""
    seq = runner._running[req_id]
    slots = runner.table.req_to_slot[seq.row, :seq.length]
    kv = [torch.stack([pool.k[:, slots], pool.v[:, slots]]) for pool in (runner.target_kv, runner.draft_kv) if pool]
    hidden = runner.draft_hidden[seq.row].clone() if runner.draft is not None else None
    return kv, seq.root, hidden


def assert_same_state(got, want):
    (kv, root, hidden), (kv_want, root_want, hidden_want) = got, want
    assert root == root_want
    for a, b in zip(kv, kv_want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    if hidden_want is not None:
        torch.testing.assert_close(hidden, hidden_want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("algorithm,hc_mult", CASES)
def test_disaggregated_greedy_equals_one_runner(agents, algorithm, hc_mult):
    target, perm = target_for(hc_mult)
    draft = None if algorithm == "NONE" else copy_draft(algorithm, target, perm)
    plan = tiny_plan(target.cfg, algorithm)
    reqs = random_requests((5, 12, 1, 9), 12, 64)
    want, want_state = reference(Runner(target, draft, plan=plan), reqs, state_after_prefill)

    prefill = Runner(target, draft, plan=plan, role="prefill")
    decode = Runner(target, draft, plan=plan, role="decode")
    register(agents[0], prefill)
    register(agents[1], decode)
    free = (prefill.num_free_slots, decode.num_free_slots)
    got = {r.id: [] for r in reqs}
    for r in reqs:
        moved = transfer(prefill, decode, agents[0], agents[1].session_id, r)
        kv_row = sum(2 * p.k.shape[0] * p.k[0, 0].numel() * 4 for p in (prefill.target_kv, prefill.draft_kv) if p)
        assert moved == len(r.prompt_ids) * kv_row + plan.buffers.metadata_bytes // plan.max_running_requests
        for o in decode.activate(r.id):
            got[o.req_id] += o.token_ids
        # The decode server starts exactly where one server's prefill leaves a request (the
        # draft's KV and carried row included: greedy tokens alone would not show them, since
        # a wrong draft state only costs acceptance).
        assert_same_state(state_after_prefill(decode, r.id), want_state[r.id])
    assert prefill.num_held == 0 and prefill.num_running == 0
    while decode.num_running:
        for o in decode.step():
            got[o.req_id] += o.token_ids
    assert got == want
    assert (prefill.num_free_slots, decode.num_free_slots) == free
    if draft is not None:
        assert decode.num_draft_tokens_accepted > 0


@pytest.mark.parametrize("launch_ahead", [False, True])
@pytest.mark.parametrize("algorithm", ["NONE", "EAGLE"])
def test_decode_server_takes_requests_between_its_steps(agents, algorithm, launch_ahead):
    """Requests activated while others decode (with launch-ahead: while a step is in flight,
    which they join from the next one): the same greedy tokens as one runner, every slot back."""
    target, perm = target_for(1)
    draft = None if algorithm == "NONE" else copy_draft(algorithm, target, perm)
    plan = tiny_plan(target.cfg, algorithm)
    reqs = random_requests((5, 12, 1, 9), 12, 64)
    want = run_to_completion(Runner(target, draft, plan=plan), reqs)
    prefill = Runner(target, draft, plan=plan, role="prefill")
    decode = Runner(target, draft, plan=plan, role="decode", launch_ahead=launch_ahead)
    register(agents[0], prefill)
    register(agents[1], decode)
    free = (prefill.num_free_slots, decode.num_free_slots)
    got = {r.id: [] for r in reqs}
    for i, r in enumerate(reqs):
        transfer(prefill, decode, agents[0], agents[1].session_id, r)
        for o in decode.activate(r.id):
            got[o.req_id] += o.token_ids
        for _ in range(2 if i < len(reqs) - 1 else 0):
            for o in decode.step():
                got[o.req_id] += o.token_ids
    while decode.num_running:
        for o in decode.step():
            got[o.req_id] += o.token_ids
    assert got == want
    assert (prefill.num_free_slots, decode.num_free_slots) == free


def test_metadata_row_is_spec_hidden_size_wide_for_hc_mult_4():
    target, perm = target_for(4)
    draft = copy_draft("MTP", target, perm)
    plan = tiny_plan(target.cfg, "MTP")
    assert plan.buffers.metadata_hidden_states_shape == (4, 4 * 32)
    assert Runner(target, draft, plan=plan, role="decode").metadata.hidden.shape == (4, 128)
    narrow = dataclasses.replace(plan, buffers=dataclasses.replace(
        plan.buffers, metadata_hidden_states_shape=(4, 32), metadata_hidden_states_bytes_per_request=32 * 4))
    for role in ("prefill", "decode"):
        with pytest.raises(ValueError, match=r"metadata buffer is \[4, 32\]; this engine needs \[4, 128\]"):
            Runner(target, draft, plan=narrow, role=role)


def test_aborts_free_slots_on_both_sides():
    target, perm = target_for(1)
    draft = copy_draft("EAGLE", target, perm)
    plan = tiny_plan(target.cfg, "EAGLE")
    prefill = Runner(target, draft, plan=plan, role="prefill")
    decode = Runner(target, draft, plan=plan, role="decode")
    free = (prefill.num_free_slots, decode.num_free_slots)
    req = random_requests((9,), 5, 64)[0]
    decode.receive(req)
    prefill.add(dataclasses.replace(req, max_tokens=1))
    prefill.step()
    assert prefill.num_held == 1 and decode.num_receiving == 1
    prefill.abort(req.id)
    decode.abort(req.id)
    assert (prefill.num_free_slots, decode.num_free_slots) == free
    assert prefill.num_running == decode.num_running == 0
    with pytest.raises(ValueError, match="first token only"):
        prefill.add(req)


def test_slot_runs_and_copies_coalesce():
    assert slot_runs([5, 4, 3, 9], [12, 11, 10, 2]) == [(3, 10, 3), (9, 2, 1)]
    src = PoolLayout(k=1000, v=9000, num_layers=2, num_slots=16, slot_bytes=8)
    dst = PoolLayout(k=50000, v=70000, num_layers=2, num_slots=32, slot_bytes=8)
    srcs, dsts, lens = kv_copies(src, [3, 4], dst, [20, 21])
    assert srcs == [1000 + 24, 1000 + 128 + 24, 9000 + 24, 9000 + 128 + 24]
    assert dsts == [50000 + 160, 50000 + 256 + 160, 70000 + 160, 70000 + 256 + 160]
    assert lens == [16] * 4
    with pytest.raises(ValueError, match="KV layouts differ"):
        kv_copies(src, [3], dataclasses.replace(dst, slot_bytes=16), [3])
    with pytest.raises(ValueError, match="destination slot outside"):
        kv_copies(src, [3], dst, [0])


@pytest.mark.parametrize("algorithm,hc_mult", [("EAGLE", 1), ("MTP", 4)])
def test_prefill_server_with_prefix_cache_sends_the_state_of_a_full_prefill(agents, algorithm, hc_mult):
    """A prefill server with the prefix cache on: requests after the first match the shared
    prompt prefix, and what reaches the decode server (the tree's slots' KV, the first token, the
    carried row) is what one server's full prefill leaves; greedy tokens are unchanged."""
    target, perm = target_for(hc_mult)
    draft = copy_draft(algorithm, target, perm)
    plan = tiny_plan(target.cfg, algorithm)
    shared = random_requests((30,), 1, 64)[0].prompt_ids
    reqs = [dataclasses.replace(r, prompt_ids=shared + r.prompt_ids) for r in random_requests((3, 7, 1), 10, 64)]
    want, want_state = {}, {}
    for r in reqs:
        single = Runner(target, draft, plan=plan)
        single.add(r)
        want[r.id] = list(single.step()[0].token_ids)
        want_state[r.id] = state_after_prefill(single, r.id)
        while single.num_running:
            for o in single.step():
                want[o.req_id] += o.token_ids

    prefill = Runner(target, draft, plan=plan, role="prefill", prefix_cache=True)
    decode = Runner(target, draft, plan=plan, role="decode")
    register(agents[0], prefill)
    register(agents[1], decode)
    firsts, step = [], prefill.step

    def recording_step():
        outs = step()
        firsts.extend(outs)
        return outs
    prefill.step = recording_step
    got = {}
    for r in reqs:
        transfer(prefill, decode, agents[0], agents[1].session_id, r)
        got[r.id] = [t for o in decode.activate(r.id) for t in o.token_ids]
        assert_same_state(state_after_prefill(decode, r.id), want_state[r.id])
        while decode.num_running:
            for o in decode.step():
                got[o.req_id] += o.token_ids
    assert got == want
    cached = [o.num_cached_tokens for o in firsts]
    assert cached[0] == 0 and all(c >= len(shared) - 1 for c in cached[1:]), cached
    cache = prefill.prefix_cache
    assert cache.locked_slots == 0 and cache.cached_slots >= len(shared)
    assert prefill.num_free_slots == prefill.table.capacity and decode.num_free_slots == decode.table.capacity


def test_writes_beyond_one_batch_arrive(agents):
    """A fragmented pool needs one write per slot per layer: more entries than one Mooncake batch
    takes (MAX_BATCH_ENTRIES); every one must arrive."""
    from specdeploy.engine.runtime.transfer import MAX_BATCH_ENTRIES

    n = 2 * MAX_BATCH_ENTRIES + 7
    src = torch.arange(n, dtype=torch.int64) * 7 + 3
    dst = torch.zeros(2 * n, dtype=torch.int64)
    agents[0].register(src)
    agents[1].register(dst)
    # Every source element to every other destination element, reversed.
    srcs = [src[i].data_ptr() for i in range(n)]
    dsts = [dst[2 * (n - 1 - i)].data_ptr() for i in range(n)]
    assert agents[0].write(agents[1].session_id, srcs, dsts, [8] * n) == 8 * n
    assert torch.equal(dst[0::2].flip(0), src) and not dst[1::2].any()


@pytest.mark.parametrize("algorithm,hc_mult", [("EAGLE3", 1), ("MTP", 4)])
def test_host_staged_transfer_gives_the_same_state(agents, algorithm, hc_mult):
    """The staged path (a GPU's, run here on CPU): each side registers one staging arena once; per
    request the prefill side gathers every pool's rows into one region, one batched write moves
    the region and the metadata row, the decode side scatters the region into its slots on
    activation. Greedy tokens and the decode side's starting state are one runner's."""
    target, perm = target_for(hc_mult)
    draft = copy_draft(algorithm, target, perm)
    plan = tiny_plan(target.cfg, algorithm)
    reqs = random_requests((6, 11, 3), 10, 64)
    want, want_state = reference(Runner(target, draft, plan=plan), reqs, state_after_prefill)
    prefill = Runner(target, draft, plan=plan, role="prefill")
    decode = Runner(target, draft, plan=plan, role="decode")
    per_token = decode.staged_kv(0).nbytes
    arenas = [StagingArena(2 * transfer_staging_request_bytes(plan.context_length, per_token)) for _ in range(2)]
    for runner, agent, arena in ((prefill, agents[0], arenas[0]), (decode, agents[1], arenas[1])):
        agent.register(arena.buffer)
        for t in runner.metadata.tensors:
            agent.register(t)
    got = {r.id: [] for r in reqs}
    for r in reqs:
        row, dst_slots = decode.receive(r)
        layout = decode.staged_kv(len(dst_slots))
        dst_region = arenas[1].alloc(layout.nbytes)
        prefill.add(dataclasses.replace(r, max_tokens=1))
        while prefill.num_held == 0:
            prefill.step()
        entries = staged_transfer(prefill, decode, agents, arenas, r.id, prefill.export_held(r.id), row,
                                  dst_region, layout.nbytes)
        assert entries == -(-layout.nbytes // STAGED_PIECE_BYTES) + 4  # one batch, not one per slot
        for o in decode.activate(r.id, dst_region):
            got[o.req_id] += o.token_ids
        arenas[1].release(dst_region)
        assert_same_state(state_after_prefill(decode, r.id), want_state[r.id])
    while decode.num_running:
        for o in decode.step():
            got[o.req_id] += o.token_ids
    assert got == want
    assert all(a.free_bytes == a.nbytes for a in arenas)
    assert prefill.num_free_slots == prefill.table.capacity and decode.num_free_slots == decode.table.capacity


@pytest.mark.parametrize("kv_dtype", [None, torch.float8_e4m3fn])
def test_gather_and_scatter_move_scattered_slots_exactly(kv_dtype):
    """A region packs rows of any slots (a fragmented pool) and unpacks them into any others, byte
    for byte, in every layer of both pools and any KV dtype; a region of the wrong size is refused."""
    target, perm = target_for(1)
    draft = copy_draft("EAGLE3", target, perm)
    plan = tiny_plan(target.cfg, "EAGLE3")
    a = Runner(target, draft, plan=plan, role="prefill", kv_cache_dtype=kv_dtype)
    b = Runner(target, draft, plan=plan, role="decode", kv_cache_dtype=kv_dtype)
    g = torch.Generator().manual_seed(0)
    for pool in a.kv_pools():
        for t in (pool.k, pool.v):
            t.view(torch.uint8).copy_(torch.randint(0, 120, t.view(torch.uint8).shape, generator=g, dtype=torch.uint8))
    src, dst = [37, 5, 120, 6, 301], [2, 250, 3, 77, 150]
    layout = a.staged_kv(len(src))
    assert layout.nbytes == (len(src) + 1) * a.staged_kv(0).nbytes
    region = torch.zeros(layout.nbytes + 100, dtype=torch.uint8)
    a.gather_kv(src, region)
    b._scatter_kv(torch.tensor(dst), region)
    for pa, pb in zip(a.kv_pools(), b.kv_pools(), strict=True):
        for ta, tb in ((pa.k, pb.k), (pa.v, pb.v)):
            assert torch.equal(ta.view(torch.uint8)[:, src], tb.view(torch.uint8)[:, dst])
    # Each half of the region is addressed like a pool with slots 1..n (a direct peer's view).
    k0 = layout.pool_layouts(region.data_ptr())[0]
    assert k0.num_slots == len(src) + 1 and (k0.num_layers, k0.slot_bytes) == PoolLayout.of(a.target_kv).shape()
    with pytest.raises(ValueError, match="staging region"):
        a.gather_kv(src, region[:layout.nbytes - 1])


def test_staging_arena_allocates_releases_and_waits():
    import asyncio
    import time

    assert StagingArena(10).alloc(10) is not None  # the arena is whole regions: its size always fits
    arena = StagingArena(4 * TRANSFER_STAGING_ALIGN_BYTES)
    one = arena.alloc(10)
    two = arena.alloc(TRANSFER_STAGING_ALIGN_BYTES + 1)      # two alignment units
    assert one.numel() == TRANSFER_STAGING_ALIGN_BYTES and two.numel() == 2 * TRANSFER_STAGING_ALIGN_BYTES
    assert two.data_ptr() - one.data_ptr() == TRANSFER_STAGING_ALIGN_BYTES
    assert arena.alloc(2 * TRANSFER_STAGING_ALIGN_BYTES) is None  # one unit left
    with pytest.raises(ValueError, match="does not fit"):
        arena.alloc(5 * TRANSFER_STAGING_ALIGN_BYTES)
    arena.release(one)
    arena.release(two)
    assert arena.free_bytes == arena.nbytes and len(arena._free) == 1  # merged back into one

    async def scenario():
        held = arena.alloc(3 * TRANSFER_STAGING_ALIGN_BYTES)
        with pytest.raises(StagingFull):
            await arena.acquire(2 * TRANSFER_STAGING_ALIGN_BYTES, time.monotonic() + 0.05)
        waiter = asyncio.ensure_future(arena.acquire(2 * TRANSFER_STAGING_ALIGN_BYTES, time.monotonic() + 5))
        await asyncio.sleep(0.05)
        assert not waiter.done()
        arena.release(held)
        region = await asyncio.wait_for(waiter, 1)
        assert region.numel() == 2 * TRANSFER_STAGING_ALIGN_BYTES
        arena.release(region)

    asyncio.run(scenario())
    assert arena.free_bytes == arena.nbytes


def test_server_arena_is_the_plans_or_grown_to_one_context(caplog):
    """engine serve's arena: the plan's transfer_staging_bytes; a plan that counted too few KV
    bytes per token (or none: written before the term) gets two context-length regions."""
    import logging

    from specdeploy.engine.serving.boot import _staging_arena

    target, perm = target_for(1)
    draft = copy_draft("EAGLE3", target, perm)
    plan = tiny_plan(target.cfg, "EAGLE3")
    runner = Runner(target, draft, plan=plan, role="decode")
    need = transfer_staging_request_bytes(plan.context_length, runner.staged_kv(0).nbytes)
    planned = dataclasses.replace(plan, buffers=dataclasses.replace(plan.buffers, transfer_staging_bytes=3 * need))
    assert _staging_arena(runner, planned).nbytes == 3 * need
    short = dataclasses.replace(plan, buffers=dataclasses.replace(plan.buffers, transfer_staging_bytes=need // 2))
    with caplog.at_level(logging.WARNING, logger="specdeploy"):
        assert _staging_arena(runner, short).nbytes == 2 * need
    assert "cannot hold one 96-token request" in caplog.text
    assert _staging_arena(runner, plan).nbytes == 2 * need  # no staging term in a role "both" plan
