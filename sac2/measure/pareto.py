"""The Pareto front of side-by-side rows: the rows no other row beats on both step time and kept memory."""

from __future__ import annotations

from typing import Sequence

__all__ = ["pareto_front"]


def pareto_front(points: Sequence[tuple[float, float]]) -> list[int]:
    """Indices of the points no other point dominates, in order: ``(a, b)`` dominates ``(c, d)`` when ``a <= c`` and
    ``b <= d`` and one of them is strictly smaller (for the bench: step time and kept memory, both lower is
    better). Equal points do not dominate each other: both are on the front."""
    return [
        i for i, (x, y) in enumerate(points)
        if not any(a <= x and b <= y and (a < x or b < y) for a, b in points)
    ]
