"""What a request's sampling controls do to the target's logits (pure tensor functions, batched).

The same functions run at every place the target's distribution is read: a prefill's first
token, a plain decode step (one row per request) and a verify pass (one row per draft-tree
node). A tree node stands for the sequence root → node, so its row is processed with the
tokens generated up to the root *plus the drafted tokens on its path*: the logits verification
compares a draft token against are exactly those target-only decoding would have had after
the same tokens, so speculative output keeps target-only's tokens (greedy) and distribution
(rejection sampling) under penalties, biases and grammar masks.

    penalize      repetition (HF/vLLM: over prompt and output), then frequency and presence
                  (OpenAI: over output tokens only)
    path_counts   per tree node, the counts of the drafted tokens on its path (root excluded:
                  it is already generated)
    top_logprobs  log-probabilities of chosen tokens and the k most likely, from raw logits
"""

from __future__ import annotations

import torch


def penalize(logits: torch.Tensor, counts: torch.Tensor, seen: torch.Tensor, presence: torch.Tensor,
             frequency: torch.Tensor, repetition: torch.Tensor) -> torch.Tensor:
    """logits [R, V] float32; counts [R, V] output-token counts; seen [R, V] bool (in the prompt
    or the output); presence / frequency / repetition [R] -> penalized logits [R, V].
    repetition 1 and presence = frequency = 0 leave a row as it is."""
    rep = repetition[:, None]
    logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    return logits - frequency[:, None] * counts - presence[:, None] * (counts > 0).to(logits.dtype)


def path_counts(tokens: torch.Tensor, mask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """tokens [B, N] tree tokens (node 0 the root), mask [B, N, N] (node i sees j: j is i or an
    ancestor) -> [B, N, V] float32: how often each token occurs on the path root → i, root
    excluded."""
    onehot = torch.nn.functional.one_hot(tokens, vocab_size).to(torch.float32)
    onehot[:, 0] = 0
    return torch.bmm(mask.to(torch.float32), onehot)


def top_logprobs(logits: torch.Tensor, chosen: torch.Tensor, k: int):
    """logits [..., V] (raw), chosen [...] token ids -> (logprob of chosen [...], top ids [..., k],
    top logprobs [..., k]); k = 0 gives empty tops."""
    lp = torch.log_softmax(logits.float(), -1)
    chosen_lp = lp.gather(-1, chosen[..., None])[..., 0]
    top = lp.topk(k, dim=-1) if k > 0 else None
    if top is None:
        empty = lp.new_zeros(*lp.shape[:-1], 0)
        return chosen_lp, empty.long(), empty
    return chosen_lp, top.indices, top.values
