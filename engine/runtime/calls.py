"""The model invocations of the decode loop, each a function of fixed-shape tensors.

These are the units CUDA graphs capture (graphs.py wraps an instance with the same methods);
the runner calls them identically whether they replay a graph or run eagerly.

    target_decode     ids [B, 1]                      -> logits [B, V]
    target_decode_feature  the same                   -> logits [B, V], feature [B, Hin]
                      (a plain step of a runner with a draft head: the feature feeds the
                      draft's catch-up, see runner.py)
    target_verify     tree tokens [B, N], tree mask   -> logits [B, N, V], feature [B, N, Hin]
    draft_multi_step  root hidden [B * topk, Hc]      -> candidate list [B, M] (+ proposals)
    draft_extend      tokens [B, Q], feature [B, Q, Hin] -> draft hidden after the last valid
                      entry [B, Hc]
    spec_step         the four above and the tree and acceptance between them: one whole
                      speculative iteration with no host sync (`speculate`), which graphs.py
                      captures as one graph

The committed prefix of each request is passed as `prefix_slots [B, Kp]` with `prefix_lens [B]`.
"""

from __future__ import annotations

import torch

from specdeploy.engine.models.attention import AttnBatch, causal_batch
from specdeploy.engine.models.draft import DraftHead
from specdeploy.engine.memory.kv import KVPool
from specdeploy.engine.models.protocol import TargetModel
from specdeploy.engine.memory.kv import PAD_SLOT
from specdeploy.engine.models.layers import argmax
from specdeploy.engine.speculative.tree import build_tree, expand_step
from specdeploy.engine.speculative.verify import sample_from, verify_greedy, verify_sampling, warp_probs


class ModelCalls:
    def __init__(self, target: TargetModel, draft: DraftHead | None, target_kv: KVPool,
                 draft_kv: KVPool | None, num_steps: int, topk: int, num_draft_tokens: int):
        self.target, self.draft = target, draft
        self.target_kv, self.draft_kv = target_kv, draft_kv
        self.num_steps, self.topk, self.num_draft_tokens = num_steps, topk, num_draft_tokens

    def target_decode(self, ids, positions, out_slots, prefix_slots, prefix_lens) -> torch.Tensor:
        b = ids.shape[0]
        mask = torch.ones(b, 1, 1, dtype=torch.bool, device=ids.device)
        batch = AttnBatch(out_slots, prefix_slots, prefix_lens, out_slots, mask)
        out = self.target(ids, positions, batch, self.target_kv)
        return self.target.logits(out.hidden[:, 0])

    def target_decode_feature(self, ids, positions, out_slots, prefix_slots, prefix_lens):
        b = ids.shape[0]
        mask = torch.ones(b, 1, 1, dtype=torch.bool, device=ids.device)
        batch = AttnBatch(out_slots, prefix_slots, prefix_lens, out_slots, mask)
        out = self.target(ids, positions, batch, self.target_kv)
        return self.target.logits(out.hidden[:, 0]), out.feature[:, 0]

    def target_verify(self, ids, positions, out_slots, prefix_slots, prefix_lens, tree_mask):
        batch = AttnBatch(out_slots, prefix_slots, prefix_lens, out_slots, tree_mask)
        out = self.target(ids, positions, batch, self.target_kv)
        return self.target.logits(out.hidden), out.feature

    def draft_extend(self, ids, hidden, positions, out_slots, prefix_slots, prefix_lens,
                     num_valid) -> torch.Tensor:
        batch = causal_batch(out_slots, num_valid, prefix_slots, prefix_lens)
        out = self.draft(ids, hidden, positions, batch, self.draft_kv)       # [B, Q, Hc]
        return out[torch.arange(out.shape[0], device=out.device), num_valid - 1]

    def spec_step(self, roots, lens, prefix_slots, hidden, scratch, tree_slots, temperature, top_k,
                  top_p, uniforms, sampling: bool):
        return speculate(self, roots, lens, prefix_slots, hidden, scratch, tree_slots, temperature,
                         top_k, top_p, uniforms, sampling)

    # Eager calls take a grammar mask for chain drafts (speculate's draft_mask); graphed ones do not.
    takes_draft_mask = True

    def draft_multi_step(self, hidden, prefix_slots, prefix_lens, scratch, temperature, top_k,
                         top_p, uniforms, chain_sampling: bool, draft_mask=None):
        """hidden [B * topk, Hc]: the draft state after each root, repeated topk times (the
        layout of the draft graph's static buffer). scratch [B, (S - 1) * topk] slots for the
        draft K/V of steps 1..S-1. uniforms [B, S] (chain sampling draws).
        -> cand_tokens, cand_scores, cand_parents [B, M] (target ids; parents are list indices,
           -1 = root) and draft_q [B, S, V] (chain sampling: the distribution each draft token
           was drawn from, over the target vocabulary) or None.
        draft_mask: fn(paths [R, i]: the draft tokens from the root to each node to expand (target
        ids; R = B x nodes per request, request-major), draft ids [Vd] in target ids) -> allowed
        [R, Vd]; the draft proposes among allowed tokens only (a grammar's mask)."""
        draft, k, steps = self.draft, self.topk, self.num_steps
        b = hidden.shape[0] // k
        dev = hidden.device
        hidden = hidden.view(b, k, -1)
        logits = draft.logits(hidden[:, :1])[:, 0]                            # [B, Vd]
        draft_ids = None
        if draft_mask is not None:
            draft_ids = draft.to_target_ids(torch.arange(logits.shape[-1], device=dev))
            logits = _masked(logits, draft_mask(torch.zeros(b, 0, dtype=torch.int64, device=dev), draft_ids))
        tokens, scores, qs = self._choose(logits, k, chain_sampling,
                                          (temperature, top_k, top_p), uniforms[:, 0])
        # [B, K, i]: the tokens root → each node to expand (only for a mask: not in the graphs)
        paths = tokens[:, :, None] if draft_mask is not None else None
        cand_tokens, cand_scores = [tokens], [scores]
        cand_parents = [torch.full((b, k), -1, dtype=torch.int64, device=dev)]
        draft_q = [qs] if chain_sampling else []
        list_index = torch.arange(k, device=dev).expand(b, k)                 # inputs' list indices
        anc = torch.zeros(b, k, (steps - 1) * k, dtype=torch.bool, device=dev)
        self_only = torch.eye(k, dtype=torch.bool, device=dev)
        for i in range(1, steps):
            anc[:, :, (i - 1) * k:i * k] |= self_only                         # each node sees itself
            batch = AttnBatch(scratch[:, (i - 1) * k:i * k], prefix_slots, prefix_lens, scratch, anc)
            positions = (prefix_lens + i - 1)[:, None].expand(b, k)
            out = draft(tokens, hidden, positions, batch, self.draft_kv)      # [B, K, Hc]
            logits = draft.logits(out)                                        # [B, K, Vd]
            if draft_mask is not None:
                allowed = draft_mask(paths.reshape(b * k, i), draft_ids)
                logits = _masked(logits, allowed.view(b, k, -1))
            if chain_sampling:
                tokens, scores, q = self._choose(logits[:, 0], 1, True, (temperature, top_k, top_p),
                                                 uniforms[:, i])
                cand_tokens.append(tokens)
                cand_scores.append(scores)
                cand_parents.append(list_index)
                draft_q.append(q)
                list_index = torch.full((b, 1), i, dtype=torch.int64, device=dev)
                hidden = out
                if paths is not None:
                    paths = torch.cat([paths, tokens[:, :, None]], 2)
                continue
            child_p, child_i = _top_probs(logits, k)                          # [B, K, K]
            c_scores, c_tokens, c_parent, keep = expand_step(scores, child_p,
                                                             draft.to_target_ids(child_i), k)
            cand_tokens.append(c_tokens)
            cand_scores.append(c_scores)
            cand_parents.append(torch.gather(list_index, 1, c_parent))
            parent = torch.gather(c_parent, 1, keep)                          # [B, K] in 0..K-1
            tokens = torch.gather(c_tokens, 1, keep)
            scores = torch.gather(c_scores, 1, keep)
            hidden = torch.gather(out, 1, parent[:, :, None].expand(-1, -1, out.shape[-1]))
            anc = torch.gather(anc, 1, parent[:, :, None].expand(-1, -1, anc.shape[-1]))
            if paths is not None:
                paths = torch.cat([torch.gather(paths, 1, parent[:, :, None].expand(-1, -1, i)), tokens[:, :, None]], 2)
            list_index = k + (i - 1) * k * k + keep
        return (torch.cat(cand_tokens, 1), torch.cat(cand_scores, 1), torch.cat(cand_parents, 1),
                torch.stack(draft_q, 1) if chain_sampling else None)

    def _choose(self, logits, k, chain_sampling, params, uniform):
        """logits [B, Vd] -> tokens [B, K] (target ids), scores [B, K], proposal q [B, V] | None.
        Chain sampling draws one token from the warped draft distribution (the same temperature
        / top-k / top-p as the target's); otherwise the top-k tokens, scored by probability."""
        if chain_sampling:
            q = warp_probs(logits, *params)                                   # [B, Vd]
            token = sample_from(q, uniform)
            return (self.draft.to_target_ids(token)[:, None], torch.ones_like(uniform)[:, None],
                    self._to_target_vocab(q))
        probs, ids = _top_probs(logits, k)
        return self.draft.to_target_ids(ids), probs, None

    def _to_target_vocab(self, q: torch.Tensor) -> torch.Tensor:
        v = self.target.cfg.vocab_size
        if q.shape[-1] == v and self.draft.algorithm != "EAGLE3":
            return q
        ids = self.draft.to_target_ids(torch.arange(q.shape[-1], device=q.device))
        return torch.zeros(q.shape[0], v, dtype=q.dtype, device=q.device).index_add_(1, ids, q)


def _masked(logits: torch.Tensor, allowed: torch.Tensor | None) -> torch.Tensor:
    return logits if allowed is None else logits.masked_fill(~allowed, float("-inf"))


def _top_probs(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k most likely tokens of logits [..., V] and their probabilities [..., k], without
    materialising the softmax over the vocabulary. k = 1 (a chain, where every candidate is kept
    and scores rank nothing) is the argmax with score 1."""
    if k == 1:
        ids = argmax(logits)[..., None]
        return torch.ones(ids.shape, dtype=logits.dtype, device=logits.device), ids
    top, ids = logits.topk(k, dim=-1)
    return torch.exp(top - torch.logsumexp(logits, -1, keepdim=True)), ids


def speculate(calls, roots, lens, prefix_slots, hidden, scratch, tree_slots, temperature, top_k,
              top_p, uniforms, sampling: bool, process=None):
    """One speculative iteration for B requests, entirely on the device (no host sync, fixed
    shapes): draft, tree, verify, accept, draft extend. `calls` provides draft_multi_step,
    target_verify and draft_extend (eager ModelCalls, or graphed per-call replays) and the
    num_steps / topk / num_draft_tokens they were built for.

    roots [B] last emitted tokens (not in the KV yet); lens [B] committed tokens; hidden
    [B * topk, Hc] the draft state after each root, repeated topk times; scratch
    [B, (S - 1) * topk] and tree_slots [B, N] slots taken for this iteration; temperature /
    top_k / top_p [B]; uniforms [B, N + 1 + S] (verify coins per node, the bonus draw, one draw
    per chain draft step); sampling: rejection sampling (chain sampling when topk is 1) instead
    of greedy acceptance; process: a sampling.StepLogits (eager steps only) whose controls apply
    to every tree node's logits before acceptance, and which keeps the emitted tokens'
    log-probabilities (from the raw logits at the accepted path's nodes) in `recorded`.
    -> num_accepted [B]; bonus [B]; path_tokens [B, S + 1] (the root, then the accepted drafts;
       padding past them); path_slots [B, S + 1] (the tree slots of those nodes, the pad slot
       past them); positions [B, S + 1] (lens + 0..S, where path_slots go in req_to_slot);
       to_free [B, N] (flat, the tree slots off the accepted paths of all rows, row after row:
       the first sum(N - 1 - num_accepted) entries are the slots to free); draft_hidden
       [B, Hc] (the draft state after the bonus token, for the next iteration)."""
    steps, n, topk = calls.num_steps, calls.num_draft_tokens, calls.topk
    b = roots.shape[0]
    dev = roots.device
    chain_sampling = sampling and topk == 1
    masked = {}
    if process is not None and process.grammars and getattr(calls, "takes_draft_mask", False):
        masked = {"draft_mask": lambda chain, ids: process.draft_mask(roots, chain, ids)}
    cand_tokens, cand_scores, cand_parents, draft_q = calls.draft_multi_step(
        hidden, prefix_slots, lens, scratch, temperature, top_k, top_p, uniforms[:, n + 1:],
        chain_sampling, **masked)
    tree = build_tree(roots, cand_tokens, cand_scores, cand_parents, n, topk, steps, check=False)
    logits, feature = calls.target_verify(tree.tokens, lens[:, None] + tree.depth, tree_slots,
                                          prefix_slots, lens, tree.mask)     # [B, N, V], [B, N, Hin]
    raw = logits
    if process is not None:
        logits = process.tree(tree, logits)
    if not sampling:
        path, num_acc, bonus = verify_greedy(tree, logits)
    else:
        v = logits.shape[-1]
        p = warp_probs(logits.reshape(b * n, v), *(x.repeat_interleave(n) for x in (temperature, top_k, top_p)))
        q = None
        if chain_sampling:  # node d was drawn from the step d - 1 proposal; the root from none
            q = torch.cat([torch.zeros(b, 1, v, dtype=draft_q.dtype, device=dev), draft_q], 1)
        path, num_acc, bonus = verify_sampling(tree, p.view(b, n, v), q, uniforms[:, :n], uniforms[:, n])

    # Draft extend: entries (token after node j, target feature at node j) along the path.
    valid = path >= 0                                                       # [B, S + 1]
    at = path.clamp(min=0)
    path_slots = torch.where(valid, torch.gather(tree_slots, 1, at), PAD_SLOT)
    path_tokens = torch.gather(tree.tokens, 1, at)
    ext_tokens = torch.cat([path_tokens[:, 1:], path_tokens[:, :1]], 1)
    ext_tokens.scatter_(1, num_acc[:, None], bonus[:, None])
    if process is not None and process.wants_logprobs:
        # Path node d chose the d-th emitted token (the bonus at d = num_accepted).
        at_logits = torch.gather(raw, 1, at[:, :, None].expand(-1, -1, raw.shape[-1]))
        process.recorded = process.logprobs(at_logits, ext_tokens)
    ext_hidden = torch.gather(feature, 1, at[:, :, None].expand(-1, -1, feature.shape[-1]))
    positions = lens[:, None] + torch.arange(steps + 1, device=dev)
    draft_hidden = calls.draft_extend(ext_tokens, ext_hidden, positions, path_slots, prefix_slots,
                                      lens, num_acc + 1)
    # The tree slots off every row's path, packed to the front in row order (padding entries of a
    # path point at the root, which is on the path anyway); the rest go to a spare last entry.
    off = torch.ones(b, n, dtype=torch.bool, device=dev).scatter_(1, at, False).view(-1)
    dest = torch.where(off, off.long().cumsum(0) - 1, b * n)
    to_free = torch.zeros(b * n + 1, dtype=tree_slots.dtype, device=dev).scatter_(0, dest, tree_slots.reshape(-1))
    return num_acc, bonus, path_tokens, path_slots, positions, to_free[:-1].view(b, n), draft_hidden
