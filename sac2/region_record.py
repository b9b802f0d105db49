"""Region calls in the record, and selective checkpointing with no dispatch mode for region-only policies.

A region call is one entry of the record, decided before it runs. Saved, it runs with its backward state kept for
real (but what recompute rebuilds from its inputs: ``sac2.region_saves``) and its outputs recorded; in recompute
it is served (outputs, writes, generator) and its body does not run. Recomputed, it runs under the checkpoint like
any code and runs once more in recompute. ``record_region`` and ``replay_region`` do this for both sac2 modes and
for the dispatch-free contexts below.

A policy that can only ever save regions (a save list of ``sac2.Region``s) needs no per-op dispatch at all:
``RegionForward``/``RegionReplay`` are plain context managers that only regions talk to, so ops between
regions run at full eager speed. What sac2 checks per op (op-level divergence, writes through other aliases) is
then checked per region: the sequence of regions, their outputs' versions, what they wrote, their RNG.
"""

from __future__ import annotations

import threading
from types import TracebackType
from typing import TYPE_CHECKING, Any

from sac2 import _compat, messages, region_saves, writes
from sac2.answers import SaveList, op_name
from sac2.draws import rng_before, rng_moved
from sac2.invariants import InternalError
from sac2.keys import PolicyOp, Region
from sac2.notices import count_forward, warn_once
from sac2.record import Record
from sac2.region_call import RegionCall
from sac2.saved import Saved

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = ["record_region", "replay_region", "RegionForward", "RegionReplay", "region_only", "active"]


def record_region(record: Record, call: RegionCall, save: bool, offload: bool, keep_inputs: bool = False) -> Any:
    """Run a region call in forward and append its entry to ``record``: its key, or a ``Saved`` entry.
    ``keep_inputs``: the policy's (``SaveList.keep_inputs``); saved, the region keeps its inputs for real."""
    key, args, kwargs = call.key, call.args, call.kwargs
    if not save:
        out = call.run()
        record.log.append(key)
        return out
    before = writes.tensor_versions(args, kwargs)
    rng = None
    if not call.pure:  # a matmul or Linear on plain tensors draws nothing: no generator state to read
        with _compat.no_modes():
            rng = rng_before(True, args, kwargs)
    forward = record.region_forward
    if forward is None:  # both forward contexts start it on entry
        raise InternalError(messages.internal_error(messages.NOT_IN_FORWARD))
    out, rebuilt = region_saves.run_saved(call, before, forward, keep_inputs)
    entry = Saved(key)
    entry.rebuilt = rebuilt
    written = [] if call.pure else writes.writes_of(key, args, kwargs, out, before)  # a pure call writes nothing
    entry.keep_region(out, written)
    if rng is not None:
        with _compat.no_modes():
            entry.rng = rng_moved(rng)  # recompute skips the region: skip the numbers it drew, too
    if written is None:
        warn_once("unseen-writes", key, messages.unseen_writes(op_name(key)))
    record.add_region(entry, out, offload)
    return out


def replay_region(record: Record, i: int, call: RegionCall) -> Any:
    """The region call at position ``i`` of recompute: serve what forward saved, else run it."""
    key, args, kwargs = call.key, call.args, call.kwargs
    log = record.log
    entry = log[i] if i < len(log) else None
    if entry is key:
        return call.run()
    if type(entry) is not Saved or entry.key is not key:
        ran = record.describe(i) if entry is not None else f"only {len(log)} ops"
        raise RuntimeError(messages.region_diverged(i, ran, key.name))
    if entry.unseen_writes:
        return region_saves.rerun(entry, call)  # forward kept its backward state (but what it rebuilds)
    if entry.modified():
        warn_once("modified-after-region", key, messages.stale_after_region(record.describe(i)))
        return region_saves.rerun(entry, call)
    rebuilt: region_saves.Rebuilt | None = entry.rebuilt
    grad_was = _compat.set_grad_enabled(False)  # a region runs above autograd and the modes
    try:
        with _compat.no_modes():
            # First what recompute rebuilds: the checkpoint may stop recomputing once the last one is back.
            if rebuilt is None or region_saves.pack_rebuilt(rebuilt, writes.tensor_args(args, kwargs)):
                return record.serve(i, args, kwargs)
    finally:
        _compat.set_grad_enabled(grad_was)
    return region_saves.rerun(entry, call)  # an input came back with another layout: run the body again


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

    def __enter__(self) -> Self:
        count_forward()
        self.record.start_forward(self.saved_tensors_hooks)
        return super().__enter__()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        super().__exit__(exc_type, exc, tb)
        if exc_type is None:
            self.record.end_forward(self.saved_tensors_hooks)

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
            raise RuntimeError(messages.regions_ended_early(cursor, n, self.record.describe(cursor)))


def region_only(policy: object) -> SaveList | None:
    """The policy as a save list if it can only ever save ``sac2.region`` calls, else None.

    That is a save list of ``sac2.Region``s while compiled code does not run as ``inductor_compiled_code``
    (``wrap_inductor_compiled_regions`` off): then no op but a ``sac2.region`` call can match a ``Region``.
    """
    if type(policy) is SaveList and policy.ops and all(type(op) is Region for op in policy.ops):
        if not _compat.compiled_regions_wrapped():
            return policy
    return None
