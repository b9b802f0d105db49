"""sac2's two TorchDispatchModes and the record they share.

``CachingMode`` runs during forward: it records every op in order, asks the policy about each, and keeps the
outputs of the ops the policy saves. ``ReplayMode`` runs during recompute: it walks the same record, serves saved
outputs, re-runs everything else, and stops with a precise error the moment recompute diverges from forward
(another op, an extra call, a missing call). The record is a plain list, one entry per op, so both per-op paths
are a list append or an index and an identity check.

Where stock SAC is silently wrong, these modes are not:
- a saved op that wrote into its arguments has what it wrote copied into the replayed buffers;
- a saved random op advances the generator in recompute as it did in forward;
- a saved output that a later op of the forward modifies in place is recomputed instead (with a one-time
  warning), because what was cached is no longer what the op produced.
- a saved view op is re-run on its replayed input, since its output aliases forward's storage.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable

import torch

from sac2 import _compat, hops
from sac2._compat import TorchDispatchMode, tree_leaves, tree_map
from sac2 import offload as _offload
from sac2.policy import (
    OFFLOADING,
    SAVING,
    CheckpointPolicy,
    SaveList,
    SelectiveCheckpointContext,
    decide,
    is_save,
    op_name,
)

__all__ = ["Record", "CachingMode", "ReplayMode", "Saved"]

Tensor = torch.Tensor
_detach = _compat.detach_keeping_version
_UNSAFE_VIEW = torch.ops.aten._unsafe_view.default
_warned: set[str] = set()

# What kind of op a dispatched func is, cached by id(): OpOverload.__hash__ is Python code and the per-op path
# must stay at one dict lookup. Classified ops are kept alive so their ids stay theirs.
_PLAIN, _VIEW, _IGNORE, _HOP, _KEYED = 0, 1, 2, 3, 4
_kinds: dict[int, int] = {}
_classified: list[Any] = []


def _classify(func: Any) -> int:
    if func in _compat.IGNORED_OPS:
        kind = _IGNORE
    elif func in hops.KEYED_OPS:
        kind = _KEYED
    elif isinstance(func, _compat.OpOverload):
        # A view's output aliases its input: serving forward's alias would tie recompute to forward's storage
        # (wrong gradients once anything writes through it); re-running a view on its replayed input is free.
        kind = _VIEW if func.is_view else _PLAIN
    else:
        kind = _HOP
    _kinds[id(func)] = kind
    _classified.append(func)
    return kind


class _ArgRef:
    """Stands, in a saved output, for an output that is one of the op's own (written) arguments."""

    __slots__ = ("path",)

    def __init__(self, path: hops.Path) -> None:
        self.path = path


class Saved:
    """A saved op in the record: its key, its detached outputs and what it wrote."""

    __slots__ = ("key", "out", "tensors", "versions", "writes", "rng", "offload")

    def __init__(self, key: Any) -> None:
        self.key = key
        self.out: Any = None
        self.tensors: list[Tensor] = []
        self.versions: list[int] | None = None
        self.writes: list[tuple[hops.Path, Tensor]] | None = []  # None: a region that wrote where sac2 cannot see
        self.rng: tuple[torch.Generator, Tensor] | None = None
        self.offload: Any = None  # True while a CPU_OFFLOAD entry's forward runs, then sac2.offload's state

    def record_versions(self) -> None:
        self.versions = [t._version for t in self.tensors]

    def modified(self) -> bool:
        for t, v in zip(self.tensors, self.versions):
            if t._version != v:
                return True
        return False


class Record:
    """What one forward ran: per op, its key (recompute) or a ``Saved`` entry, in call order."""

    __slots__ = ("log", "saved_at")

    def __init__(self) -> None:
        self.log: list[Any] = []
        self.saved_at: list[int] = []

    def key_at(self, i: int) -> Any:
        e = self.log[i]
        return e.key if type(e) is Saved else e

    def describe(self, i: int) -> str:
        """``aten.mm.default (call 2 of that op, op 7 of the region)``: how errors name a position."""
        key = self.key_at(i)
        nth = sum(1 for j in range(i) if self.key_at(j) is key)
        return f"{op_name(key)} (call {nth} of that op, op {i} of the region)"


def _warn_once(key: Any, message: str) -> None:
    name = op_name(key)
    if name not in _warned:
        _warned.add(name)
        warnings.warn(message, stacklevel=3)


class _Sac2Mode(TorchDispatchMode):
    """What both modes share: every HOP reaches ``__torch_dispatch__``, compiled code under them still compiles,
    and torch's "inside a dispatch mode" flags stay right when threads overlap."""

    supports_higher_order_operators = True

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True  # what compiled code dispatches is recorded like any op; dynamo need not skip the frame

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False  # torch would wrap __torch_dispatch__ in a disable frame; _compat.skip_dynamo marks it instead

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        _compat.skip_dynamo(cls.__torch_dispatch__)

    def __enter__(self):
        super().__enter__()
        _compat.sync_dispatch_flags(+1)  # torch's save/restore of its mode flags breaks when threads overlap
        return self

    def __exit__(self, exc_type, exc, tb):
        super().__exit__(exc_type, exc, tb)
        _compat.sync_dispatch_flags(-1)


class CachingMode(_Sac2Mode):
    """Forward: run each op, ask the policy, record it, keep the outputs of saved ops."""

    def __init__(self, policy_fn: Callable, record: Record) -> None:
        super().__init__()
        self.policy_fn = policy_fn
        self.record = record
        self._log = record.log  # the per-op paths skip one attribute lookup
        self.ac_graph_id: int | None = None  # set by torch when it traces this region for torch.compile
        self._save_ops = policy_fn.ops if type(policy_fn) is SaveList else None
        self._save_ids = None if self._save_ops is None else frozenset(map(id, self._save_ops))
        self._ctx = SelectiveCheckpointContext(is_recompute=False)
        self._pending: Saved | None = None
        self._policy_error: TypeError | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if kwargs is None:
            kwargs = {}
        if self._pending is not None:
            self._flush()
        kind = _kinds.get(id(func))
        if kind is None:
            kind = _classify(func)
        if self.ac_graph_id is not None and _compat.tracing_for_compile():
            return self._trace(func, kind, args, kwargs)
        if kind == _IGNORE:
            return func._op(*args, **kwargs)

        if kind <= _VIEW:
            before = None
            out = func._op(*args, **kwargs)  # what OpOverload.__call__ does, minus a Python frame
            key = func
            if func is _UNSAFE_VIEW and self.record.saved_at:
                self._watch_alias(args[0], out)
        else:
            before = hops.tensor_versions(args, kwargs)
            out = func(*args, **kwargs)
            key = func if kind == _HOP else hops.op_key(func, args)
            if self.record.saved_at:
                self._mark_overwritten(hops.unversioned_writes(func, args, kwargs))
        log = self._log
        if self._save_ids is not None:
            save = id(func) in self._save_ids or (kind == _KEYED and hops.region_of(func, args) in self._save_ops)
        else:
            ctx = self._ctx
            ctx.op_output = out
            try:
                value = self.policy_fn(ctx, func, *args, **kwargs)
            except TypeError as error:  # e.g. compose() rejecting a piece's answer: keep it from being lost
                self._policy_error = error
                raise
            if type(value) is CheckpointPolicy:
                save = value in SAVING
            elif type(value) is bool:
                save = value
            else:
                self._bad_policy(value, func, len(log))
        if save and kind != _VIEW:
            entry = self._save(key, func, args, kwargs, out, before)
            if entry is not None:
                if self._save_ids is None and type(value) is CheckpointPolicy and value in OFFLOADING:
                    entry.offload = True
                self.record.saved_at.append(len(log))
                log.append(entry)
                return out
        log.append(key)
        return out

    def _save(self, key, func, args, kwargs, out, before) -> Saved | None:
        entry = Saved(key)
        if before is None and type(out) is Tensor and not hops.schema_writes(func):
            # The common case (a functional aten op with one output), kept short: it is on the per-op path.
            d = _detach(out)
            entry.out = d
            entry.tensors.append(d)
        elif not self._save_general(entry, func, args, kwargs, out, before):
            return None
        if before is not None or hops.is_random(func):
            # A HOP may draw random numbers inside (sac2 cannot see into it): serving it must skip them too.
            entry.rng = _rng_after(out, args, kwargs.get("generator"))
        # In-place ops get their version bump from autograd after this returns: read versions at the next op.
        self._pending = entry
        return entry

    def _save_general(self, entry: Saved, func, args, kwargs, out, before) -> bool:
        """Fill ``entry`` for any op: what it wrote and its outputs; False if sac2 cannot save it safely."""
        writes = hops.writes_of(func, args, kwargs, out, before)
        if writes is None:
            _warn_once(entry.key, _unseen_writes(entry.key))
            return False
        _keep(entry, out, writes)
        return True

    def _bad_policy(self, value: Any, op: Any, call_index: int) -> None:
        """Raise the TypeError for a policy value, remembering it: Tensor operators (``a * b``) turn a TypeError
        raised inside them into "unsupported operand type(s)", so ``__exit__`` raises it again if it was lost.
        TypeErrors the policy raises itself are remembered the same way."""
        try:
            decide(value, op, call_index)
        except TypeError as error:
            self._policy_error = error
            raise

    def _mark_overwritten(self, written: list[Tensor]) -> None:
        """Saved entries whose storage a HOP just wrote without a version bump are stale, like a version change."""
        if not written:
            return
        ptrs = {t.untyped_storage().data_ptr() for t in written}
        for i in self.record.saved_at:
            entry = self.record.log[i]
            if any(t.untyped_storage().data_ptr() in ptrs for t in entry.tensors):
                entry.versions = [-1] * len(entry.tensors)  # modified() now reads True

    def _watch_alias(self, base: Tensor, alias: Tensor) -> None:
        """``_unsafe_view`` (matmul's 3-D @ 2-D result) shares its input's storage but not its version counter: a
        saved entry holding that storage watches the alias too, so a write through it marks the entry stale."""
        ptr = base.untyped_storage().data_ptr()
        for i in self.record.saved_at:
            entry = self.record.log[i]
            if any(t.untyped_storage().data_ptr() == ptr for t in entry.tensors):
                entry.tensors.append(_detach(alias))
                entry.versions.append(alias._version)

    def _flush(self) -> None:
        self._pending.record_versions()
        self._pending = None

    def _trace(self, func, kind, args, kwargs):
        """Under torch.compile tracing: tag the FX nodes with the policy; the partitioner decides from the tags.

        Ignored ops (detach, metadata queries) are tagged PREFER_RECOMPUTE and not recorded, as torch's SAC does.
        """
        log = self.record.log

        def policy_of(out: Any) -> CheckpointPolicy:
            if kind == _IGNORE:
                return CheckpointPolicy.PREFER_RECOMPUTE
            self._ctx.op_output = out
            policy = decide(self.policy_fn(self._ctx, func, *args, **kwargs), func, len(log))
            entry = Saved(func)
            entry.out = tree_map(lambda x: _detach(x) if isinstance(x, Tensor) else x, out)
            entry.versions = []
            log.append(entry)  # while tracing, everything is served from the record, as in torch's SAC
            return policy

        return _compat.tag_traced_nodes(lambda: func(*args, **kwargs), self.ac_graph_id, policy_of)

    def __exit__(self, exc_type, exc, tb):
        self._ctx.op_output = None  # policies may keep ctx as a per-forward key; it must not keep a tensor alive
        try:
            if self._pending is not None:
                self._flush()
            if exc_type is None:
                self._drop_modified()
                _offload.to_host(e for e in map(self.record.log.__getitem__, self.record.saved_at) if e.offload)
        finally:
            super().__exit__(exc_type, exc, tb)
        error, self._policy_error = self._policy_error, None
        if error is not None and exc is not error:
            raise error

    def _region(self, key: hops.Region, run: Callable, run_kept: Callable, args: tuple, kwargs: dict) -> Any:
        """A ``sac2.region`` call, one op for the policy, decided before it runs (``ctx.op_output`` is None).

        Saved: ``run_kept`` keeps what its backward needs, and its outputs are recorded to be served in
        recompute. Recomputed: ``run`` leaves its backward state to the checkpoint, and recompute runs it again.
        """
        if self._pending is not None:
            self._flush()
        log = self.record.log
        if self._save_ops is not None:
            save = key in self._save_ops
        else:
            self._ctx.op_output = None
            value = self.policy_fn(self._ctx, key, *args, **kwargs)
            if type(value) is not CheckpointPolicy and type(value) is not bool:
                self._bad_policy(value, key, len(log))
            save = is_save(decide(value, key, len(log)))
        if not save:
            out = run(*args, **kwargs)
            log.append(key)
            return out
        before = hops.tensor_versions(args, kwargs)
        out = run_kept(*args, **kwargs)
        entry = Saved(key)
        writes = hops.writes_of(key, args, kwargs, out, before)
        _keep(entry, out, writes or [])
        # Which outputs required grad: served ones must too, or recompute saves less than forward did.
        written = {id(t) for _, t in writes or []}
        grads = tuple(t.requires_grad for t in tree_leaves(out) if isinstance(t, Tensor) and id(t) not in written)
        entry.out = (entry.out, grads)
        entry.rng = _rng_after(out, args)  # recompute skips the region: skip the numbers it drew, too
        entry.record_versions()
        if writes is None:
            _warn_once(key, _unseen_writes(key))
            entry.writes = None  # what it wrote is unknown: ReplayMode._region runs it again instead of serving
        log.append(entry)  # not in saved_at: a region modified later is re-run at replay, see ReplayMode._region
        return out

    def _drop_modified(self) -> None:
        """Saved outputs that a later op of this forward modified in place are recomputed instead of served."""
        record = self.record
        keep = []
        for i in record.saved_at:
            entry = record.log[i]
            if entry.modified():
                what = "wrote" if entry.writes else "returned"
                _warn_once(
                    entry.key,
                    f"sac2: the policy saves {record.describe(i)}, but a tensor it {what} was modified in place "
                    f"later in the forward, so the saved value is stale; sac2 recomputes this op in backward "
                    f"instead. Have the policy recompute it to silence this warning.",
                )
                record.log[i] = entry.key
            else:
                keep.append(i)
        record.saved_at = keep


class ReplayMode(_Sac2Mode):
    """Recompute: walk the record, serve saved ops, re-run the rest, fail loudly on any divergence."""

    def __init__(self, record: Record, allow_cache_entry_mutation: bool = False) -> None:
        super().__init__()
        self.record = record
        self._log = record.log
        self.allow_cache_entry_mutation = allow_cache_entry_mutation
        self._cursor = 0

    def __enter__(self):
        self._cursor = 0  # each recompute (one per backward, more with retain_graph) replays from the start
        super().__enter__()
        log = self.record.log
        _offload.prefetch(e for e in map(log.__getitem__, self.record.saved_at) if type(e) is Saved and e.offload)
        return self

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if kwargs is None:
            kwargs = {}
        kind = _kinds.get(id(func))
        if kind is None:
            kind = _classify(func)
        if kind == _IGNORE:
            return func._op(*args, **kwargs)
        key = func if kind != _KEYED else hops.op_key(func, args)
        i = self._cursor
        try:
            entry = self._log[i]
        except IndexError:
            raise RuntimeError(
                f"sac2: recompute ran {op_name(key)} as op {i} of the region, but the forward ran only "
                f"{len(self._log)} ops. {_DIVERGED}"
            ) from None
        self._cursor = i + 1
        if entry is key:
            return func._op(*args, **kwargs) if kind == _PLAIN else func(*args, **kwargs)
        if type(entry) is Saved and entry.key is key:
            return self._serve(entry, i, func, args, kwargs)
        raise RuntimeError(
            f"sac2: recompute diverged from forward at op {i} of the region: forward ran "
            f"{self.record.describe(i)}, recompute ran {op_name(key)}. {_DIVERGED}"
        )

    def _serve(self, entry: Saved, i: int, func, args, kwargs):
        if entry.modified():
            if not self.allow_cache_entry_mutation:
                raise RuntimeError(
                    f"sac2: the output of {self.record.describe(i)} that selective checkpointing saved was "
                    f"modified in place after the checkpointed forward ended, so serving it would give wrong "
                    f"gradients. Don't modify the region's outputs in place, have the policy recompute this op, "
                    f"or pass allow_cache_entry_mutation=True to recompute it in backward."
                )
            return func(*args, **kwargs)
        if entry.offload is not None:
            _offload.ready(entry)
        _restore(entry, args, kwargs)  # below autograd here: copy_ records nothing
        if _compat.backward_keeps_graph():
            out = _served(entry.out, args, kwargs)  # another recompute serves this entry again
            if entry.offload is not None:
                _offload.release(entry)
            return out
        # The last recompute that can need this entry: hand over what it holds and let the record forget it,
        # so its memory goes with the backward's own references (a later recompute would re-run the op).
        self.record.log[i] = entry.key
        out = entry.out
        if type(out) is Tensor:
            return out
        return _served(out, args, kwargs)

    def _region(self, key: hops.Region, run: Callable, run_kept: Callable, args: tuple, kwargs: dict) -> Any:
        """A ``sac2.region`` call in recompute: serve what forward saved, else run it (its one run in backward)."""
        log = self.record.log
        i = self._cursor
        entry = log[i] if i < len(log) else None
        if entry is key:
            self._cursor = i + 1
            return run(*args, **kwargs)
        if type(entry) is Saved and entry.key is key:
            self._cursor = i + 1
            if entry.writes is None:
                return run_kept(*args, **kwargs)  # forward kept its backward state: the checkpoint expects none
            if entry.modified():
                _warn_once(
                    key,
                    f"sac2: the policy saves {self.record.describe(i)}, but a tensor it returned or wrote was "
                    f"modified in place after it ran, so the saved value is stale; sac2 runs the region again in "
                    f"backward instead. Have the policy recompute it to silence this warning.",
                )
                return run_kept(*args, **kwargs)  # forward kept its backward state: the checkpoint expects none
            with torch.no_grad():  # a region runs above autograd
                _restore(entry, args, kwargs)
            out, grads = entry.out
            served = _served(out, args, kwargs)
            stored = tree_leaves(out, is_leaf=lambda x: type(x) is _ArgRef)
            fresh = [t for o, t in zip(stored, tree_leaves(served)) if isinstance(o, Tensor)]
            for t, requires_grad in zip(fresh, grads):
                t.requires_grad_(requires_grad)
            return served
        ran = self.record.describe(i) if entry is not None else f"only {len(log)} ops"
        raise RuntimeError(
            f"sac2: recompute diverged from forward at op {i} of the region: forward ran {ran}, recompute ran "
            f"{op_name(key)}. {_DIVERGED}"
        )

    def __exit__(self, exc_type, exc, tb):
        cursor, n = self._cursor, len(self.record.log)
        super().__exit__(exc_type, exc, tb)
        if exc_type is None and cursor != n:
            raise RuntimeError(
                f"sac2: recompute ended after {cursor} ops, but the forward ran {n}; the first op missing is "
                f"{self.record.describe(cursor)}. {_DIVERGED}"
            )


_DIVERGED = (
    "The checkpointed function must run the same ops in backward as in forward: look for control flow that "
    "depends on global state, on data that changed since forward, or on whether a tensor requires grad."
)


def _unseen_writes(key: Any) -> str:
    return (
        f"sac2: the policy saves {op_name(key)}, which returns nothing yet takes tensors, so it can only have "
        f"written into them in ways sac2 cannot see or write back; it is recomputed in backward instead of saved."
    )


def _keep(entry: Saved, out: Any, writes: list[tuple[hops.Path, Tensor]]) -> None:
    """Fill a saved entry: detached aliases of what the op wrote and of its outputs (written arguments among the
    outputs become ``_ArgRef``s, served as the replayed arguments)."""
    written = {id(t): path for path, t in writes}
    entry.writes = [(path, _detach(t)) for path, t in writes]
    entry.out = _detached(out, written, entry.tensors)
    entry.tensors.extend(t for _, t in entry.writes)


def _restore(entry: Saved, args: tuple, kwargs: dict) -> None:
    """Serving a saved entry: leave the generator and the written arguments as running the op would have."""
    if entry.rng is not None:
        gen, state = entry.rng
        gen.set_state(state)
    for path, saved in entry.writes:
        hops.locate(args, kwargs, path).copy_(saved)


def _rng_after(out: Any, args: tuple, gen: torch.Generator | None = None) -> tuple[torch.Generator, Tensor]:
    """The generator an op drew from (its ``generator=`` or its device's default) and its state now."""
    gen = gen or _compat.default_generator(_device_of(out, args))
    return gen, gen.get_state()


def _device_of(out: Any, args: tuple) -> torch.device:
    for x in (out, *args):
        if isinstance(x, Tensor):
            return x.device
    return torch.device("cpu")


def _detached(out: Any, written: dict[int, hops.Path], tensors: list[Tensor]) -> Any:
    """``out`` with tensors detached (collected into ``tensors``) and written arguments as ``_ArgRef``s."""

    def one(x: Any) -> Any:
        if not isinstance(x, Tensor):
            return x
        path = written.get(id(x))
        if path is not None:
            return _ArgRef(path)
        d = _detach(x)
        tensors.append(d)
        return d

    if type(out) is Tensor:
        return one(out)
    if type(out) is tuple:
        return tuple(one(x) for x in out)
    return tree_map(one, out)


def _served(out: Any, args: tuple, kwargs: dict) -> Any:
    """A fresh alias of each saved tensor (autograd attaches history to what a mode returns) and the replayed
    arguments in place of ``_ArgRef``s."""

    def one(x: Any) -> Any:
        if type(x) is _ArgRef:
            return hops.locate(args, kwargs, x.path)
        return _detach(x) if isinstance(x, Tensor) else x

    if type(out) is Tensor:
        return _detach(out)
    if type(out) is tuple:
        return tuple(one(x) for x in out)
    return tree_map(one, out, is_leaf=lambda x: type(x) is _ArgRef)
