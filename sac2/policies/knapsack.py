"""The 0/1 knapsack that picks what to save: most recompute avoided within a byte budget.

Items are byte sizes (weights) and recompute costs (values). ``solve`` is exact by dynamic programming over
bytes when the table fits (weights divided by their common divisor); otherwise it runs the same DP with weights
rounded *up* to buckets, so the answer never exceeds the budget, then fills what rounding left unused. Greedy by
value per byte is only the fallback for instances too large for any table, and the solution says which it was.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from sac2 import messages

__all__ = ["Solution", "solve"]

#: Largest DP table (items x capacity cells) built; 32M one-byte cells.
MAX_CELLS = 1 << 25
#: Fewest capacity buckets worth a DP; with fewer, rounding would cost more than greedy loses.
MIN_BUCKETS = 64


@dataclass(frozen=True)
class Solution:
    """Chosen item indices, their total weight and value, and how they were found.

    ``method`` is ``"exact"``, ``"dp (bytes in buckets of N)"`` or ``"greedy (fallback)"``.
    """

    chosen: frozenset[int]
    weight: int
    value: float
    method: str


def solve(weights: Sequence[int], values: Sequence[float], capacity: int) -> Solution:
    """Indices maximising the summed value with summed weight at most ``capacity`` (weights >= 0)."""
    if capacity < 0:
        raise ValueError(messages.knapsack_negative_capacity(capacity))
    if any(w < 0 for w in weights) or any(v < 0 for v in values):
        raise ValueError(messages.KNAPSACK_NEGATIVE_ITEMS)
    free = [i for i, w in enumerate(weights) if w == 0 and values[i] > 0]
    items = [i for i, w in enumerate(weights) if 0 < w <= capacity and values[i] > 0]
    g = math.gcd(*(weights[i] for i in items)) if items else 1
    cells = len(items) * (capacity // g + 1)
    if cells <= MAX_CELLS:
        picked = _dp([weights[i] // g for i in items], [values[i] for i in items], capacity // g)
        method = "exact"
    else:
        buckets = MAX_CELLS // max(len(items), 1) - 1
        if buckets < MIN_BUCKETS:
            return _finish(weights, values, free + _greedy(weights, values, items, capacity), "greedy (fallback)")
        q = -(-capacity // buckets)
        picked = _dp([-(-weights[i] // q) for i in items], [values[i] for i in items], capacity // q)
        method = f"dp (bytes in buckets of {q})"
    chosen = [items[j] for j in picked]
    rest = [i for i in items if i not in set(chosen)]
    used = sum(weights[i] for i in chosen)
    chosen += _greedy(weights, values, rest, capacity - used)
    return _finish(weights, values, free + chosen, method)


def _dp(weights: list[int], values: list[float], capacity: int) -> list[int]:
    """Exact 0/1 knapsack over integer weights; returns the chosen positions."""
    import numpy as np  # here, not at the top: sac2 and every policy but a budget need only torch

    best = np.zeros(capacity + 1)
    take = np.zeros((len(weights), capacity + 1), dtype=bool)
    for j, (w, v) in enumerate(zip(weights, values, strict=True)):
        if w > capacity:
            continue
        cand = best[:-w] + v  # from the table before this item: each item at most once
        better = cand > best[w:]
        take[j, w:] = better
        best[w:] = np.where(better, cand, best[w:])
    picked, c = [], capacity
    for j in range(len(weights) - 1, -1, -1):
        if take[j, c]:
            picked.append(j)
            c -= weights[j]
    return picked


def _greedy(weights: Sequence[int], values: Sequence[float], items: list[int], capacity: int) -> list[int]:
    """Highest value per byte first, skipping what no longer fits."""
    chosen = []
    for i in sorted(items, key=lambda i: (-values[i] / weights[i], i)):
        if weights[i] <= capacity:
            chosen.append(i)
            capacity -= weights[i]
    return chosen


def _finish(weights: Sequence[int], values: Sequence[float], chosen: list[int], method: str) -> Solution:
    return Solution(frozenset(chosen), sum(weights[i] for i in chosen), sum(values[i] for i in chosen), method)
