"""``InternalError``: what sac2's engine raises when one of its own invariants breaks.

A bare ``assert`` vanishes under ``python -O``, and then a broken invariant turns into a wrong gradient or an
unrelated error far away. The engine checks with ``if ...: raise InternalError(messages.internal_error(...))``
instead: the text says it is sac2's bug and asks for a report.
"""

from __future__ import annotations

__all__ = ["InternalError"]


class InternalError(RuntimeError):
    """A broken invariant of sac2 itself, never a misuse by its caller."""
