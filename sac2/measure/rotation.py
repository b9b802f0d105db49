"""The order in which side-by-side runs take each step: rotated by one per step, so drift in machine speed (another
job starting, a CPU clocking down) hits every run alike. ``sac2 bench``, ``sac2.advise``, the per-op curve and the
benchmark scripts all interleave their runs this way."""

from __future__ import annotations

__all__ = ["turns"]


def turns(step: int, n: int) -> list[int]:
    """The indices of ``n`` side-by-side runs in the order they take step ``step``: ``step % n`` first."""
    shift = step % n
    return [*range(shift, n), *range(shift)]
