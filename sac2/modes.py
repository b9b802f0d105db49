"""sac2's two TorchDispatchModes: ``CachingMode`` records the forward, ``ReplayMode`` replays it in recompute.

``CachingMode`` runs each op, asks the policy about it, and records it (``sac2.record``): its key to recompute
it, or a ``Saved`` entry to serve it. ``ReplayMode`` walks the same record, serves saved entries, re-runs the
rest, and stops with a precise error the moment recompute diverges from forward. Both per-op paths are a table
lookup (``sac2.opinfo``), a list append or an index and an identity check.

Regions (``sac2.region`` calls) reach the modes through ``SacMode.region``; code that runs outside the modes
(``sac2.compiled_region``) first calls ``SacMode.before_unrecorded``. Those two methods are the whole protocol.

Under torch.compile tracing (a proxy, fake or functional mode is active) nothing eager-only runs: the forward
mode tags the traced nodes with the policy and records every op, the replay mode serves it, and the
partitioner decides from the tags, as in torch's SAC.
"""

from __future__ import annotations

from types import TracebackType
from typing import TYPE_CHECKING, Any, Callable

import torch

from sac2 import _compat, dispatch_flags, keys, messages, writes
from sac2.answers import OFFLOADING, SAVING, CheckpointPolicy, ForwardContext, PolicyFn, SaveList, decide, op_name
from sac2.draws import rng_before, rng_moved
from sac2.invariants import InternalError
from sac2.notices import count_forward, warn_once
from sac2.opinfo import HOP, IGNORE, KEYED, PLAIN, TABLE, VIEW, OpInfo, info
from sac2.record import Record, Saved
from sac2.region_record import record_region, replay_region
from sac2.tracing import Tracer

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = ["SacMode", "CachingMode", "ReplayMode"]

Tensor = torch.Tensor
_MUST_RECOMPUTE = CheckpointPolicy.MUST_RECOMPUTE
_version = _compat.version
_CAST = _compat.TO_COPY


class SacMode(_compat.TorchDispatchMode):
    """What both modes share: every HOP reaches ``__torch_dispatch__``, compiled code under them still compiles,
    torch's "inside a dispatch mode" flags stay right when threads overlap, and the region protocol."""

    supports_higher_order_operators = True
    _sac2_mode = True  # read by _compat.detach_below_sac2

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True  # what compiled code dispatches is recorded like any op; dynamo need not skip the frame

    def __init_subclass__(cls, **kwargs: Any) -> None:
        _compat.skip_dynamo_in_mode(cls)  # before torch's __init_subclass__, which reads it
        super().__init_subclass__(**kwargs)

    def __enter__(self) -> Self:
        super().__enter__()
        dispatch_flags.sync(+1)  # torch's save/restore of its mode flags breaks when threads overlap
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        super().__exit__(exc_type, exc, tb)
        dispatch_flags.sync(-1)

    def region(
        self,
        key: keys.Region,
        run: Callable[..., Any],
        run_kept: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        """A ``sac2.region`` call: one op for the policy. ``run`` leaves the body's backward state to the
        checkpoint; ``run_kept`` keeps it for real (a saved region never runs in backward)."""
        raise NotImplementedError

    def before_unrecorded(self) -> None:
        """Code this mode will not see is about to run (``compiled_region``): settle what it must read first."""


class CachingMode(SacMode):
    """Forward: run each op, ask the policy, record it, keep the outputs of saved ops."""

    def __init__(self, policy_fn: PolicyFn, record: Record) -> None:
        super().__init__()
        self.policy_fn = policy_fn
        self.record = record
        self._log = record.log  # the per-op paths skip one attribute lookup
        self.ac_graph_id: int | None = None  # set by torch when it traces this region for torch.compile
        #: The user's (pack, unpack) saved-tensor hooks that saved entries go through, or None (set by sac2's
        #: checkpoint for ``respect_saved_tensors_hooks=True``).
        self.saved_tensors_hooks: _compat.HookPair | None = None
        self._save_ops = policy_fn.ops if type(policy_fn) is SaveList else None
        self._save_ids = None if self._save_ops is None else frozenset(map(id, self._save_ops))
        self._ctx = ForwardContext()
        self._pending: list[Saved] = []  # entries whose versions are read at the next op (after autograd's bump)
        self._policy_error: TypeError | None = None
        self._tracer: Tracer | None = None  # while torch.compile traces this forward

    def __enter__(self) -> Self:
        count_forward()
        self._tracer = Tracer(self) if _compat.tracing_for_compile() else None
        return super().__enter__()

    def __torch_dispatch__(
        self,
        func: _compat.Op,
        types: tuple[type, ...],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if kwargs is None:
            kwargs = {}
        if self._pending:
            self._flush()
        op = TABLE.get(id(func)) or info(func)
        if op.plain and self._tracer is None:
            # The common case, kept short: a functional op that draws nothing, has no side effect, writes nothing.
            out = op.call(*args, **kwargs)
            log = self._log
            if self._save_ids is not None:
                if id(func) not in self._save_ids:
                    log.append(func)
                    return out
                offload = False
            else:
                policy = self.decide(func, op, args, kwargs, out, len(log))
                if policy not in SAVING:
                    log.append(func)
                    return out
                offload = policy in OFFLOADING
            entry = self._save(func, func, op, args, kwargs, out, None)
            if entry is not None:
                self.record.add(entry, offload)
            else:
                log.append(func)
            return out
        return self._dispatch(func, op, args, kwargs)

    def _dispatch(self, func: _compat.Op, op: OpInfo, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Every other op: views, in-place and ``out=`` ops, random ops, HOPs, keyed ops, and all ops while
        tracing."""
        kind = op.kind
        if self._tracer is not None:
            return self._tracer.op(func, op, args, kwargs)
        if kind == IGNORE:
            return op.call(*args, **kwargs)
        if kind == VIEW:
            return self._view(func, op, args, kwargs)
        record = self.record
        rng = rng_before(op.random or kind >= HOP, args, kwargs)  # a HOP may draw random numbers inside
        key: keys.Key
        if kind == PLAIN:
            before = None
            out = op.call(*args, **kwargs)
            key = func
            if record.by_storage:
                self._track_op(op, args, kwargs, out)
        else:
            before = writes.tensor_versions(args, kwargs)
            out = func(*args, **kwargs)
            key = func if kind == HOP else keys.op_key(func, args)
            if record.by_storage:
                record.wrote([t for t, v in before if _version(t) != v])
                record.wrote(writes.unversioned_writes(func, kwargs))
        log = self._log
        if rng is not None and kwargs.get("generator") is not None:
            # Recompute draws again from the user's generator from this state (a saved op too: it is recomputed
            # when a later write makes it stale).
            record.draws[len(log)] = rng
        save, offload = self._answer(func, op, args, kwargs, out)
        if save:
            entry = self._save(key, func, op, args, kwargs, out, before)
            if entry is not None:
                entry.rng = rng_moved(rng)
                record.add(entry, offload)
                return out
        log.append(key)
        return out

    def _view(self, func: _compat.Op, op: OpInfo, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """A view op: never saved (re-running a view is free and right); the policy is still asked."""
        out = op.call(*args, **kwargs)
        if self.record.by_storage:
            self._track_op(op, args, kwargs, out)
        if self._save_ids is None:
            self.decide(func, op, args, kwargs, out, len(self._log))
        self._log.append(func)
        return out

    def _answer(
        self, func: _compat.Op, op: OpInfo, args: tuple[Any, ...], kwargs: dict[str, Any], out: object
    ) -> tuple[bool, bool]:
        """(save, offload) for one call on ``_dispatch``'s path: a save list's membership (a keyed op by the region
        it runs; an ordered side effect always), else the policy's answer."""
        if self._save_ids is None:
            policy = self.decide(func, op, args, kwargs, out, len(self._log))
            return policy in SAVING, policy in OFFLOADING
        save_ops = self._save_ops
        if id(func) in self._save_ids or op.ordered:
            return True, False
        return op.kind == KEYED and save_ops is not None and keys.region_of(func, args) in save_ops, False

    def _track_op(
        self, op: OpInfo, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any
    ) -> None:
        """Tell the record what an op did to storages its saved entries hold."""
        record = self.record
        if op.hidden_alias:  # shares its input's storage but not its version counter
            for entry in record.holders(args[0]):
                entry.watch(out)
        elif op.kind == VIEW:
            if op.writes:  # an in-place view op bumps its argument's version without touching its data
                self._pending.extend(record.holders(args[0]))
        elif op.writes:
            record.wrote([t for _, t in writes.expand(args, kwargs, op.writes)])

    def ask(
        self, key: keys.PolicyOp, args: tuple[Any, ...], kwargs: dict[str, Any], out: object, call_index: int
    ) -> CheckpointPolicy:
        """The policy's answer about ``key`` (an op, or a ``Region`` with ``out`` None), as a decision."""
        ctx = self._ctx
        ctx.op_output = out
        try:
            return decide(self.policy_fn(ctx, key, *args, **kwargs), key, call_index)
        except TypeError as error:
            # Tensor operators (``a * b``) turn a TypeError raised inside them into "unsupported operand
            # type(s)", so ``__exit__`` raises it again if it was lost.
            self._policy_error = error
            raise

    def decide(
        self, func: _compat.Op, op: OpInfo, args: tuple[Any, ...], kwargs: dict[str, Any], out: object, call_index: int
    ) -> CheckpointPolicy:
        """The answer for one op call; ordered side effects are saved unless the policy demands recompute (they
        must not run twice)."""
        policy = self.ask(func, args, kwargs, out, call_index)
        if op.ordered and policy is not _MUST_RECOMPUTE:
            return CheckpointPolicy.MUST_SAVE
        return policy

    def _save(
        self,
        key: keys.Key,
        func: _compat.Op,
        op: OpInfo,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        out: object,
        before: list[tuple[Tensor, int]] | None,
    ) -> Saved | None:
        entry = Saved(key)
        if before is None and type(out) is Tensor and not op.writes:
            entry.keep_output(out)  # the common case (a functional aten op with one output)
        else:
            written = writes.writes_of(func, args, kwargs, out, before, op.writes)
            if written is None:
                warn_once("unseen-writes", key, messages.unseen_writes(op_name(key)))
                return None
            for _, t in written:
                if _compat.has_internal_overlap(t):
                    warn_once("overlap", key, messages.overlapping_write(op_name(key)))
                    return None
            entry.keep(out, written)
        self.record.track(entry)
        # In-place ops get their version bump from autograd after this returns: read versions at the next op.
        self._pending.append(entry)
        return entry

    def _flush(self) -> None:
        for entry in self._pending:
            entry.record_versions()
        self._pending.clear()

    def before_unrecorded(self) -> None:
        if self._pending:
            self._flush()  # versions read now let in-place writes in the unrecorded code show

    def region(
        self,
        key: keys.Region,
        run: Callable[..., Any],
        run_kept: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        """A region is decided before it runs (``ctx.op_output`` is None); ``sac2.region_record`` records it."""
        if self._pending:
            self._flush()
        if self._save_ops is not None:
            save, offload = key in self._save_ops, False
        else:
            policy = self.ask(key, args, kwargs, None, len(self._log))
            save, offload = policy in SAVING, policy in OFFLOADING
        return record_region(self.record, key, save, offload, run, run_kept, args, kwargs)

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._ctx.op_output = None  # policies may keep ctx as a per-forward key; it must not keep a tensor alive
        record = self.record
        try:
            if self._pending:
                self._flush()
            record.stop_tracking()
            if exc_type is None and self._tracer is None:
                record.end_forward(self.saved_tensors_hooks)
        finally:
            super().__exit__(exc_type, exc, tb)
        error, self._policy_error = self._policy_error, None
        if error is not None and exc is not error:
            raise error


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
            raise RuntimeError(messages.recompute_ran_past_forward(op_name(key), i, len(self._log))) from None
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
        raise RuntimeError(messages.recompute_diverged(i, self.record.describe(i), op_name(key), advice))

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

    def region(
        self,
        key: keys.Region,
        run: Callable[..., Any],
        run_kept: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        """Serve what forward saved, else run the region (its one run in backward)."""
        i = self._cursor
        self._cursor = i + 1
        return replay_region(self.record, i, key, run, run_kept, args, kwargs)

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
            raise RuntimeError(messages.recompute_ended_early(cursor, n, self.record.describe(cursor)))
