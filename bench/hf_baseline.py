"""transformers `generate()` on the same weights as our engine: the baseline users would reach
for. Eager (dynamic cache) and static cache with transformers' own torch.compile.

Decode tok/s is measured as (time(N new tokens) - time(1 new token)) / (N - 1) per step, so
prefill is excluded; batch x steps/s is the throughput. Every call asks for the same
max_new_tokens and a stopping criterion ends the short one, so the static cache has one shape
and transformers compiles its decode step once.
"""

from __future__ import annotations

import time

import torch

from common import log, sync


def hf_config(config: dict):
    from transformers import LlamaConfig

    return LlamaConfig(**{k: v for k, v in config.items() if k not in ("architectures", "torch_dtype")})


def engine_state_dict_for_hf(target) -> dict:
    """The engine's target weights under transformers' Llama names (shared storage, no copy)."""
    out = {}
    for name, t in target.state_dict().items():
        out[name if name.startswith("lm_head.") else "model." + name] = t
    return out


def build_hf_llama(config: dict, device, dtype=torch.bfloat16, engine_target=None):
    """LlamaForCausalLM built in `dtype` on `device`; with `engine_target`, holding the engine's
    own weights, so both run the same model."""
    from transformers import LlamaForCausalLM

    cfg = hf_config(config)
    torch.manual_seed(0)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(prev)
    if engine_target is not None:
        state = engine_state_dict_for_hf(engine_target)
        if cfg.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        missing, unexpected = model.load_state_dict(state, strict=False)
        missing = [m for m in missing if not (cfg.tie_word_embeddings and m == "lm_head.weight")]
        if missing or unexpected:
            raise ValueError(f"engine -> transformers weights: missing {missing[:4]}, unexpected {unexpected[:4]}")
    model.eval()
    return model


@torch.inference_mode()
def engine_logits(target, input_ids: torch.Tensor) -> torch.Tensor:
    """input_ids [B, T] -> the engine's float32 logits [B, T, V] (a prefill over a fresh pool)."""
    from specdeploy.engine.models.attention import causal_batch
    from specdeploy.engine.memory.kv import KVPool

    cfg = target.cfg
    b, t = input_ids.shape
    dev = input_ids.device
    kv = KVPool(cfg.num_layers, b * t + 1, cfg.num_kv_heads, cfg.head_dim,
                target.embed_tokens.weight.dtype, dev)
    slots = torch.arange(1, b * t + 1, device=dev).view(b, t)
    batch = causal_batch(slots, torch.full((b,), t, device=dev),
                         torch.zeros(b, 0, dtype=torch.int64, device=dev), torch.zeros(b, dtype=torch.int64, device=dev))
    out = target(input_ids, torch.arange(t, device=dev).expand(b, t), batch, kv)
    return target.logits(out.hidden)


@torch.inference_mode()
def parity(target, hf_model, vocab_size: int, length: int = 32) -> dict:
    """Same weights, same tokens: relative L2 difference of the two implementations' logits and
    the share of positions whose argmax agrees (bf16: expect ~1e-2 and near 100%)."""
    dev = target.embed_tokens.weight.device
    gen = torch.Generator(device="cpu").manual_seed(7)
    ids = torch.randint(0, vocab_size, (1, length), generator=gen).to(dev)
    ours = engine_logits(target, ids).float()[0]                             # [T, V]
    theirs = hf_model(ids).logits.float()[0]
    rel = ((ours - theirs).norm() / theirs.norm()).item()
    agree = (ours.argmax(-1) == theirs.argmax(-1)).float().mean().item()
    # Relative difference per position, first and last eighth: a rotary error grows with position.
    per_pos = (ours - theirs).norm(dim=-1) / theirs.norm(dim=-1)
    k = max(1, length // 8)
    return {"tokens": length, "rel_l2_logits": rel, "argmax_agreement": agree,
            "rel_l2_first_eighth": per_pos[:k].mean().item(), "rel_l2_last_eighth": per_pos[-k:].mean().item()}


def _stop_after(start: int, n: int):
    from transformers import StoppingCriteria, StoppingCriteriaList

    class StopAfter(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            done = input_ids.shape[1] - start >= n
            return torch.full((input_ids.shape[0],), done, dtype=torch.bool, device=input_ids.device)

    return StoppingCriteriaList([StopAfter()])


def _generate_s(model, input_ids, max_new_tokens: int, device, stop_after: int | None = None) -> float:
    """Wall time of one generate() call making `stop_after` (default all) of `max_new_tokens`."""
    n = stop_after or max_new_tokens
    sync(device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=None,
            stopping_criteria=_stop_after(input_ids.shape[1], n),
        )
    sync(device)
    seconds = time.perf_counter() - t0
    if out.shape[1] - input_ids.shape[1] != n:
        raise RuntimeError(f"generate() made {out.shape[1] - input_ids.shape[1]} tokens, expected {n}")
    return seconds


def decode_tok_s(model, batch: int, context: int, new_tokens: int, repeats: int, device) -> dict:
    gen = torch.Generator(device="cpu").manual_seed(batch)
    input_ids = torch.randint(3, model.config.vocab_size, (batch, context), generator=gen).to(device)
    _generate_s(model, input_ids, new_tokens, device, stop_after=2)  # warm-up (compiles a static cache)
    _generate_s(model, input_ids, new_tokens, device)
    steps = []
    for _ in range(repeats):
        one = _generate_s(model, input_ids, new_tokens, device, stop_after=1)
        full = _generate_s(model, input_ids, new_tokens, device)
        steps.append((full - one) / (new_tokens - 1))
    steps.sort()
    step_s = steps[len(steps) // 2]
    return {"batch": batch, "context": context, "new_tokens": new_tokens, "repeats": repeats,
            "step_ms": step_s * 1e3, "tok_s": batch / step_s}


def run(model, device, batches=(1, 4, 16, 64), compiled_batches=(1,), context: int = 1024,
        new_tokens: int = 24, repeats: int = 3, compile: bool = True) -> dict:
    out = {"eager": [], "static_compiled": [], "static_compiled_is_compiled": False}
    for b in batches:
        try:
            r = decode_tok_s(model, b, context, new_tokens, repeats, device)
        except Exception as e:  # one failing batch size is a table cell, not a lost section
            log(f"transformers eager bs={b} failed: {e!r}")
            out["eager"].append({"batch": b, "error": repr(e)[:300]})
            continue
        log(f"transformers eager  bs={b:<3} {r['tok_s']:8.1f} tok/s  step {r['step_ms']:.2f} ms")
        out["eager"].append(r)
    model.generation_config.cache_implementation = "static"
    # transformers compiles the decode forward itself when the cache is static and the device is
    # a GPU; without `compile` (or on CPU) the static-cache path runs uncompiled.
    model.generation_config.disable_compile = not compile
    out["static_compiled_is_compiled"] = bool(compile and torch.device(device).type == "cuda")
    for b in compiled_batches:
        t0 = time.perf_counter()
        try:
            r = decode_tok_s(model, b, context, 2 * new_tokens, repeats, device)
        except Exception as e:  # compile failures are reported in the table, not fatal to the suite
            log(f"transformers static+compile bs={b} failed: {e!r}")
            out["static_compiled"].append({"batch": b, "error": repr(e)[:300]})
            continue
        r["wall_s_including_compile"] = time.perf_counter() - t0
        log(f"transformers static{'+compile' if out['static_compiled_is_compiled'] else ''} "
            f"bs={b:<3} {r['tok_s']:8.1f} tok/s  step {r['step_ms']:.2f} ms")
        out["static_compiled"].append(r)
    model.generation_config.cache_implementation = None
    return out
