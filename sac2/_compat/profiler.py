"""The profiler's memory events (``sac2.measure.memory`` measures CPU memory from them).

Removable when torch keeps allocator statistics on CPU (``memory_allocated`` for the CPU allocator).
"""

from __future__ import annotations

import torch

from sac2 import messages
from sac2.messages.internal import InternalError

__all__ = ["allocation_sizes"]


def allocation_sizes(prof: torch.profiler.profile) -> list[int]:
    """Signed sizes of the allocations (+) and frees (-) a finished ``profile_memory=True`` profiler recorded,
    in time order.

    Removable: the CPU allocator keeps statistics (``memory_allocated`` on CPU).
    """
    results = prof.profiler.kineto_results if prof.profiler is not None else None
    if results is None:
        raise InternalError(messages.internal_error(messages.PROFILER_NOT_RUN))
    events = [e for e in results.events() if e.name() == "[memory]"]
    events.sort(key=lambda e: e.start_ns())
    return [e.nbytes() for e in events]  # type: ignore[attr-defined]  # torch's _KinetoEvent stub lacks nbytes
