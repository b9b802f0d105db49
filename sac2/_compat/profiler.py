"""The profiler's memory events (``sac2.measure.memory`` measures CPU memory from them).

Removable when torch keeps allocator statistics on CPU (``memory_allocated`` for the CPU allocator).
"""

from __future__ import annotations

import torch

from sac2 import messages
from sac2.messages.internal import InternalError

__all__ = ["allocation_sizes"]

_Allocation = torch._C._profiler._ExtraFields_Allocation


def allocation_sizes(prof: torch.profiler.profile) -> list[int]:
    """Signed sizes of the allocations (+) and frees (-) a finished ``profile_memory=True`` profiler recorded,
    in time order, counting a free only where its block was allocated inside the profiled window.

    The CPU allocator reports the free of any block whose size it still remembers, which includes blocks allocated
    under an earlier profiler and garbage the cycle collector happens to release in this window: counted, such a
    free would subtract memory the window never held from what it kept.

    Removable: the CPU allocator keeps statistics (``memory_allocated`` on CPU).
    """
    results = prof.profiler.kineto_results if prof.profiler is not None else None
    if results is None:
        raise InternalError(messages.internal_error(messages.PROFILER_NOT_RUN))
    events: list[tuple[int, int, int]] = []  # (time, address, signed size)
    pending = list(results.experimental_event_tree())
    while pending:
        node = pending.pop()
        pending.extend(node.children)
        fields = node.extra_fields
        if isinstance(fields, _Allocation):
            events.append((node.start_time_ns, fields.ptr, fields.alloc_size))
    events.sort()
    live: set[int] = set()
    sizes: list[int] = []
    for _, address, size in events:
        if size > 0:
            live.add(address)
        elif address in live:
            live.discard(address)
        else:
            continue  # allocated before the window: not this window's to give back
        sizes.append(size)
    return sizes
