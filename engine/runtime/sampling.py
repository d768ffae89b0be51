"""A request's sampling controls, and one step's view of them over its batch.

`LogitControls` is what a request asks of the target's distribution beyond temperature / top-k /
top-p: penalties, a logit bias, a minimum length, a grammar (engine/serving/structured.py keeps
the matcher; here it is anything with `masks` and `accept`), and log-probabilities to report.
A request without controls runs the captured decode graphs unchanged; a step whose batch holds
one runs its model calls eagerly with a `StepLogits`, which the runner hands to the prefill's
first-token pick, to a plain step's logits, and into `speculate` (calls.py) for the verify
pass, where every tree node is processed with the drafted tokens on its path
(speculative/logits.py). Log-probabilities come from the raw logits (before controls and
temperature: vLLM's default), taken where the emitted token was chosen: the verify pass's
logits at the accepted path's nodes, which equal target-only decoding's.

`Sampling` is the Runner's sampling glue (a part of `Runner`, over its device, generator and
shapes): a batch's temperature / top-k / top-p as tensors, its uniform draws (each seeded
request from its own generator), the first-token pick, and greedy batches' constants.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from specdeploy.engine.models.layers import argmax
from specdeploy.engine.speculative.logits import path_counts, penalize, top_logprobs
from specdeploy.engine.speculative.verify import sample_from, warp_probs


class TokenGrammar(Protocol):
    """A request's grammar state, in step with the tokens it has emitted."""

    def masks(self, tokens: list[int], parents: list[int]) -> torch.Tensor:
        """Allowed next tokens [N, V] bool at each node of a tree (tokens, parents: node 0 the
        last emitted token, already accepted), each after the path root → node."""

    def accept(self, tokens: list[int]) -> None:
        """Advance past emitted tokens."""


@dataclass
class LogitControls:
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    min_tokens: int = 0
    min_tokens_banned: frozenset[int] = frozenset()  # the stop tokens held back until min_tokens
    logprobs: int | None = None          # None: none; 0: the chosen token's; k: and the k most likely
    prompt_logprobs: int | None = None   # the same for prompt tokens (no prefix-cache reuse then)
    grammar: Any = None                  # a TokenGrammar

    @property
    def penalized(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)


# One emitted token's log-probability and the most likely tokens there: (logprob, [(id, logprob)]).
TokenLogprob = tuple[float, list[tuple[int, float]]]


class StepLogits:
    """The controls of one step's batch (requests in batch order; a row without controls is left
    as it is), built from each request's tokens so far: `seqs` are the runner's sequences
    (req.controls, req.prompt_ids, tokens generated, num_generated)."""

    def __init__(self, seqs, vocab_size: int, device: torch.device):
        self.controls = [s.req.controls for s in seqs]
        self.vocab_size, self.device = vocab_size, device
        b = len(seqs)
        c = [x or LogitControls() for x in self.controls]
        self.penalized = any(x.penalized for x in c)
        if self.penalized:
            self.counts = torch.zeros(b, vocab_size, device=device)
            self.seen = torch.zeros(b, vocab_size, dtype=torch.bool, device=device)
            for i, (x, s) in enumerate(zip(c, seqs)):
                if not x.penalized:
                    continue
                if s.tokens:
                    gen = torch.tensor(s.tokens, dtype=torch.int64, device=device)
                    self.counts[i].index_add_(0, gen, torch.ones(len(s.tokens), device=device))
                if x.repetition_penalty != 1.0:
                    self.seen[i, torch.tensor(s.req.prompt_ids, dtype=torch.int64, device=device)] = True
            self.presence = torch.tensor([x.presence_penalty for x in c], device=device)
            self.frequency = torch.tensor([x.frequency_penalty for x in c], device=device)
            self.repetition = torch.tensor([x.repetition_penalty for x in c], device=device)
        self.bias = None
        if any(x.logit_bias for x in c):
            self.bias = torch.zeros(b, vocab_size, device=device)
            for i, x in enumerate(c):
                for tok, value in x.logit_bias.items():
                    self.bias[i, tok] = value
        # (row, stop ids, how many more tokens must come first)
        self.min_rows = [(i, sorted(x.min_tokens_banned), x.min_tokens - s.num_generated)
                         for i, (x, s) in enumerate(zip(c, seqs))
                         if x.min_tokens_banned and x.min_tokens > s.num_generated]
        self.grammars = [(i, x.grammar) for i, x in enumerate(c) if x.grammar is not None]
        self.top_k = max((x.logprobs for x in c if x.logprobs is not None), default=None)

    @property
    def wants_logprobs(self) -> bool:
        return self.top_k is not None

    def plain(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [B, V] at each request's last token -> processed float32 [B, V]."""
        zeros = torch.zeros(logits.shape[0], 1, dtype=torch.int64, device=logits.device)
        return self._process(logits.float()[:, None], None, zeros, lambda i: ([0], [-1]))[:, 0]

    def tree(self, tree, logits: torch.Tensor) -> torch.Tensor:
        """logits [B, N, V] at every node of a draft tree (speculative/tree.py) -> processed
        float32 [B, N, V], each node's row as if decoding had reached it."""
        extra = path_counts(tree.tokens, tree.mask, self.vocab_size) if self.penalized else None
        host = None
        if self.grammars:
            host = (tree.tokens.tolist(), tree.parents.tolist())
        return self._process(logits.float(), extra, tree.depth, lambda i: (host[0][i], host[1][i]))

    def draft_mask(self, roots: torch.Tensor, paths: torch.Tensor, draft_ids: torch.Tensor) -> torch.Tensor:
        """The draft's next proposals: allowed draft tokens [R, Vd] after root + each path
        (paths [R, i] target ids, R = B x nodes, request-major) by each grammar (all allowed for
        rows without one). Drafts are only proposals: this raises acceptance, verification alone
        keeps the output exact."""
        r = paths.shape[0]
        per = r // len(self.controls)
        allowed = torch.ones(r, draft_ids.shape[0], dtype=torch.bool, device=paths.device)
        host_roots, host_paths = roots.tolist(), paths.tolist()
        for i, grammar in self.grammars:
            for row in range(i * per, (i + 1) * per):
                path = [host_roots[i], *host_paths[row]]
                mask = grammar.masks(path, list(range(-1, len(path) - 1)))[-1].to(paths.device)   # [Vg]
                full = torch.zeros(self.vocab_size, dtype=torch.bool, device=paths.device)
                full[:mask.shape[0]] = mask[:self.vocab_size]
                ok = full[draft_ids]
                if ok.any():  # (a reduced draft vocabulary may hold none of the allowed tokens)
                    allowed[row] = ok
        return allowed

    def _process(self, logits, extra, depth, tree_of) -> torch.Tensor:
        """logits [B, N, V] float32; extra [B, N, V] path counts or None; depth [B, N]; tree_of(i)
        -> row i's (tokens, parents) for its grammar."""
        b, n, v = logits.shape
        if self.penalized:
            counts = self.counts[:, None].expand(b, n, v)
            seen = self.seen[:, None].expand(b, n, v)
            if extra is not None:
                counts = counts + extra
            seen = seen | (counts > 0)
            flat = lambda t: t.reshape(b * n, v)  # noqa: E731
            logits = penalize(flat(logits), flat(counts), flat(seen), *(
                t.repeat_interleave(n) for t in (self.presence, self.frequency, self.repetition))).view(b, n, v)
        if self.bias is not None:
            logits = logits + self.bias[:, None]
        if self.min_rows or self.grammars:
            logits = logits.clone()  # written in place below; the raw logits stay for logprobs
        if self.min_rows:
            for i, banned, left in self.min_rows:
                early = depth[i] < left                                        # [N]
                ids = torch.tensor(banned, dtype=torch.int64, device=logits.device)
                logits[i, :, ids] = torch.where(early[:, None], float("-inf"), logits[i, :, ids])
        for i, grammar in self.grammars:
            tokens, parents = tree_of(i)
            allowed = grammar.masks(tokens, parents).to(logits.device)       # [N, Vg]
            full = torch.zeros(n, v, dtype=torch.bool, device=logits.device)
            full[:, :allowed.shape[1]] = allowed[:, :v]
            logits[i] = logits[i].masked_fill(~full, float("-inf"))
        return logits

    def logprobs(self, raw: torch.Tensor, chosen: torch.Tensor) -> list[list[TokenLogprob] | None]:
        """raw logits [B, K, V] where each of K emitted tokens chosen [B, K] was picked -> per
        request, K entries (None for a request that asked for none)."""
        lp, ids, tops = top_logprobs(raw, chosen, self.top_k or 0)
        lp, ids, tops = lp.tolist(), ids.tolist(), tops.tolist()
        out: list[list[TokenLogprob] | None] = []
        for i, x in enumerate(self.controls):
            if x is None or x.logprobs is None:
                out.append(None)
                continue
            out.append([(lp[i][j], list(zip(ids[i][j][:x.logprobs], tops[i][j][:x.logprobs])))
                        for j in range(len(lp[i]))])
        return out


def wants_processing(seqs) -> bool:
    """Whether a batch needs a StepLogits (some request has controls)."""
    return any(s.req.controls is not None for s in seqs)


class Sampling:
    def _init_sampling(self, seed: int) -> None:
        """The runner's generator (requests without a seed draw from it), and greedy requests'
        sampling parameters and (unused) uniform draws as device constants."""
        self._generator = torch.Generator(device=self.device).manual_seed(seed)
        m = self.max_running_requests
        self._greedy = (torch.zeros(m, device=self.device),
                        torch.zeros(m, dtype=torch.int64, device=self.device),
                        torch.ones(m, device=self.device))
        self._greedy_views: dict[tuple[int, int], tuple] = {}
        self._greedy_uniforms = torch.full(
            (m, max(sh.num_draft_tokens + 1 + sh.num_steps for sh in self.shapes)), 0.5, device=self.device)

    def _greedy_params(self, b: int):
        """Sampling parameters of B greedy requests (device constants made once)."""
        return tuple(x[:b] for x in self._greedy)

    def _greedy_args(self, b: int, draws: int):
        """(sampling parameters, uniform draws [B, draws]) of B greedy requests, the views
        made once per (B, draws)."""
        key = (b, draws)
        if key not in self._greedy_views:
            self._greedy_views[key] = (self._greedy_params(b), self._greedy_uniforms[:b, :draws])
        return self._greedy_views[key]

    def _sampling_params(self, seqs):
        dev = self.device
        return (torch.tensor([s.req.temperature for s in seqs], device=dev),
                torch.tensor([s.req.top_k for s in seqs], device=dev),
                torch.tensor([s.req.top_p for s in seqs], device=dev))

    def _uniforms(self, seqs, n: int) -> torch.Tensor:
        """[B, n] uniform draws, from each request's own generator when it has a seed."""
        return torch.stack([torch.rand(n, generator=s.generator or self._generator, device=self.device)
                            for s in seqs])

    def _sample(self, seqs, logits: torch.Tensor) -> torch.Tensor:
        if all(s.req.temperature == 0 for s in seqs):
            return argmax(logits)
        probs = warp_probs(logits, *self._sampling_params(seqs))
        return sample_from(probs, self._uniforms(seqs, 1)[:, 0])

    def _step_logits(self, seqs) -> StepLogits | None:
        return StepLogits(seqs, self.target.cfg.vocab_size, self.device) if wants_processing(seqs) else None
