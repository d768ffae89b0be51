"""Verification of a draft tree against the target (pure tensor functions, batched).

Both functions walk the tree from the root: at each node they try its children in sibling order
and either move to an accepted child or stop. They return

    path [B, D + 1]   tree nodes on the accepted path (root first), -1 padded
    num_accepted [B]  accepted draft tokens (path length - 1)
    bonus [B]         the token the target emits after the path

Greedy: a child is accepted iff its token is the target's argmax at the parent.

Sampling (lossless rejection sampling, SpecInfer-style multi-draft): at a node with target
distribution p, the children c_1..c_k, each proposed from its draft distribution q_i, are tried
in turn: c_i is accepted with probability min(1, p(c_i) / q_i(c_i)); on rejection p becomes
norm((p - q_i)+) before the next sibling. If no child is accepted the bonus token is drawn from
the final p, otherwise the walk continues at the child with the target's distribution there. A
deterministic proposal (top-k drafting, greedy) is q_i = one_hot(c_i), which turns the rule into
"accept with probability p(c_i), else remove c_i from p". The emitted sequence is distributed
exactly as the target's.
"""

from __future__ import annotations

import torch

from specdeploy.engine.models.layers import argmax
from specdeploy.engine.speculative.tree import DraftTree


def _walk(tree: DraftTree, try_child):
    b, n = tree.tokens.shape
    device = tree.tokens.device
    rows = torch.arange(b, device=device)
    max_depth = tree.max_depth
    path = torch.full((b, max_depth + 1), -1, dtype=torch.int64, device=device)
    path[:, 0] = 0
    cur = torch.zeros(b, dtype=torch.int64, device=device)
    active = torch.ones(b, dtype=torch.bool, device=device)
    num_accepted = torch.zeros(b, dtype=torch.int64, device=device)
    for d in range(1, max_depth + 1):
        moved = torch.zeros(b, dtype=torch.bool, device=device)
        for s in range(tree.children.shape[2]):
            child = tree.children[rows, cur, s]                               # [B]
            trying = active & ~moved & (child >= 0)
            accepted = try_child(cur, child.clamp(min=0), trying) & trying
            cur = torch.where(accepted, child, cur)
            moved |= accepted
        path[:, d] = torch.where(moved, cur, -1)
        num_accepted += moved.long()
        active &= moved
    return path, num_accepted, cur


def verify_greedy(tree: DraftTree, target_logits: torch.Tensor):
    """target_logits [B, N, V] at every tree node -> (path, num_accepted, bonus)."""
    pred = argmax(target_logits)                                          # [B, N]
    rows = torch.arange(pred.shape[0], device=pred.device)
    b, n = pred.shape
    nodes = torch.arange(n, device=pred.device)
    if tree.chain:  # node d is accepted iff every node up to it matched
        match = (tree.tokens[:, 1:] == pred[:, :-1]).long().cumprod(1)        # [B, N - 1]
        num_accepted = match.sum(1)
        path = torch.where(nodes[None, :] <= num_accepted[:, None], nodes, -1)
        return path, num_accepted, pred[rows, num_accepted]
    # Without walking: a node matches if its token is the target's choice at its parent and no
    # earlier sibling matched (the walk tries siblings in order); it is on the accepted path if
    # it and all its ancestors match (the mask holds each node's ancestors and itself).
    parent = tree.parents.clamp(min=0)
    match = torch.gather(pred, 1, parent) == tree.tokens
    match[:, 0] = True
    sibling_before = (tree.parents[:, :, None] == tree.parents[:, None, :]) & (nodes[None, :] < nodes[:, None])
    match &= ~(sibling_before & match[:, None, :]).any(-1)
    on_path = ~(tree.mask & ~match[:, None, :]).any(-1)                      # [B, N]
    depth = torch.where(on_path, tree.depth, tree.max_depth + 1)              # off-path: a spare column
    path = torch.full((b, tree.max_depth + 2), -1, dtype=torch.int64, device=pred.device)
    path.scatter_(1, depth, torch.where(on_path, nodes, -1))
    path = path[:, :-1]
    num_accepted = (path >= 0).sum(1) - 1
    last = torch.gather(path, 1, num_accepted[:, None])[:, 0]
    return path, num_accepted, pred[rows, last]


def verify_sampling(tree: DraftTree, target_probs: torch.Tensor, draft_probs: torch.Tensor | None,
                    coins: torch.Tensor, bonus_uniform: torch.Tensor):
    """target_probs [B, N, V] (already warped: temperature / top-k / top-p); draft_probs
    [B, N, V] the distribution node i's token was drawn from (None: every node deterministic,
    q = one-hot); coins [B, N] and bonus_uniform [B] uniform(0, 1) draws.
    -> (path, num_accepted, bonus)."""
    b, n, v = target_probs.shape
    rows = torch.arange(b, device=target_probs.device)
    residual = target_probs[:, 0].clone()                                    # [B, V]

    def try_child(cur, child, trying):
        nonlocal residual
        token = tree.tokens[rows, child]
        if draft_probs is None:
            q = torch.nn.functional.one_hot(token, v).to(residual.dtype)
        else:
            q = draft_probs[rows, child]
        p_tok = residual[rows, token]
        q_tok = q[rows, token]
        accepted = coins[rows, child] * q_tok < p_tok
        rejected = trying & ~accepted
        left = (residual - q).clamp(min=0)
        total = left.sum(-1, keepdim=True)
        # total == 0 only if p == q, where rejection cannot happen; keep p then.
        left = torch.where(total > 0, left / total.clamp(min=1e-30), residual)
        residual = torch.where(rejected[:, None], left, residual)
        moved = trying & accepted
        residual = torch.where(moved[:, None], target_probs[rows, child], residual)
        return accepted

    path, num_accepted, _ = _walk(tree, try_child)
    return path, num_accepted, sample_from(residual, bonus_uniform)


def sample_from(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw: probs [B, V] (any positive scale), uniform [B] -> token ids [B]."""
    cdf = probs.cumsum(-1)
    target = uniform[:, None] * cdf[:, -1:]
    idx = torch.searchsorted(cdf, target, right=True).squeeze(-1)
    return idx.clamp(max=probs.shape[-1] - 1)


def warp_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
               top_p: torch.Tensor) -> torch.Tensor:
    """logits [R, V] float32 -> probabilities [R, V] after temperature, top-k (0 = off) and
    top-p, per row. temperature 0 is greedy: a one-hot on the argmax.

    Written to keep few [R, V] tensors alive at once (about five besides the input): inside a
    CUDA graph that verifies a whole batch's draft trees, R is max_bs x num_draft_tokens rows of
    a 128K vocabulary, and the graph's memory pool holds the peak."""
    r, v = logits.shape
    greedy = temperature <= 0
    sorted_logits, order = torch.sort(logits / torch.where(greedy, 1.0, temperature)[:, None],
                                      dim=-1, descending=True)
    sorted_probs = torch.softmax(sorted_logits, -1)
    del sorted_logits
    # Keep a token if it is within top-k and the mass strictly before it is below top_p.
    mass_before = sorted_probs.cumsum(-1).sub_(sorted_probs)
    keep = mass_before < top_p[:, None]
    del mass_before
    k = torch.where(top_k > 0, top_k, v)[:, None]
    keep &= torch.arange(v, device=logits.device)[None, :] < k
    keep[:, 0] = True
    sorted_probs.mul_(keep)
    del keep
    probs = torch.zeros_like(sorted_probs).scatter_(1, order, sorted_probs)
    del order, sorted_probs
    probs.div_(probs.sum(-1, keepdim=True))
    # Greedy rows: zero, then one on the argmax.
    probs.mul_(~greedy[:, None])
    return probs.scatter_add_(1, argmax(logits)[:, None], greedy[:, None].to(probs.dtype))
