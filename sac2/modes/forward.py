"""sac2's two TorchDispatchModes: ``CachingMode`` (here) records the forward, ``ReplayMode``
(``sac2.modes.replay``) replays it in recompute; ``SacMode`` is what they share.

``CachingMode`` runs each op, asks the policy about it, and records it (``sac2.record.record``): its key to recompute
it, or a ``Saved`` entry to serve it. ``ReplayMode`` walks the same record, serves saved entries, re-runs the
rest, and stops with a precise error the moment recompute diverges from forward. Both per-op paths are a table
lookup (``sac2.core.opinfo``), a list append or an index and an identity check.

Regions (``sac2.region`` calls) reach the modes through ``SacMode.region``; code that runs outside the modes
(``sac2.compiled_region``) first calls ``SacMode.before_unrecorded``. Those two methods are the whole protocol.

Under torch.compile tracing (a proxy, fake or functional mode is active) nothing eager-only runs: the forward
mode tags the traced nodes with the policy and records every op, the replay mode serves it, and the
partitioner decides from the tags, as in torch's SAC.
"""

from __future__ import annotations

from types import TracebackType
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from sac2 import _compat, messages
from sac2.core import keys, writes
from sac2.core.decisions import SAVE_OFFLOAD, CheckpointPolicy, ForwardContext, PolicyFn, SaveList, decide, op_name
from sac2.core.notices import count_forward, forward_entered, forward_exited, warn_once
from sac2.core.opinfo import HOP, IGNORE, KEYED, PLAIN, TABLE, VIEW, OpInfo, info
from sac2.core.rng import rng_before, rng_moved
from sac2.modes import dispatch_flags
from sac2.modes.tracing import Tracer
from sac2.offload import schedule
from sac2.record.record import Record
from sac2.record.regions import RegionCall, record_region
from sac2.record.saved import Saved

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = ["SacMode", "CachingMode"]

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

    def region(self, call: RegionCall) -> Any:
        """A ``sac2.region`` call: one op for the policy, recorded or replayed by ``sac2.record.regions``."""
        raise NotImplementedError

    def before_unrecorded(self) -> None:
        """Code this mode will not see is about to run (``compiled_region``): settle what it must read first."""


class CachingMode(SacMode):
    """Forward: run each op, ask the policy, record it, keep the outputs of saved ops.

    What a subclass may override (``sac2.policies.profile`` does): ``save_list_fast_path``, ``decide`` (one op call's
    answer) and ``region_answer`` (one region call's).
    """

    #: A save list is answered by membership, without calling it per op; a subclass that must see an answer for
    #: every call sets this False.
    save_list_fast_path: ClassVar[bool] = True

    def __init__(self, policy_fn: PolicyFn, record: Record) -> None:
        super().__init__()
        self.policy_fn = policy_fn
        self.record = record
        self._log = record.log  # the per-op paths skip one attribute lookup
        self.ac_graph_id: int | None = None  # set by torch when it traces this region for torch.compile
        #: The user's (pack, unpack) saved-tensor hooks that saved entries go through, or None (set by sac2's
        #: checkpoint for ``respect_saved_tensors_hooks=True``).
        self.saved_tensors_hooks: _compat.HookPair | None = None
        self._save_ops = policy_fn.ops if type(policy_fn) is SaveList and self.save_list_fast_path else None
        #: Whether the policy's saved regions keep their inputs for real (``SaveList.keep_inputs``).
        self.keep_inputs = type(policy_fn) is SaveList and policy_fn.keep_inputs
        self._save_ids = None if self._save_ops is None else frozenset(map(id, self._save_ops))
        #: A save list's ops kept in host memory (``SaveList.offload``); whether the checkpoint's inputs go there too
        #: (read by the frame: ``sac2.frame.entry``).
        self._offload_ops: frozenset[object] = frozenset(getattr(policy_fn, "offload", ()))
        self._offload_ids = frozenset(map(id, self._offload_ops))
        self.offload_inputs = getattr(policy_fn, "offload_inputs", False) is True
        if self._offload_ops or self.offload_inputs:
            schedule.use()
        self._ctx = ForwardContext()
        self._pending: list[Saved] = []  # entries whose versions are read at the next op (after autograd's bump)
        self._policy_error: TypeError | None = None
        self._tracer: Tracer | None = None  # while torch.compile traces this forward
        self._fell_back = False  # entered eagerly inside a torch.compile region (``notices.forward_entered``)

    def __enter__(self) -> Self:
        count_forward()
        self._tracer = Tracer(self) if _compat.tracing_for_compile() else None
        if self._offload_ops or self.offload_inputs:
            if self._tracer is not None:
                warn_once("offload-compiled", "torch.compile", messages.OFFLOAD_UNDER_COMPILE)
            elif not schedule.in_frame():
                warn_once("offload-frame", "torch's frame", messages.OFFLOAD_NEEDS_SAC2_FRAME)
        self.record.start_forward(self.saved_tensors_hooks)
        entered = super().__enter__()
        # Eager, and not torch's checkpoint operator run eagerly (the eager backend), which sets its graph id.
        self._fell_back = self._tracer is None and self.ac_graph_id is None and forward_entered()
        return entered

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
                offload = id(func) in self._offload_ids
            else:
                save, offload = SAVE_OFFLOAD[self.decide(func, op, args, kwargs, out, len(log))]
                if not save:
                    log.append(func)
                    return out
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
            return SAVE_OFFLOAD[self.decide(func, op, args, kwargs, out, len(self._log))]
        save_ops = self._save_ops
        if id(func) in self._save_ids or op.ordered:
            return True, id(func) in self._offload_ids
        if op.kind == KEYED and save_ops is not None:
            region = keys.region_of(func, args)
            return region in save_ops, region in self._offload_ops
        return False, False

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

    def saves_anything(self) -> bool:
        """Whether the forward saved some op or region (the frame asks, ``sac2.frame.contexts.SelectiveForward``)."""
        return self.record.saves_anything()

    def region(self, call: RegionCall) -> Any:
        """A region is decided before it runs (``ctx.op_output`` is None); ``sac2.record.regions`` records it."""
        if self._pending:
            self._flush()
        save, offload = self.region_answer(call)
        return record_region(self.record, call, save, offload, self.keep_inputs)

    def region_answer(self, call: RegionCall) -> tuple[bool, bool]:
        """(save, offload) for one region call: a save list's membership, else the policy's answer."""
        if self._save_ops is not None:
            return call.key in self._save_ops, call.key in self._offload_ops
        return SAVE_OFFLOAD[self.ask(call.key, call.args, call.kwargs, None, len(self._log))]

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
            if self._fell_back:
                self._fell_back = False
                forward_exited(exc_type is None)
        error, self._policy_error = self._policy_error, None
        if error is not None and exc is not error:
            raise error
