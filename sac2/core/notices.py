"""What sac2 tells its user beyond return values, as state: warnings given once per op, and the forward counter.

The texts themselves live in ``sac2.messages``.
"""

from __future__ import annotations

import warnings

from sac2.core.decisions import op_name

__all__ = ["warn_once", "count_forward", "forward_count"]

_warned: set[tuple[str, str]] = set()
_forwards = 0


def warn_once(kind: str, key: object, message: str) -> None:
    """Warn once per (kind of warning, op) in this process."""
    seen = (kind, op_name(key))
    if seen not in _warned:
        _warned.add(seen)
        warnings.warn(message, stacklevel=3)


def count_forward() -> None:
    global _forwards
    _forwards += 1


def forward_count() -> int:
    """How many checkpointed forwards sac2 has run (or traced for torch.compile) in this process: forwards of its
    selective contexts (each counts as it is entered), and full-AC forwards on sac2's frame (``sac2.checkpoint``
    without a ``context_fn``, torch's under ``sac2.install()``). Torch's reentrant frame (``use_reentrant=True``),
    ``sac2.use_torch_frame()`` and compiled full AC (torch's checkpoint operator) have nothing of sac2 in them and
    do not count.

    A check that sac2, not torch's SAC, is doing the work: read it before and after a step.

    Returns:
        The number of such forwards since the process started; it only grows.
    """
    return _forwards
