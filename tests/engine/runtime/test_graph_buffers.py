"""The CUDA-graph layer's static buffers and padded replay, exercised on CPU ("padded" mode runs
the same static buffers and padding without capturing). Buffer shapes must equal the plan's,
and with hc_mult = 4 every draft-side hidden buffer is 4 x hidden_size wide."""

import dataclasses

import pytest

from specdeploy.engine.planner.plan import GPUS, Limits, SpecSettings, plan_from_configs
from specdeploy.engine.runtime.runner import Runner
from specdeploy.engine.demo.toy import (copy_draft, predictable_target, random_requests,
                                   run_to_completion, tiny_config)

H = 32


def requests(lens, max_tokens):
    return random_requests(lens, max_tokens, 64)


def generate(runner, reqs):
    free = runner.num_free_slots
    out = run_to_completion(runner, reqs)
    assert runner.num_free_slots == free
    return out


def config_json(cfg, **extra):
    return dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=cfg.hidden_size,
                intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
                num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
                head_dim=cfg.head_dim, vocab_size=cfg.vocab_size, torch_dtype="float32",
                hc_mult=cfg.hc_mult, max_position_embeddings=cfg.max_position_embeddings, **extra)


def tiny_plan(cfg, algorithm, steps, topk, n, max_bs=4):
    draft_cfg = config_json(tiny_config(num_layers=1))
    if algorithm == "EAGLE3":
        draft_cfg["architectures"] = ["LlamaForCausalLMEagle3"]
    target_cfg = config_json(cfg, num_nextn_predict_layers=1) if algorithm == "MTP" else config_json(cfg)
    plan = plan_from_configs(target_cfg, None if algorithm == "MTP" else draft_cfg,
                             SpecSettings(algorithm, steps, topk, n), GPUS["h200"],
                             Limits(max_running_requests=4, context_length=96, cuda_graph_max_bs=max_bs))
    # The H200 budget would give millions of slots; the test keeps the plan's shape terms.
    return dataclasses.replace(plan, max_total_tokens=500)


CASES = [("EAGLE", 4, 2, 5), ("MTP", 4, 1, 4), ("EAGLE3", 1, 1, 4), ("EAGLE", 1, 3, 6)]


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("algorithm,hc_mult,topk,n", CASES)
def test_padded_graph_buffers_match_plan_and_eager(algorithm, hc_mult, topk, n, fused):
    """fused: the whole speculative iteration through one padded call (what one graph replays);
    otherwise each model call padded on its own."""
    cfg = tiny_config(hc_mult=hc_mult)
    target, perm = predictable_target(cfg, seed=0, layer_scale=0.5)
    draft = copy_draft(algorithm, target, perm)
    plan = tiny_plan(cfg, algorithm, 3, topk, n)
    runner = Runner(target, draft, plan=plan, graph_mode="padded", fused_spec_step=fused)
    assert runner.calls.fused == fused
    shapes = runner.calls.buffer_shapes()
    hs = hc_mult * H
    hin = 3 * H if algorithm == "EAGLE3" else hs
    assert shapes["draft_hidden_states_shape"] == (4 * topk, hs)
    assert shapes["draft_extend_hidden_states_shape"] == (4 * 4, hin)
    assert shapes["verify_hidden_states_shape"] == (4 * n, hin)
    assert runner.draft_hidden.shape[1] == draft.carried_size == hs
    assert runner.calls.max_bs == plan.buffers.max_bs

    eager = Runner(target, draft, plan=plan, graph_mode="off")
    # 3 requests pad to the bucket of 4; then 1 (bucket 1) as requests finish at different times.
    reqs = lambda: requests(lens=(5, 11, 2), max_tokens=12)  # noqa: E731
    assert generate(runner, reqs()) == generate(eager, reqs())
    if fused:  # the iteration passed through the plan's hidden-state buffers
        assert runner.calls.verify_hidden_states.abs().sum() > 0
        assert runner.calls.draft_extend_hidden_states.abs().sum() > 0


def test_batches_above_the_largest_bucket_run_eagerly():
    cfg = tiny_config()
    target, perm = predictable_target(cfg, seed=0, layer_scale=0.5)
    draft = copy_draft("EAGLE", target, perm)
    plan = tiny_plan(cfg, "EAGLE", 3, 1, 4, max_bs=2)
    assert plan.cuda_graph_batch_sizes == (1, 2)
    reqs = lambda: requests(lens=(5, 11, 2, 7), max_tokens=10)  # noqa: E731
    got = generate(Runner(target, draft, plan=plan, graph_mode="padded"), reqs())
    assert got == generate(Runner(target, max_total_tokens=500, max_running_requests=4), reqs())


def test_hidden_size_wide_buffers_are_refused_for_hc_targets():
    """A plan computed for hc_mult = 1 describes H-wide buffers; the hc_mult = 4 engine
    allocates 4H and must refuse to start rather than run with the wrong plan."""
    target, perm = predictable_target(tiny_config(hc_mult=4), seed=0)
    plan = tiny_plan(tiny_config(hc_mult=1), "EAGLE", 3, 1, 4)
    with pytest.raises(ValueError, match="draft_hidden_states_shape: allocated \\(4, 128\\), the plan says \\(4, 32\\)"):
        Runner(target, copy_draft("EAGLE", target, perm), plan=plan, graph_mode="padded")


@pytest.mark.parametrize("topk,n", [(1, 4), (2, 5)])
def test_fused_step_switches_between_sampling_and_greedy(topk, n):
    """Seeded sampling requests beside greedy ones, finishing at different times: the fused step
    moves from its sampling form to its greedy form (which reads none of the sampling inputs) and
    emits exactly what the eager runner emits with the same seeds."""
    from specdeploy.engine.runtime.runner import Request
    cfg = tiny_config()
    target, perm = predictable_target(cfg, seed=0, layer_scale=0.5)
    draft = copy_draft("EAGLE", target, perm)
    plan = tiny_plan(cfg, "EAGLE", 3, topk, n)

    def reqs():
        out = []
        for i, r in enumerate(requests(lens=(5, 11, 2, 7), max_tokens=12)):
            sampled = i % 2 == 0
            out.append(Request(r.id, r.prompt_ids, max_tokens=6 if sampled else 14,
                               temperature=0.9 if sampled else 0.0, seed=100 + i if sampled else None))
        return out
    fused = Runner(target, draft, plan=plan, graph_mode="padded")
    assert fused.calls.fused
    got = generate(fused, reqs())
    assert got == generate(Runner(target, draft, plan=plan, graph_mode="off"), reqs())
