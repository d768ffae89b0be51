"""Prefill/decode disaggregation on the GPU (run on the device): KV pools in GPU memory, a
request's rows of every layer and pool gathered into one region of a pinned host staging arena on
the prefill side, moved by one batched Mooncake write (TCP on loopback) into the decode side's
arena, scattered into its slots on activation, decode under CUDA graphs. Greedy tokens equal one
runner's, EAGLE-3 and MTP at hc_mult 4."""

import dataclasses

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from specdeploy.engine.demo.toy import copy_draft, predictable_target, random_requests, tiny_config  # noqa: E402
from specdeploy.engine.planner.plan import GPUS, Limits, SpecSettings, plan_from_configs  # noqa: E402
from specdeploy.engine.runtime.runner import Runner  # noqa: E402
from specdeploy.engine.planner.plan import transfer_staging_request_bytes  # noqa: E402
from specdeploy.engine.runtime.transfer import StagingArena, region_copies  # noqa: E402

DEV = "cuda"


def config_json(cfg, **extra):
    return dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=cfg.hidden_size,
                intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
                num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
                head_dim=cfg.head_dim, vocab_size=cfg.vocab_size, torch_dtype="float32",
                hc_mult=cfg.hc_mult, max_position_embeddings=cfg.max_position_embeddings, **extra)


def tiny_plan(cfg, algorithm, role):
    draft_cfg = config_json(tiny_config(num_layers=1))
    if algorithm == "EAGLE3":
        draft_cfg["architectures"] = ["LlamaForCausalLMEagle3"]
    target_cfg = config_json(cfg, num_nextn_predict_layers=1) if algorithm == "MTP" else config_json(cfg)
    plan = plan_from_configs(target_cfg, None if algorithm == "MTP" else draft_cfg, SpecSettings(algorithm, 3, 1, 4),
                             GPUS["h200"], Limits(max_running_requests=4, context_length=96, cuda_graph_max_bs=4),
                             role=role)
    return dataclasses.replace(plan, max_total_tokens=400)


@pytest.mark.parametrize("algorithm,hc_mult", [("EAGLE3", 1), ("MTP", 4)])
def test_gpu_pools_through_host_copies(agents, algorithm, hc_mult):
    target, perm = predictable_target(tiny_config(hc_mult=hc_mult), seed=0, layer_scale=0.5, device=DEV)
    draft = copy_draft(algorithm, target, perm)
    reqs = random_requests((6, 11, 3), 12, 64)
    single = Runner(target, draft, plan=tiny_plan(target.cfg, algorithm, "both"), device=DEV)
    for r in reqs:
        single.add(r)
    want = {o.req_id: list(o.token_ids) for o in single.step()}
    while single.num_running:
        for o in single.step():
            want[o.req_id] += o.token_ids
    prefill = Runner(target, draft, plan=tiny_plan(target.cfg, algorithm, "prefill"), device=DEV, role="prefill",
                     graph_mode="off")
    decode = Runner(target, draft, plan=tiny_plan(target.cfg, algorithm, "decode"), device=DEV, role="decode")
    assert prefill.metadata.hidden.is_pinned() and decode.metadata.hidden.shape[1] == target.cfg.spec_hidden_size
    arena_bytes = 2 * transfer_staging_request_bytes(96, decode.staged_kv(0).nbytes)
    arenas = [StagingArena(arena_bytes, pin=True), StagingArena(arena_bytes, pin=True)]
    for runner, agent, arena in ((prefill, agents[0], arenas[0]), (decode, agents[1], arenas[1])):
        agent.register(arena.buffer)
        for t in runner.metadata.tensors:
            agent.register(t)
    got = {r.id: [] for r in reqs}
    free = decode.num_free_slots
    for r in reqs:
        row, dst_slots = decode.receive(r)
        layout = decode.staged_kv(len(dst_slots))
        dst_region = arenas[1].alloc(layout.nbytes)
        prefill.add(dataclasses.replace(r, max_tokens=1))
        while prefill.num_held == 0:
            prefill.step()
        src_row, src_slots = prefill.export_held(r.id)
        src_region = arenas[0].alloc(layout.nbytes)
        prefill.gather_kv(src_slots, src_region)
        copies = [region_copies(src_region.data_ptr(), dst_region.data_ptr(), layout.nbytes),
                  prefill.metadata.row_copies(src_row, decode.metadata.row_addresses(row))]
        agents[0].write(agents[1].session_id, *(sum((c[i] for c in copies), []) for i in range(3)))
        prefill.release_held(r.id)
        arenas[0].release(src_region)
        for o in decode.activate(r.id, dst_region):
            got[o.req_id] += o.token_ids
        arenas[1].release(dst_region)
    while decode.num_running:
        for o in decode.step():
            got[o.req_id] += o.token_ids
    assert got == want
    assert decode.num_free_slots == free and prefill.num_running == 0
    assert decode.num_draft_tokens_accepted > 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_gather_and_scatter_between_gpu_pools_and_a_pinned_region(dtype):
    """The staged path's device copies: rows of scattered slots of GPU pools into a pinned region
    and back into other scattered slots, byte for byte, every layer of both pools."""
    from specdeploy.engine.runtime.transfer import StagedKV, StagingArena, gather_rows, scatter_rows

    g = torch.Generator(device=DEV).manual_seed(0)
    def pools():
        return [tuple(torch.empty(layers, 700, 8, 128, dtype=dtype, device=DEV) for _ in "kv") for layers in (4, 1)]
    src, dst = pools(), pools()
    for pair in src:
        for t in pair:
            t.view(torch.uint8).copy_(torch.randint(0, 120, t.view(torch.uint8).shape, generator=g, device=DEV,
                                                    dtype=torch.uint8))
    src_slots = torch.tensor([5, 600, 3, 77, 140, 9], device=DEV)
    dst_slots = torch.tensor([650, 2, 300, 301, 17, 88], device=DEV)
    layout = StagedKV.of(src, len(src_slots))
    arena = StagingArena(layout.nbytes, pin=True)
    region = arena.alloc(layout.nbytes)
    assert region.is_pinned()
    gather_rows(src, src_slots, region)
    scatter_rows(dst, dst_slots, region)
    for a, b in zip(src, dst, strict=True):
        for ta, tb in zip(a, b):
            assert torch.equal(ta.view(torch.uint8)[:, src_slots], tb.view(torch.uint8)[:, dst_slots])
