"""``ReplayMode``: sac2's recompute mode. It walks the record the forward's ``CachingMode`` left, serves saved
entries, re-runs the rest, and stops with a precise error the moment recompute diverges from forward (its rules:
``ReplayMode._realign``). Early stop asks it which op to finish first (``finish_op``).
"""

from __future__ import annotations

from types import TracebackType
from typing import TYPE_CHECKING, Any, Callable

import torch

from sac2 import _compat, messages
from sac2.core import keys
from sac2.core.decisions import op_name
from sac2.core.opinfo import IGNORE, KEYED, TABLE, VIEW, OpInfo, info
from sac2.core.rng import rng_before
from sac2.messages.internal import InternalError
from sac2.modes.forward import SacMode
from sac2.record.record import Record
from sac2.record.regions import RegionCall, replay_region
from sac2.record.saved import Saved

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = ["ReplayMode"]

Tensor = torch.Tensor
_version = _compat.version
_CAST = _compat.TO_COPY


class ReplayMode(SacMode):
    """Recompute: walk the record, serve saved ops, re-run the rest, fail loudly on any divergence."""

    def __init__(self, record: Record, allow_cache_entry_mutation: bool = False) -> None:
        super().__init__()
        self.record = record
        self._log = record.log
        self.allow_cache_entry_mutation = allow_cache_entry_mutation
        self._cursor = 0
        self._stop: Callable[[], BaseException] | None = None
        self._bumped: list[tuple[Tensor, int]] = []  # tensors a replayed in-place view op bumped, with their version

    def __enter__(self) -> Self:
        self._cursor = 0  # each recompute (one per backward, more with retain_graph) replays from the start
        self._stop = None
        self._bumped = []
        super().__enter__()
        self.record.start_recompute()
        return self

    def finish_op(self, stop: Callable[[], BaseException]) -> bool:
        """Early stop, asked by the checkpoint frame when the last tensor the forward saved is saved again. If the
        op saving it writes into its arguments, it runs (or is served) first, then ``stop()`` is raised: autograd
        saves an op's inputs before the op runs, and a tensor the op then fills (``rrelu_with_noise``'s noise)
        must be filled. Returns False when the frame should stop at once (as torch's frame always does)."""
        i, n = self._cursor, len(self._log)
        while i < n and self._skippable(i):
            i += 1  # the next op that carries a decision (see _realign)
        if i >= n:
            return False
        entry = self._log[i]
        if type(entry) is Saved:
            writer = bool(entry.writes)
        elif isinstance(entry, _compat.OpOverload):
            writer = bool(info(entry).writes)
        else:
            writer = entry is _compat.TRITON_MUTATION
        if writer:
            self._stop = stop
        return writer

    def __torch_dispatch__(
        self,
        func: _compat.Op,
        types: tuple[type, ...],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if kwargs is None:
            kwargs = {}
        op = TABLE.get(id(func)) or info(func)
        kind = op.kind
        if kind == IGNORE:
            return op.call(*args, **kwargs)
        if self._bumped:
            self._unbump()
        if self._stop is not None and not op.free:  # free ops before the writer early stop waits for run first
            return self._finish(func, op, types, args, kwargs)
        if kind == VIEW and op.writes:
            # An in-place view op (squeeze_, t_) replayed on a served output bumps the version counter that output
            # shares with the forward's tensor, where saved entries (of this record, or of a checkpoint nested in
            # it) watch for modifications after the forward. The forward's run of it is counted there already:
            # the replay's is undone at the next op.
            self._bumped.append((args[0], _version(args[0])))
        key: keys.Key = func if kind != KEYED else keys.op_key(func, args)
        i = self._cursor
        try:
            entry = self._log[i]
        except IndexError:
            if func is _CAST or op.free:
                return op.call(*args, **kwargs)  # rules 2 and 3 (see _realign)
            ran_past = messages.recompute_ran_past_forward(op_name(key), i, len(self._log))
            raise messages.RecomputeDiverged(ran_past) from None
        self._cursor = i + 1
        if entry is key:
            return self._redraw(i, op, args, kwargs) if op.random else op.call(*args, **kwargs)
        if type(entry) is Saved and entry.key is key:
            return self._serve(entry, i, func, args, kwargs)
        return self._realign(i, func, op, key, args, kwargs)

    def _redraw(self, i: int, op: OpInfo, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """A recomputed random op: it draws what it drew in forward. The global generators are replayed by the
        frame (``preserve_rng_state``); a generator the user passed is set to its state before the forward's
        call, and put back after, where the forward left it (where no checkpointing leaves it)."""
        draw = self.record.draws.get(i)
        if draw is None:
            return op.call(*args, **kwargs)
        gen, before = draw
        now = gen.get_state()
        gen.set_state(before)
        try:
            return op.call(*args, **kwargs)
        finally:
            gen.set_state(now)

    def _unbump(self) -> None:
        _compat.set_versions(self._bumped)
        self._bumped = []

    def _finish(
        self, func: _compat.Op, op: OpInfo, types: tuple[type, ...], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """Run (or serve) the op early stop waits for, then stop. A random op's draws do not leak: torch's frame
        would have stopped before it drew."""
        stop, self._stop = self._stop, None
        rng = rng_before(op.random, args, kwargs)
        self.__torch_dispatch__(func, types, args, kwargs)
        if rng is not None:
            rng[0].set_state(rng[1])
        if stop is None:
            raise InternalError(messages.internal_error(messages.NO_STOP_PENDING))
        raise stop()

    def _realign(
        self, i: int, func: _compat.Op, op: OpInfo, key: keys.Key, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """Recompute ran another op than forward's at position ``i``. What may differ, and nothing else:

        1. Every op that carries a decision (saved, recomputed, offloaded, a region, a random op, a write, an
           ordered side effect, an in-place view op) runs in the order forward ran it; anything else is a
           divergence, reported with the op and its position.
        2. Autocast caches the casts of leaf tensors within an autocast block (and recompute in backward may find
           them cached), so forward and recompute may run a different number of ``_to_copy`` casts.
        3. Ops that only re-present their input's values (``OpInfo.free``: views, ``_unsafe_view``, ``clone``)
           may appear, vanish or change order: composites pick among them by strides (a user's saved-tensor hook
           that repacks an input makes ``reshape`` copy) and by the modes active (``FlopCounterMode`` makes
           ``linear`` run ``t`` before ``view``). Their outputs depend only on their inputs, so running them
           where recompute meets them is right.

        An extra cast or free op in recompute runs unrecorded; casts and free ops forward ran that recompute skips
        are passed over (their outputs are not served, which only means recompute computed them)."""
        if func is _CAST or op.free:
            self._cursor = i
            return op.call(*args, **kwargs)
        log, j = self._log, i
        while j < len(log) and self._skippable(j):
            j += 1
        entry = log[j] if j < len(log) else None
        if j > i and entry is key:
            self._cursor = j + 1
            return self._redraw(j, op, args, kwargs) if op.random else op.call(*args, **kwargs)
        if j > i and type(entry) is Saved and entry.key is key:
            self._cursor = j + 1
            return self._serve(entry, j, func, args, kwargs)
        advice = messages.diverged(op_name(self.record.key_at(i)))
        raise messages.RecomputeDiverged(messages.recompute_diverged(i, self.record.describe(i), op_name(key), advice))

    def _skippable(self, j: int) -> bool:
        """Whether recompute may pass over position ``j`` of the record (rules 2 and 3 of ``_realign``)."""
        key = self.record.key_at(j)
        if key is _CAST:
            return True
        op = TABLE.get(id(key))
        return op is not None and op.op is key and op.free

    def _serve(self, entry: Saved, i: int, func: _compat.Op, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if entry.modified():
            if not self.allow_cache_entry_mutation:
                raise RuntimeError(messages.saved_output_modified(self.record.describe(i)))
            return func(*args, **kwargs)
        return self.record.serve(i, args, kwargs)  # below autograd here: restoring records nothing

    def region(self, call: RegionCall) -> Any:
        """Serve what forward saved, else run the region (its one run in backward)."""
        i = self._cursor
        self._cursor = i + 1
        return replay_region(self.record, i, call)

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._bumped:
            self._unbump()
        cursor, n = self._cursor, len(self._log)
        while cursor < n and self._skippable(cursor):
            cursor += 1  # casts and free ops recompute did not run (see _realign)
        self.record.end_recompute()
        super().__exit__(exc_type, exc, tb)
        if exc_type is None and cursor != n:
            raise messages.RecomputeDiverged(messages.recompute_ended_early(cursor, n, self.record.describe(cursor)))
