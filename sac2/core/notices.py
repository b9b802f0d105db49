"""What sac2 tells its user beyond return values, as state: warnings given once per op, the forward counter, and
the checkpointed blocks that ran eagerly under torch.compile.

The texts themselves live in ``sac2.messages``.
"""

from __future__ import annotations

import threading
import warnings

from sac2 import _compat, messages
from sac2.core.decisions import op_name

__all__ = [
    "warn_once", "count_forward", "forward_count", "EagerFallbackWarning", "fell_back", "forward_entered",
    "forward_exited",
]

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


class EagerFallbackWarning(UserWarning):
    """A checkpointed block ran eagerly while ``torch.compile`` compiled the code calling it.

    dynamo could not trace the checkpoint (a graph break inside it), so the block runs outside the compiled graph,
    on the eager frame, recompute included; stock torch does the same silently. The warning names the block and
    dynamo's last graph break. Make it an error with the warnings filter:
    ``warnings.simplefilter("error", sac2.EagerFallbackWarning)`` (or ``-W error::sac2.EagerFallbackWarning``).
    """


class _Unreported(threading.local):
    """Per thread: for each forward context of sac2's entered eagerly inside a compile region and not yet left,
    whether its block is still unreported (True until a frame reports it by name)."""

    def __init__(self) -> None:
        self.stack: list[bool] = []


_unreported = _Unreported()


def fell_back(block: object) -> None:
    """Warn that the checkpointed ``block`` (the function or module checkpointed) runs its forward eagerly inside a
    torch.compile region: dynamo broke the graph at its checkpoint. Reports the innermost pending forward context's
    block (``forward_entered``), so that it does not warn again without the name."""
    stack = _unreported.stack
    if stack:
        stack[-1] = False
    warnings.warn(
        messages.eager_fallback(messages.block_label(block), _compat.last_graph_break()), EagerFallbackWarning,
        stacklevel=3,
    )


def forward_entered() -> bool:
    """A forward context of sac2's (its selective modes, its region contexts) is entered eagerly: whether it is inside a
    torch.compile region, in which case it is pending until ``forward_exited`` (every caller of this that got True
    calls it)."""
    if not _compat.in_compile_region():
        return False
    _unreported.stack.append(True)
    return True


def forward_exited(completed: bool) -> None:
    """The pending forward context is left (``completed``: its forward returned). If no frame reported its block
    (torch's own frame ran it: torch's ``checkpoint`` called with sac2's ``context_fn``), warn without the name."""
    if _unreported.stack.pop() and completed:
        warnings.warn(
            messages.eager_fallback(None, _compat.last_graph_break()), EagerFallbackWarning, stacklevel=3
        )
