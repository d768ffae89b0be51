"""Adaptive speculation: which speculative shape, or none, the next step runs.

A speculative step of shape (num_steps S, topk K, num_draft_tokens N) costs c(shape, b) at batch
size b and commits E(shape) tokens per request on average; a plain step (NONE) costs c(NONE, b)
and commits one. At batch 1 the target forward is bound by reading the weights, so verifying N
tokens costs about as much as decoding one and speculation wins by about E / (c / c_NONE). As the
batch grows the verify forward carries b x N tokens and the multiple c / c_NONE rises towards N,
so somewhere speculation starts to lose throughput (llm-d measured its baseline winning from 4-8
requests per second). This module chooses, every step, the shape with the most tokens per second

    throughput(shape, b) = b x E(shape) / c(shape, b)

and NONE unless some shape beats it by `margin`. Pure Python (no torch): the runner measures the
costs and feeds back what each step accepted.

Costs: `c(shape, bucket)` for every candidate shape and CUDA-graph batch bucket, measured at
start-up by replaying the captured graphs on padded inputs with empty prefixes (eager calls where
nothing is captured). A real step also reads each request's KV prefix and does host work, which
is about the same for every shape (verify reads the prefix once for the whole tree, plain decode
once for its one token), so the policy adds one online offset per bucket to every shape's cost:
an exponential average of (measured step time - start-up cost of the shape that ran).

Acceptance: for depth d, r_d = P(accepted >= d | accepted >= d - 1), pooled over rows from
exponentially decayed counts. Pooled conditional rates telescope to the pooled marginal
P(accepted >= d), so a batch mixing easy and hard requests is averaged right, and

    E(shape) = 1 + sum_{d=1..S} prod_{j<=d} r_j.

Greedy chain drafts do not depend on how deep the chain goes, so all chains share one estimate
(a chain of 2 steps measures depths 1-2 for a chain of 5); each tree shape (topk > 1) has its own.
Every estimate is shrunk towards an optimistic prior with `prior_weight` pseudo-observations
(for a tree, at least the chains' estimate),
and every count decays each step (half-life `half_life_steps`): a shape that has not run for a
while drifts back to the prior and is tried again once the prior says it could win, which is how
the policy explores; at a batch where even the prior loses, it never pays for a probe.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# The shape type is the planner's (its one validate() is the plan's, the runner's and the CRD's bounds).
from specdeploy.engine.planner.plan import NONE, SpecShape

__all__ = ["NONE", "AdaptivePolicy", "SpecShape", "bucket_for", "candidate_shapes"]


def candidate_shapes(num_steps: int, topk: int, num_draft_tokens: int) -> list[SpecShape]:
    """What an adaptive engine configured with (S, K, N) may choose: NONE, chains of 1..S steps
    and the configured shape itself (a tree when K > 1), shortest first."""
    shapes = [NONE] + [SpecShape(s, 1, s + 1) for s in range(1, num_steps + 1)]
    configured = SpecShape(num_steps, topk, num_draft_tokens)
    if configured not in shapes:
        shapes.append(configured)
    return shapes


def bucket_for(batch_size: int, buckets: list[int]) -> int:
    """The graph bucket a batch replays in (the smallest >= it), or the largest for bigger batches."""
    return next((s for s in buckets if s >= batch_size), buckets[-1])


@dataclass
class _Counts:
    """Decayed per-depth counts: trials[d - 1] rows that reached depth d - 1 in a shape at least d
    deep, hits[d - 1] those of them that accepted depth d too."""
    trials: list[float] = field(default_factory=list)
    hits: list[float] = field(default_factory=list)

    def grow(self, depth: int) -> None:
        while len(self.trials) < depth:
            self.trials.append(0.0)
            self.hits.append(0.0)


class AdaptivePolicy:
    def __init__(self, shapes: list[SpecShape], costs_s: dict[tuple[SpecShape, int], float], *,
                 prior_rate: float = 0.8, prior_weight: float = 4.0, half_life_steps: float = 256.0,
                 margin: float = 0.02, online_costs: bool = True, cost_smoothing: float = 0.1):
        """shapes: the candidates (NONE among them). costs_s: start-up seconds per step for every
        (shape, bucket); the buckets are the batch sizes present."""
        if NONE not in shapes:
            raise ValueError("the candidate shapes must include NONE")
        self.shapes = sorted(set(shapes))
        self.buckets = sorted({b for _, b in costs_s})
        missing = [(s.label, b) for s in self.shapes for b in self.buckets if (s, b) not in costs_s]
        if not self.buckets or missing:
            raise ValueError(f"step costs missing for (shape, bucket) {missing or 'all'}")
        self.base_costs_s = dict(costs_s)
        self.prior_rate, self.prior_weight, self.margin = prior_rate, prior_weight, margin
        self.decay = 0.5 ** (1.0 / half_life_steps)
        self.online_costs, self.cost_smoothing = online_costs, cost_smoothing
        self.offset_s: dict[int, float] = {}
        self._counts: dict[str, _Counts] = {}
        self.steps_by_shape: dict[SpecShape, int] = {s: 0 for s in self.shapes}
        self.last_choice: SpecShape | None = None

    # ---- estimates -------------------------------------------------------------------------

    @staticmethod
    def _key(shape: SpecShape) -> str:
        return "chain" if shape.is_chain else shape.label

    def acceptance_rates(self, shape: SpecShape) -> list[float]:
        """r_1..r_S for this shape: measured, shrunk towards the prior. A tree's prior at depth d
        is at least the chains' estimate there: its top branch is about the chain's draft, and
        its other branches can only add accepted paths."""
        c = self._counts.get(self._key(shape), _Counts())
        w = self.prior_weight
        priors = [self.prior_rate] * shape.num_steps
        if shape.topk > 1 and "chain" in self._counts:
            chain = self.acceptance_rates(SpecShape(shape.num_steps, 1, shape.num_steps + 1))
            priors = [max(p, r) for p, r in zip(priors, chain)]
        return [(c.hits[d] + w * p) / (c.trials[d] + w) if d < len(c.trials) else p
                for d, p in enumerate(priors)]

    def expected_tokens(self, shape: SpecShape) -> float:
        """Tokens one request commits per step of this shape (1 for NONE)."""
        total, reach = 1.0, 1.0
        for r in self.acceptance_rates(shape):
            reach *= r
            total += reach
        return total

    def cost_s(self, shape: SpecShape, batch_size: int) -> float:
        bucket = bucket_for(batch_size, self.buckets)
        base = self.base_costs_s[(shape, bucket)]
        if batch_size > bucket:  # above the largest bucket: eager, about proportional
            base *= batch_size / bucket
        return base + self.offset_s.get(bucket, 0.0)

    def throughputs(self, batch_size: int) -> dict[SpecShape, float]:
        """Predicted tokens per second of each candidate at this batch size."""
        return {s: batch_size * self.expected_tokens(s) / self.cost_s(s, batch_size) for s in self.shapes}

    # ---- decisions and feedback --------------------------------------------------------------

    def choose(self, batch_size: int) -> SpecShape:
        tps = self.throughputs(batch_size)
        best = max((s for s in self.shapes if not s.is_none), key=lambda s: tps[s], default=NONE)
        choice = best if tps[best] > tps[NONE] * (1.0 + self.margin) else NONE
        self.last_choice = choice
        return choice

    def observe(self, shape: SpecShape, accepted: list[int]) -> None:
        """After a step of `shape` (NONE too): each row's accepted draft count. Every estimate
        decays by one step."""
        for c in self._counts.values():
            c.trials = [t * self.decay for t in c.trials]
            c.hits = [h * self.decay for h in c.hits]
        self.steps_by_shape[shape] = self.steps_by_shape.get(shape, 0) + 1
        if shape.is_none:
            return
        c = self._counts.setdefault(self._key(shape), _Counts())
        c.grow(shape.num_steps)
        for a in accepted:
            for d in range(min(a + 1, shape.num_steps)):  # reached depth d, so tried depth d + 1
                c.trials[d] += 1.0
                if a > d:
                    c.hits[d] += 1.0

    def observe_time(self, shape: SpecShape, batch_size: int, seconds: float) -> None:
        """The measured time of a step of `shape` at this batch size (decode phase, host included)."""
        if not self.online_costs or batch_size > self.buckets[-1]:
            return
        bucket = bucket_for(batch_size, self.buckets)
        gap = seconds - self.base_costs_s[(shape, bucket)]
        old = self.offset_s.get(bucket)
        self.offset_s[bucket] = gap if old is None else old + self.cost_smoothing * (gap - old)

    def crossover_batch(self) -> int | None:
        """The smallest bucket at which the policy would choose NONE now, None if it never would."""
        for b in self.buckets:
            tps = self.throughputs(b)
            if all(tps[s] <= tps[NONE] * (1.0 + self.margin) for s in self.shapes if not s.is_none):
                return b
        return None

    def _deepest(self, key: str) -> SpecShape:
        return max((s for s in self.shapes if not s.is_none and self._key(s) == key),
                   key=lambda s: s.num_steps)

    def snapshot(self) -> dict:
        """What /metrics and the logs show: the last choice, per-depth acceptance (chains and each
        tree), expected tokens per step per shape and how many steps each shape ran."""
        return {
            "shape": (self.last_choice or NONE).label,
            "acceptance_rates": {key: [round(r, 4) for r in self.acceptance_rates(self._deepest(key))]
                                 for key in self._counts},
            "expected_tokens": {s.label: round(self.expected_tokens(s), 4) for s in self.shapes},
            "steps": {s.label: n for s, n in self.steps_by_shape.items()},
            "crossover_batch": self.crossover_batch(),
        }
