"""What the prefix-cache and short-chunk-graph tests share: prompts drawn from a seed, and a
Runner driven one request at a time (each prefill chunk is then one request's, the case the
short-chunk graphs take) collecting tokens, accepted drafts and cached prompt tokens."""

import torch


def tokens(n: int, seed: int, vocab: int = 64) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def run_one_by_one(runner, reqs) -> dict:
    """{request id: (tokens, accepted drafts per step, cached prompt tokens)}, one request at a time."""
    out = {}
    for r in reqs:
        runner.add(r)
        toks, acc, cached = [], [], None
        while runner.num_running:
            for o in runner.step():
                cached = o.num_cached_tokens if cached is None else cached
                toks += o.token_ids
                acc.append(o.num_accepted_drafts)
        out[r.id] = (toks, acc, cached)
    return out
