"""An adaptive-speculation policy that chooses shapes in a seeded random order (tests only)."""

from __future__ import annotations

import random

from specdeploy.engine.speculative.adaptive import AdaptivePolicy


class ScriptedPolicy(AdaptivePolicy):
    """Chooses the shapes in a seeded random order, every shape once per round (weights: how
    many times per round): every mix of shapes across steps."""

    def __init__(self, shapes, seed, weights=None):
        super().__init__(shapes, {(s, 1): 1.0 for s in shapes})
        self._rng = random.Random(seed)
        self._round = [s for s, w in zip(self.shapes, weights or [1] * len(self.shapes)) for _ in range(w)]
        self._queue = []
        self.chosen = []

    def choose(self, batch_size):
        if not self._queue:
            self._queue = self._rng.sample(self._round, len(self._round))
        self.chosen.append(self._queue.pop())
        return self.chosen[-1]
