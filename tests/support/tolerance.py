"""Error bounds for comparing two computations of the same function in floating point, derived
from the dtype and the reduction length instead of guessed per test.

Two implementations that differ only in the order of their float operations (a fused Triton
kernel against torch's ops, a split-K reduction against cuBLAS) each carry (a) the rounding of
every stored intermediate and output to `dtype`, a relative error of at most the unit roundoff
u = eps(dtype) / 2 per rounding, and (b) the accumulation error of a length-K float32 sum, which
for terms of random sign grows like sqrt(K) * u(float32) relative to the sum's scale (Higham,
"Accuracy and Stability of Numerical Algorithms", 2nd ed., section 4.2: the worst case is K * u,
the typical case sqrt(K) * u). Two such computations may differ by

    SAFETY * (roundings * u(dtype) + sqrt(K) * u(accumulator))

with SAFETY = 4 covering the tails (the largest of tens of thousands of elements, and the two
sides' errors adding). bf16 is dominated by its own rounding (2^-8 per store); float32 by the
reduction (K = 14336: 2.9e-5 with two stores).
A gap is measured relative to the reference's norm (or, for a max-abs check, its largest
element), so the bound does not depend on the data's scale.
"""

from __future__ import annotations

import math

import torch

SAFETY = 4.0


def unit_roundoff(dtype: torch.dtype) -> float:
    """Half the gap between 1 and the next representable value: round-to-nearest's largest relative error."""
    return torch.finfo(dtype).eps / 2


def bound(dtype: torch.dtype, reduction: int = 1, roundings: int = 1,
          accumulator: torch.dtype = torch.float32) -> float:
    """The relative error two orderings of the same computation may differ by (module docstring):
    `roundings` stores to `dtype` on the way, the longest reduction `reduction` terms long,
    accumulated in `accumulator`."""
    return SAFETY * (roundings * unit_roundoff(dtype) + math.sqrt(max(reduction, 1)) * unit_roundoff(accumulator))


def relative_gap(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want|| in float64 (NaN anywhere: infinity, never a pass)."""
    got, want = got.double(), want.double()
    if not (torch.isfinite(got).all() and torch.isfinite(want).all()):
        return math.inf
    return ((got - want).norm() / want.norm().clamp_min(torch.finfo(torch.float64).tiny)).item()


def max_gap(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want| in float64 (NaN anywhere: infinity)."""
    got, want = got.double(), want.double()
    if not (torch.isfinite(got).all() and torch.isfinite(want).all()):
        return math.inf
    return ((got - want).abs().max() / want.abs().max().clamp_min(torch.finfo(torch.float64).tiny)).item()
