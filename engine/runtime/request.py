"""What the runner is asked (`Request`), what each step answers (`StepOutput`), and what it
keeps per request between steps (`Seq`).

A request's committed tokens own the same slot in the target and the draft pool. State kept per
request between steps: its committed length, the last emitted token (the next tree root, not yet
in the KV) and the draft's hidden state after that token (`draft_hidden`, one row per request,
on the runner). HTTP, tokenization, stop strings and queueing live elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specdeploy.engine.runtime.sampling import LogitControls, TokenLogprob



@dataclass
class Request:
    id: str
    prompt_ids: list[int]
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0          # 0 = off
    seed: int | None = None
    stop_token_ids: set[int] = field(default_factory=set)
    # Penalties, bias, grammar, logprobs (sampling.py): such a request's steps run eagerly.
    controls: LogitControls | None = None


@dataclass
class StepOutput:
    req_id: str
    token_ids: list[int]            # tokens emitted by this step (a stop token is included)
    num_accepted_drafts: int
    finished: bool
    finish_reason: str | None       # "stop" | "length" | None
    num_cached_tokens: int = 0      # on a request's first output: prompt tokens the prefix cache held
    num_draft_tokens: int = 0       # draft tokens this step proposed for it (0: prefill or a plain step)
    logprobs: list[TokenLogprob] | None = None         # one per token_ids entry, when asked for
    prompt_logprobs: list[TokenLogprob] | None = None  # on the first output: prompt tokens 1.. (echo)


class NoCapacity(RuntimeError):
    """The request fits the engine but not right now: retry after requests finish."""


@dataclass
class Seq:
    """An admitted request's state on the runner."""
    req: Request
    row: int
    length: int                     # committed tokens (in both KV pools)
    root: int = -1                  # last emitted token: not yet in the KV
    num_generated: int = 0
    reserved: int = 0
    generator: torch.Generator | None = None
    tokens: list[int] = field(default_factory=list)  # emitted so far, including any cut by a stop
    # Prefix cache: row positions [0, cached) are the tree's slots, locked at cache_node;
    # matched_slots fill the row when it is taken; num_cached_tokens is what the hit saved.
    cached: int = 0
    cache_node: object = None
    matched_slots: torch.Tensor | None = None
    num_cached_tokens: int = 0
    prompt_keys: list[int] | None = None
    match_version: int = -1         # the cache's num_inserted at its last match
    pending: int = 0                # committed tokens the draft has not run over yet (adaptive NONE steps)
    prompt_lps: list | None = None  # prompt log-probabilities gathered over its prefill chunks
