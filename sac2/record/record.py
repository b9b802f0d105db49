"""The record one checkpointed forward leaves for its recompute: which ops ran, which are served, in call order.

The record is a plain list, one entry per op in call order: the op's replay key (recompute it) or a ``Saved``
entry (serve it; ``sac2.record.saved`` owns what an entry holds and its lifecycle). The record orders and drives them:
it appends what the forward saved, watches their storages through its ``StorageTracker`` while the forward runs, and at
the end of the forward and around each recompute moves every entry through its lifecycle at once (stale ones recomputed,
offloaded ones handed to offload's schedule, the rest through the user's saved-tensor hooks).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch

from sac2 import _compat, messages
from sac2.core.decisions import op_name
from sac2.core.keys import Key
from sac2.core.notices import warn_once
from sac2.messages.internal import InternalError
from sac2.record import region_saves
from sac2.record.saved import Saved, State

__all__ = ["Record", "StorageTracker"]

Tensor = torch.Tensor
Hooks = _compat.HookPair


class Record:
    """What one forward ran: per op, its key (recompute) or a ``Saved`` entry, in call order.

    ``saved_at`` lists the positions of saved op entries (regions are not in it); while the forward runs,
    ``by_storage`` knows which entries hold each storage (empty, so false, until something is saved).
    ``draws`` maps the position of each recomputed random op that drew from a generator the user passed
    (``generator=g``) to that generator and its state before the op: recompute draws the same numbers from it.
    """

    __slots__ = (
        "log", "saved_at", "by_storage", "track", "wrote", "holders", "packed", "offloaded", "served", "draws",
        "region_forward",
    )

    def __init__(self) -> None:
        self.log: list[Saved | Key] = []
        self.saved_at: list[int] = []
        self.by_storage = StorageTracker()
        # The tracker's own methods, bound once: the forward calls them per saved op and per write, and a Record
        # method passing each call on would cost a Python call more. ``track(entry)`` watches the storages the
        # entry holds; ``wrote(tensors)`` marks the entries holding theirs stale; ``holders(t)`` lists the entries
        # holding ``t``'s storage.
        self.track: Callable[[Saved], None] = self.by_storage.track
        self.wrote: Callable[[Iterable[Tensor]], None] = self.by_storage.wrote
        self.holders: Callable[[Tensor], list[Saved]] = self.by_storage.holders
        self.packed = False  # some entries are held by the user's saved-tensor hooks
        self.offloaded: list[Saved] = []  # entries answered CPU_OFFLOAD
        self.served: list[Saved] = []  # entries this recompute served and keeps for another
        self.draws: dict[int, tuple[torch.Generator, Tensor]] = {}
        #: While the forward runs, what its saved regions share (``sac2.record.region_saves.Forward``, which
        #: ``sac2.record.regions`` alone fills); None otherwise.
        self.region_forward: region_saves.Forward | None = None

    def start_forward(self, hooks: Hooks | None) -> None:
        """The forward starts; ``hooks``: the user's saved-tensor hooks what it saves goes through, or None (then
        what saved regions return stays on its device until backward)."""
        self.region_forward = region_saves.Forward(keep_outputs=hooks is None)

    def saves_anything(self) -> bool:
        """Whether the forward saved some op or region."""
        return any(type(e) is Saved for e in self.log)

    def add(self, entry: Saved, offloaded: bool = False) -> None:
        """Append a saved op (``offloaded``: answered CPU_OFFLOAD)."""
        if offloaded:
            self.offload_at_end(entry)
        self.saved_at.append(len(self.log))
        self.log.append(entry)

    def offload_at_end(self, entry: Saved) -> None:
        """``entry`` (an op's or a region's, answered CPU_OFFLOAD) moves to the host when the forward ends."""
        entry.offload_at_end()
        self.offloaded.append(entry)

    def key_at(self, i: int) -> Key:
        e = self.log[i]
        return e.key if type(e) is Saved else e

    def describe(self, i: int) -> str:
        """``aten.mm.default (call 2 of that op, op 7 of the region)``: how errors name a position."""
        key = self.key_at(i)
        nth = sum(1 for j in range(i) if self.key_at(j) is key)
        return f"{op_name(key)} (call {nth} of that op, op {i} of the region)"

    # --- the end of forward, the start and end of each recompute ---------------------------------------------
    def stop_tracking(self) -> None:
        """The forward ended: later writes are seen through version counters."""
        self.by_storage.stop()  # in place: ``track``, ``wrote`` and ``holders`` are bound to it

    def end_forward(self, hooks: Hooks | None) -> None:
        """Recompute the saved outputs a later op wrote into (warned once), move offloaded entries to the host,
        and hand the rest to the user's saved-tensor hooks (``respect_saved_tensors_hooks=True``)."""
        self.region_forward = None
        kept = []
        for i in self.saved_at:
            entry = self.log[i]
            if type(entry) is not Saved:
                raise InternalError(messages.internal_error(messages.NOT_SAVED))
            if entry.modified():
                stale = messages.stale_in_forward(self.describe(i), bool(entry.writes))
                warn_once("modified-in-forward", entry.key, stale)
                entry.mark_stale()
                self.log[i] = entry.key
            else:
                kept.append(i)
        self.saved_at = kept
        for entry in self.offloaded:
            if entry.state is not State.STALE:
                entry.to_host()
        self.offloaded = [e for e in self.offloaded if e.state is State.ON_HOST]
        if hooks is not None:
            held = State.HELD  # not ON_HOST (the host copies are sac2's), nor RERUN (a region run again)
            with _compat.no_modes(), torch.no_grad():  # the hooks' own ops are not the program's
                for e in self.log:
                    if type(e) is Saved and e.state is held:
                        e.pack(hooks)
            self.packed = True

    def start_recompute(self) -> None:
        """Before each recompute: take back what the hooks hold (offloaded entries come back by offload's schedule,
        ``sac2.offload.schedule``, as backward reaches their block)."""
        if self.packed:
            packed = State.PACKED
            with _compat.no_modes(), torch.no_grad():  # the hooks' own ops are not the program's
                for e in self.log:
                    if type(e) is Saved and e.state is packed:
                        e.unpack()

    def serve(self, i: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Serve the entry at position ``i``: restore what it wrote and moved, return its outputs. While the
        backward keeps its graph another recompute serves it again; otherwise the record forgets it, so its memory
        goes with the backward's own references. A region is never forgotten: run again in a later recompute (a
        backward through another output), it would save for backward what the forward kept for it."""
        entry = self.log[i]
        if type(entry) is not Saved:
            raise InternalError(messages.internal_error(messages.NOT_SAVED))
        keep = entry.requires_grad is not None or _compat.backward_keeps_graph()
        entry.restore(args, kwargs, final=not keep)
        if keep:
            out = entry.serve(args, kwargs)
            entry.release()
            self.served.append(entry)
            return out
        self.log[i] = entry.key  # a later recompute would run the op again
        if entry.state is State.ON_HOST:
            # Forgotten here too: what is handed over becomes an output of the recompute, whose graph backward never
            # runs; kept in this list it would hold that graph, whose saved-tensor hooks hold this record's frame,
            # a cycle through autograd that the garbage collector cannot see (host and device copies leaked).
            self.offloaded.remove(entry)
        return entry.hand_over(args, kwargs)

    def end_recompute(self) -> None:
        """After each recompute: what the replay itself did to the entries it served and kept (a replayed
        ``squeeze_`` bumps the version counter a served alias shares) is not a modification."""
        for entry in self.served:
            entry.record_versions()
        self.served = []


class StorageTracker(dict[int | None, Saved | list[Saved]]):
    """Storage id -> the saved entry holding it (a list when several do): which saved entries hold which storage
    while a checkpointed forward runs, so that a later write makes them stale.

    Any write into a storage a saved entry holds (an in-place op, ``out=``, a HOP or Triton kernel, through any
    alias: a view, a factory op's Python-side tensor, matmul's ``_unsafe_view``) makes the entry stale, so it is
    recomputed instead of served. The lookup is one dict access per written tensor: flat in the length of the
    region. Writes after the forward are seen through version counters, which every served alias shares
    (``sac2.record.saved``); what a recompute itself does to a served alias (an in-place view op, replayed) is not
    such a write.

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
