"""Selective checkpointing with no dispatch mode, for region-only policies.

A policy that can only ever save regions (a save list of ``sac2.Region``s) needs no per-op dispatch at all:
``RegionForward``/``RegionReplay`` are plain context managers that only regions talk to, so ops between
regions run at full eager speed. They play the role the dispatch modes play for other policies (the record side
of a region call is ``sac2.record.regions``'s). What sac2 checks per op (op-level divergence, writes through other
aliases) is then checked per region: the sequence of regions, their outputs' versions, what they wrote, their RNG.
"""

from __future__ import annotations

import threading
from types import TracebackType
from typing import TYPE_CHECKING, Any

from sac2 import _compat, messages
from sac2.core.decisions import SaveList
from sac2.core.keys import PolicyOp, Region
from sac2.core.notices import count_forward, forward_entered, forward_exited
from sac2.record.record import Record
from sac2.record.region_call import RegionCall
from sac2.record.regions import record_region, replay_region

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = ["RegionForward", "RegionReplay", "region_only", "active"]


_local = threading.local()


def active() -> RegionForward | RegionReplay | None:
    """The innermost dispatch-free context of this thread, or None."""
    stack: list[RegionForward | RegionReplay] | None = getattr(_local, "stack", None)
    return stack[-1] if stack else None


class _Context:
    """Pushed on this thread's stack of dispatch-free contexts while the checkpointed code runs."""

    def __init__(self, record: Record) -> None:
        self.record = record

    def __enter__(self) -> Self:
        stack: list[_Context] | None = getattr(_local, "stack", None)
        if stack is None:
            stack = _local.stack = []
        stack.append(self)
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        _local.stack.remove(self)


class RegionForward(_Context):
    """Forward of a region-only policy: regions ask its save list and are recorded; nothing else is intercepted."""

    def __init__(self, policy: SaveList, record: Record) -> None:
        super().__init__(record)
        self.saves: frozenset[PolicyOp] = policy.ops
        self.keep_inputs = policy.keep_inputs
        #: As ``CachingMode.saved_tensors_hooks``: the user's hooks saved regions go through, or None.
        self.saved_tensors_hooks: _compat.HookPair | None = None
        self.fell_back = False  # entered inside a torch.compile region (``notices.forward_entered``)
        self.ac_graph_id: int | None = None  # set by torch's checkpoint operator when it runs eagerly (eager backend)

    def __enter__(self) -> Self:
        count_forward()
        self.record.start_forward(self.saved_tensors_hooks)
        entered = super().__enter__()
        # Only eager (under torch.compile the pair is dispatch modes), and not torch's checkpoint operator run eagerly
        # (the eager backend), which sets its graph id.
        self.fell_back = self.ac_graph_id is None and forward_entered()
        return entered

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        super().__exit__(exc_type, exc, tb)
        if exc_type is None:
            self.record.end_forward(self.saved_tensors_hooks)
        if self.fell_back:
            self.fell_back = False
            forward_exited(exc_type is None)

    def region(self, call: RegionCall) -> Any:
        return record_region(self.record, call, call.key in self.saves, False, self.keep_inputs)


class RegionReplay(_Context):
    """Recompute of a region-only policy: serves saved regions in order, runs the others, checks the sequence."""

    def __init__(self, record: Record) -> None:
        super().__init__(record)
        self._cursor = 0

    def __enter__(self) -> Self:
        self._cursor = 0
        self.record.start_recompute()
        return super().__enter__()

    def region(self, call: RegionCall) -> Any:
        i = self._cursor
        self._cursor = i + 1
        return replay_region(self.record, i, call)

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        super().__exit__(exc_type, exc, tb)
        self.record.end_recompute()
        cursor, n = self._cursor, len(self.record.log)
        if exc_type is None and cursor < n:
            raise messages.RecomputeDiverged(messages.regions_ended_early(cursor, n, self.record.describe(cursor)))


def region_only(policy: object) -> SaveList | None:
    """The policy as a save list if it can only ever save ``sac2.region`` calls, else None.

    That is a save list of ``sac2.Region``s while compiled code does not run as ``inductor_compiled_code``
    (``wrap_inductor_compiled_regions`` off): then no op but a ``sac2.region`` call can match a ``Region``.
    """
    if type(policy) is SaveList and policy.ops and all(type(op) is Region for op in policy.ops):
        if not _compat.compiled_regions_wrapped():
            return policy
    return None
