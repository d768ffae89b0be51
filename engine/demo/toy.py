"""Tiny in-memory models for tests and the demo (no checkpoint needed).

`predictable_target` builds a random Llama-family model whose next token is mostly a fixed
permutation of the current one (embeddings and lm_head are aligned, the blocks add a
`layer_scale`-sized perturbation), and `copy_draft` builds draft heads that predict that
permutation. The draft then agrees with the target often but not always, which is what a
lossless test needs: many accepted and many rejected drafts.
"""

from __future__ import annotations

import torch
from torch import nn

from specdeploy.engine.models.draft import DraftHead, build_draft
from specdeploy.engine.models.llama import LlamaModel, ModelConfig, build_target


def tiny_config(**overrides) -> ModelConfig:
    fields = dict(model_type="llama", hidden_size=32, intermediate_size=64, num_layers=6,
                  num_heads=4, num_kv_heads=2, head_dim=8, vocab_size=64,
                  max_position_embeddings=512, rms_norm_eps=1e-6, rope_theta=10000.0)
    fields.update(overrides)
    return ModelConfig(**fields)


@torch.no_grad()
def init_random_(module: nn.Module, generator: torch.Generator, std: float = 0.1,
                 out_scale: float = 1.0) -> None:
    """Random weights: matrices N(0, std) (o_proj/down_proj further scaled by out_scale),
    norms near 1, biases small, hyper-connection mixers small."""
    for name, p in module.named_parameters():
        if p.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            continue
        r = torch.randn(p.shape, generator=generator).to(p.dtype)
        if "norm" in name:
            p.copy_(1.0 + 0.05 * r)
        elif name.endswith("_hc.fn") or name.endswith("hc_head.fn"):
            p.copy_(0.02 * r)
        elif name.endswith(".base") or name.endswith(".scale"):
            p.copy_((1.0 if name.endswith(".scale") else 0.0) + 0.1 * r)
        elif name.endswith("bias"):
            p.copy_(0.02 * r)
        else:
            scale = out_scale if ("o_proj" in name or "down_proj" in name) else 1.0
            p.copy_(std * scale * r)


def random_target(cfg: ModelConfig, seed: int = 0, dtype=torch.float32, device="cpu") -> LlamaModel:
    model = build_target(cfg, dtype, device)
    init_random_(model, torch.Generator().manual_seed(seed), std=0.2)
    return model


@torch.no_grad()
def predictable_target(cfg: ModelConfig, seed: int = 0, layer_scale: float = 0.5,
                       dtype=torch.float32, device="cpu") -> tuple[LlamaModel, torch.Tensor]:
    """-> (model, perm) with argmax next token close to perm[current token]."""
    g = torch.Generator().manual_seed(seed)
    model = build_target(cfg, dtype, device)
    init_random_(model, g, std=0.2, out_scale=layer_scale)
    perm = torch.randperm(cfg.vocab_size, generator=g)
    embed = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g)
    model.embed_tokens.weight.copy_(embed)
    if model.lm_head.weight is not model.embed_tokens.weight:
        head = torch.empty_like(embed)
        head[perm] = embed
        model.lm_head.weight.copy_(head)
    return model, perm


@torch.no_grad()
def copy_draft(algorithm: str, target: LlamaModel, perm: torch.Tensor, seed: int = 1,
               layer_scale: float = 0.3, draft_vocab: torch.Tensor | None = None) -> DraftHead:
    """A draft head that predicts perm[token] (EAGLE, MTP: at every depth; EAGLE-3: from the
    target's features, so mostly at depth 1). draft_vocab (EAGLE-3): target ids of the draft
    vocabulary; tokens outside it are never proposed."""
    cfg = target.cfg
    kwargs = {}
    if algorithm == "EAGLE3":
        draft_vocab = draft_vocab if draft_vocab is not None else torch.arange(cfg.vocab_size)
        kwargs["draft_vocab_size"] = len(draft_vocab)
    head = build_draft(algorithm, ModelConfig(**{**cfg.__dict__, "num_layers": 1, "hc_mult": 1}),
                       target, target.embed_tokens.weight.dtype, target.embed_tokens.weight.device,
                       **kwargs)
    g = torch.Generator().manual_seed(seed)
    init_random_(head, g, std=0.2, out_scale=layer_scale)
    h, hs = cfg.hidden_size, cfg.spec_hidden_size
    eye = torch.eye(h)
    if algorithm == "EAGLE":
        # Every stream starts as the token's embedding; the target's feature is ignored.
        head.fc.weight.copy_(torch.cat([eye.repeat(hs // h, 1), torch.zeros(hs, hs)], 1))
        head.fc.bias.zero_() if head.fc.bias is not None else None
    elif algorithm == "MTP":
        if cfg.hc_mult == 1:
            head.eh_proj.weight.copy_(torch.cat([eye, torch.zeros(h, h)], 1))
        else:
            head.e_proj.weight.copy_(eye)
            head.h_proj.weight.zero_()
    elif algorithm == "EAGLE3":
        # fc keeps the first aux state (about the current token's embedding); the lm_head maps it
        # two permutation steps ahead, to the token after the draft's input token.
        head.fc.weight.copy_(torch.cat([eye, torch.zeros(h, 2 * h)], 1))
        embed = target.embed_tokens.weight.float()
        perm2 = perm[perm]
        inv2 = torch.empty_like(perm2)
        inv2[perm2] = torch.arange(len(perm2))
        head.lm_head.weight.copy_(embed[inv2[draft_vocab]])
        head.d2t.copy_(draft_vocab - torch.arange(len(draft_vocab)))
        head.t2d.zero_()
        head.t2d[draft_vocab] = True
    else:
        raise ValueError(f"unknown algorithm {algorithm!r}")
    return head


def random_requests(prompt_lens, max_tokens: int, vocab_size: int, **sampling):
    """Requests r0, r1, ... with reproducible random prompts of the given lengths."""
    from specdeploy.engine.runtime.runner import Request
    return [Request(f"r{i}", torch.randint(0, vocab_size, (n,),
                                           generator=torch.Generator().manual_seed(i)).tolist(),
                    max_tokens, **sampling) for i, n in enumerate(prompt_lens)]


def run_to_completion(runner, reqs) -> dict[str, list[int]]:
    """Add every request, step until none is running; -> generated tokens per request id."""
    for r in reqs:
        runner.add(r)
    out = {r.id: [] for r in reqs}
    while runner.num_running:
        for o in runner.step():
            out[o.req_id] += o.token_ids
    return out
