"""Which saved entries hold which storage while a checkpointed forward runs, so that a later write makes them stale.

Any write into a storage a saved entry holds (an in-place op, ``out=``, a HOP or Triton kernel, through any alias:
a view, a factory op's Python-side tensor, matmul's ``_unsafe_view``) makes the entry stale, so it is recomputed
instead of served. The lookup is one dict access per written tensor: flat in the length of the region. Writes after
the forward are seen through version counters, which every served alias shares (``sac2.saved``); what a recompute
itself does to a served alias (an in-place view op, replayed) is not such a write.
"""

from __future__ import annotations

from typing import Iterable

import torch

from sac2 import _compat
from sac2.saved import Saved

__all__ = ["StorageTracker"]

Tensor = torch.Tensor


class StorageTracker(dict[int | None, Saved | list[Saved]]):
    """Storage id -> the saved entry holding it (a list when several do).

    A dict itself, so that ``if tracker:``, which the forward asks per op (nothing to track before the first save),
    costs a dict's truth test and no Python call. Looked up with None too (a wrapper subclass's storage), which is
    never stored.
    """

    __slots__ = ()

    def track(self, entry: Saved) -> None:
        """Watch the storages ``entry`` holds for later writes in this forward."""
        for t in entry.tensors:
            k = _compat.storage_id(t)
            if k is not None:
                hit = self.get(k)
                if hit is None:
                    self[k] = entry
                elif type(hit) is Saved:
                    if hit is not entry:
                        self[k] = [hit, entry]
                elif hit[-1] is not entry:
                    hit.append(entry)

    def wrote(self, tensors: Iterable[Tensor]) -> None:
        """An op of the forward wrote into ``tensors``: saved entries holding their storages are stale."""
        get = self.get
        for t in tensors:
            hit = get(_compat.storage_id(t))
            if type(hit) is Saved:
                hit.mark_stale()
            elif hit is not None:
                for entry in hit:
                    entry.mark_stale()

    def holders(self, t: Tensor) -> list[Saved]:
        """The saved entries holding ``t``'s storage."""
        hit = self.get(_compat.storage_id(t))
        return [hit] if type(hit) is Saved else (hit or [])

    def stop(self) -> None:
        """The forward ended: track nothing more, and let go of the entries."""
        self.clear()
