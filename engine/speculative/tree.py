"""Draft trees (pure tensor functions, batched over B requests).

Drafting runs `num_steps` steps. Step 0 takes the top `topk` tokens of the draft's prediction
after the root (the last verified token). Each later step expands every one of the `topk` nodes
kept by the previous step into its `topk` best children (scores multiply along a path: the
draft's estimate of the path's probability) and keeps the `topk` best of those topk*topk
children as the next step's inputs. Every candidate of every step goes into one flat list of

    M = topk + (num_steps - 1) * topk**2

candidates, of which the tree keeps the `num_draft_tokens - 1` best. Because a child's score
never exceeds its parent's and ties keep list order, a kept node's parent is always kept too.

Tree node 0 is the root; nodes 1..N-1 are the kept candidates in list order, so a parent always
precedes its children. topk = 1 gives a chain.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class DraftTree:
    tokens: torch.Tensor    # [B, N] int64 token ids (node 0 = root)
    parents: torch.Tensor   # [B, N] int64 parent node (-1 for the root)
    depth: torch.Tensor     # [B, N] int64 (root 0)
    mask: torch.Tensor      # [B, N, N] bool: node i may attend node j (j is i or an ancestor)
    children: torch.Tensor  # [B, N, C] int64 children of each node in sibling order, -1 padded
    max_depth: int          # bound on depth (num_steps when built by the drafter)
    chain: bool = False     # node i's parent is i - 1 in every row (topk = 1)


def expand_step(scores: torch.Tensor, child_probs: torch.Tensor, child_tokens: torch.Tensor,
                topk: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One drafting step after step 0.

    scores [B, K] path scores of the K = topk current nodes; child_probs / child_tokens
    [B, K, topk] their best children. Returns
    cand_scores [B, K*topk], cand_tokens [B, K*topk], cand_parent [B, K*topk] (index of the
    current node, 0..K-1), keep [B, topk] (indices into the K*topk candidates to expand next).
    """
    b, k, c = child_probs.shape
    cand_scores = (scores[:, :, None] * child_probs).reshape(b, k * c)
    cand_parent = (torch.arange(k * c, device=scores.device) // c).expand(b, k * c)
    keep = torch.topk(cand_scores, topk, dim=-1).indices
    return cand_scores, child_tokens.reshape(b, k * c), cand_parent, keep


def build_tree(root_tokens: torch.Tensor, cand_tokens: torch.Tensor, cand_scores: torch.Tensor,
               cand_parents: torch.Tensor, num_draft_tokens: int, topk: int | None = None,
               num_steps: int | None = None, check: bool = True) -> DraftTree:
    """root_tokens [B]; cand_* [B, M] the flat candidate list, cand_parents holding the list
    index of each candidate's parent (-1 = the root). Keeps the num_draft_tokens - 1 best.
    With topk and num_steps given (the drafter's bounds on children and depth) and check=False,
    nothing waits for the device: the decode loop's setting."""
    b, m = cand_tokens.shape
    n = num_draft_tokens
    if not 2 <= n <= m + 1:
        raise ValueError(f"num_draft_tokens={n} must be in [2, {m + 1}] for {m} candidates")
    if topk == 1 and n == m + 1 and not check:
        # The drafter's chain: every candidate is kept, each the child of the one before.
        return chain_tree(root_tokens, cand_tokens)
    device = cand_tokens.device
    # Stable descending sort: equal scores keep list order, so parents (earlier) win ties.
    order = torch.sort(cand_scores, dim=-1, descending=True, stable=True).indices[:, :n - 1]
    kept = torch.sort(order, dim=-1).values                                  # [B, N-1] list idx
    # list index -> tree node (1..N-1), -1 where not kept; the root's "list index" -1 -> node 0.
    node_of = torch.full((b, m + 1), -1, dtype=torch.int64, device=device)
    node_of[:, 0] = 0
    node_of.scatter_(1, kept + 1, torch.arange(1, n, device=device).expand(b, n - 1))
    parent_list = torch.gather(cand_parents, 1, kept)                        # [B, N-1]
    parent_node = torch.gather(node_of, 1, parent_list + 1)
    if check and (parent_node < 0).any():
        raise AssertionError("a kept draft node lost its parent (scores not monotone)")
    tokens = torch.cat([root_tokens[:, None], torch.gather(cand_tokens, 1, kept)], dim=1)
    parents = torch.cat([torch.full((b, 1), -1, dtype=torch.int64, device=device), parent_node], 1)
    return tree_from_parents(tokens, parents, topk, num_steps)


def tree_from_parents(tokens: torch.Tensor, parents: torch.Tensor, max_children: int | None = None,
                      max_depth: int | None = None) -> DraftTree:
    """Derive depth, ancestor mask and child lists from parents [B, N] (parent index < node).
    max_children / max_depth: static bounds; measured from the tree (a device sync) if None."""
    b, n = parents.shape
    device = parents.device
    mask = torch.eye(n, dtype=torch.bool, device=device).expand(b, n, n).clone()
    depth = torch.zeros(b, n, dtype=torch.int64, device=device)
    # Climb every node's ancestors at once, one generation per pass: as many passes as the depth
    # bound (the drafter's num_steps; n - 1 when unknown).
    anc = parents
    for _ in range(n - 1 if max_depth is None else max_depth):
        has = anc >= 0
        mask |= torch.nn.functional.one_hot(anc.clamp(min=0), n).bool() & has[:, :, None]
        depth += has.long()
        anc = torch.where(has, torch.gather(parents, 1, anc.clamp(min=0)), -1)
    is_child = parents[:, None, :] == torch.arange(n, device=device)[None, :, None]  # [B, N(par), N]
    if max_children is None:
        max_children = max(int(is_child.sum(-1).max()), 1)
    if max_depth is None:
        max_depth = int(depth.max())
    max_children = min(max_children, n)
    # Children in node order: sort child indices (non-children pushed to the end).
    key = torch.where(is_child, torch.arange(n, device=device).expand(b, n, n), n)
    children = torch.sort(key, dim=-1).values[:, :, :max_children]
    children = torch.where(children == n, -1, children)
    return DraftTree(tokens, parents, depth, mask, children, max_depth)


def chain_tree(root_tokens: torch.Tensor, draft_tokens: torch.Tensor) -> DraftTree:
    """topk = 1: root followed by draft_tokens [B, S] in a line. Its shape is fixed, so it is
    built from constants (a handful of kernels, none per node)."""
    b, s = draft_tokens.shape
    dev = draft_tokens.device
    n = s + 1
    tokens = torch.cat([root_tokens[:, None], draft_tokens], dim=1)
    nodes = torch.arange(n, device=dev)
    parents = (nodes - 1).expand(b, n)
    depth = nodes.expand(b, n)
    mask = torch.ones(n, n, dtype=torch.bool, device=dev).tril().expand(b, n, n)
    children = torch.where(nodes < s, nodes + 1, -1)[None, :, None].expand(b, n, 1)
    return DraftTree(tokens, parents, depth, mask, children, s, chain=True)
