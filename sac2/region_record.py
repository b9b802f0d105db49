"""Region calls in the record, and selective checkpointing with no dispatch mode for region-only policies.

A region call is one entry of the record, decided before it runs. Saved, it runs with its backward state kept for
real and its outputs recorded; in recompute it is served (outputs, writes, generator) and its body does not run.
Recomputed, it runs under the checkpoint like any code and runs once more in recompute. ``record_region`` and
``replay_region`` do this for both sac2 modes and for the dispatch-free contexts below.

A policy that can only ever save regions (a save list of ``sac2.Region``s) needs no per-op dispatch at all:
``RegionForward``/``RegionReplay`` are plain context managers that only regions talk to, so ops between
regions run at full eager speed. What sac2 checks per op (op-level divergence, writes through other aliases) is
then checked per region: the sequence of regions, their outputs' versions, what they wrote, their RNG.
"""

from __future__ import annotations

import threading
from types import TracebackType
from typing import TYPE_CHECKING, Any, Callable

import torch

from sac2 import _compat, messages, writes
from sac2.answers import SaveList, op_name
from sac2.draws import rng_before, rng_moved
from sac2.invariants import InternalError
from sac2.keys import PolicyOp, Region
from sac2.notices import count_forward, warn_once
from sac2.record import Record, Saved

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = [
    "record_region", "replay_region", "RegionForward", "RegionReplay", "region_only", "active", "keep_inputs",
    "keeps_inputs", "input_layouts", "rebuilds",
]

Tensor = torch.Tensor
#: Per tensor input of a region call (its tensor leaves in order, exact ``torch.Tensor``s and strided only):
#: (tensor, storage id, version at the call's start, first element, last element, dense).
InputLayout = tuple[Tensor, int | None, int, int, int, bool]
#: Where a tensor a saved region's body saved lives in the call's inputs: (input position, size, stride, offset
#: from the input's first element, the input's size, the input's stride).
Spec = tuple[int, tuple[int, ...], tuple[int, ...], int, tuple[int, ...], tuple[int, ...]]
#: What a saved region's record holds about the body saves recompute rebuilds: (their numbers among the body's
#: saves, where each lives).
Rebuilt = tuple[frozenset[int], tuple[Spec, ...]]

_keeping_inputs: set[str] = set()


def keep_inputs(names: Any, keep: bool = True) -> None:
    """Make the regions ``names`` (their ``sac2.Region`` names) keep the tensors their bodies save that are their
    own inputs for real (``keep``), or rebuild them in recompute from the replayed inputs (the default)."""
    for name in names:
        if keep:
            _keeping_inputs.add(name)
        else:
            _keeping_inputs.discard(name)


def keeps_inputs(key: Region) -> bool:
    """Whether a saved call of region ``key`` keeps its inputs for real (``keep_inputs``)."""
    return key.name in _keeping_inputs


def _identity(t: Tensor) -> Tensor:
    return t


def _plain_inputs(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Tensor]:
    """The tensor leaves of a call that recompute can rebuild body saves from: plain strided tensors (a wrapper
    subclass such as DTensor has no real storage to compare)."""
    return [
        t for t in _compat.tree_leaves((args, kwargs))
        if type(t) is Tensor and t.layout is torch.strided and not t.is_nested
    ]


def _last(t: Tensor) -> int:
    """The storage offset of ``t``'s last element (non-negative strides)."""
    return int(t.storage_offset()) + sum((n - 1) * st for n, st in zip(t.shape, t.stride(), strict=True) if n > 0)


def _dense(t: Tensor) -> bool:
    """Whether ``t``'s elements fill the storage range from its first to its last element, each once."""
    expected = 1
    for n, st in sorted(((n, st) for n, st in zip(t.shape, t.stride(), strict=True) if n != 1), key=lambda d: d[1]):
        if st != expected:
            return False
        expected *= n
    return True


def input_layouts(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[InputLayout]:
    """What ``rebuilds`` compares a saved tensor with, for each input of a region call, read when it starts."""
    layouts = []
    for t in _plain_inputs(args, kwargs):
        if t.numel() and all(st >= 0 for st in t.stride()):
            first = int(t.storage_offset())
            layouts.append((t, _compat.storage_id(t), _compat.version(t), first, _last(t), _dense(t)))
        else:
            layouts.append((t, None, 0, 0, -1, False))  # nothing is rebuilt from it
    return layouts


def rebuilds(x: Tensor, layouts: list[InputLayout]) -> Spec | None:
    """Where ``x``, a tensor a region's body saves, lives inside one of the region's inputs, so that recompute
    can rebuild it from the replayed input with ``as_strided``; None when it must be kept for real.

    It must share the input's storage, dtype and (unchanged) version, have non-negative strides and lie inside the
    input: anywhere between its first and last element for a dense input, with its exact layout otherwise.
    """
    if type(x) is not Tensor or x.layout is not torch.strided or x.is_nested or not x.numel():
        return None
    sid = _compat.storage_id(x)
    stride = x.stride()
    if any(st < 0 for st in stride):
        return None
    first = int(x.storage_offset())
    for j, (t, tsid, version, lo, hi, dense) in enumerate(layouts):
        if tsid is None or tsid != sid or x.dtype != t.dtype or _compat.version(x) != version:
            continue
        if dense:
            inside = lo <= first and _last(x) <= hi
        else:
            inside = first == lo and x.shape == t.shape and stride == t.stride()
        if inside:
            return j, tuple(x.shape), tuple(stride), first - lo, tuple(t.shape), tuple(t.stride())
    return None


class _FromInput:
    """What autograd keeps for a body save that recompute rebuilds: what the checkpoint's pack hook returned."""

    __slots__ = ("value",)

    def __init__(self, value: object) -> None:
        self.value = value


class _Kept:
    """A body save kept for real, with its version then: autograd checks no version through hooks, so the unpack
    does (a saved region's tensors are the forward's own, and a later in-place write would reach backward)."""

    __slots__ = ("tensor", "version", "number")

    def __init__(self, tensor: Tensor, number: int) -> None:
        self.tensor, self.version, self.number = tensor, _compat.version(tensor), number

    def unpack(self) -> Tensor:
        t = self.tensor
        if _compat.version(t) != self.version:
            tensor = f"[{t.type()} {list(t.shape)}]"
            node = _compat.current_node_name()
            raise RuntimeError(messages.saved_tensor_modified(tensor, _compat.version(t), self.version, node,
                                                              self.number))
        return t


def _unpack_kept(p: object) -> Tensor:
    if type(p) is not _Kept:
        raise InternalError(messages.internal_error(messages.NOT_KEPT))
    return p.unpack()


class _Saves:
    """The saved-tensor hooks a saved region's body runs under in forward: a save that is (a view of) an input goes
    to the checkpoint's hooks beneath (a position, not the tensor), anything else is kept for real."""

    def __init__(self, layouts: list[InputLayout], beneath: _compat.HookPair) -> None:
        self.layouts = layouts
        self.beneath_pack, self.beneath_unpack = beneath
        self.count = 0
        self.numbers: list[int] = []
        self.specs: list[Spec] = []

    def pack(self, x: Tensor) -> object:
        n = self.count
        self.count = n + 1
        spec = rebuilds(x, self.layouts)
        if spec is None:
            return _Kept(x, n)
        self.numbers.append(n)
        self.specs.append(spec)
        return _FromInput(self.beneath_pack(x))

    def unpack(self, p: object) -> Tensor:
        if type(p) is _FromInput:
            t: Tensor = self.beneath_unpack(p.value)
            return t
        return _unpack_kept(p)

    def rebuilt(self) -> Rebuilt | None:
        return (frozenset(self.numbers), tuple(self.specs)) if self.numbers else None


class _Rerun:
    """The hooks a saved region's body runs under when recompute runs it again: the saves forward handed to the
    checkpoint go to the checkpoint's recompute hooks, by number, so its positions stay in step."""

    def __init__(self, numbers: frozenset[int], top: _compat.HookPair) -> None:
        self.numbers = numbers
        self.top_pack, self.top_unpack = top
        self.count = 0

    def pack(self, x: Tensor) -> object:
        n = self.count
        self.count = n + 1
        return _FromInput(self.top_pack(x)) if n in self.numbers else _Kept(x, n)

    def unpack(self, p: object) -> Tensor:
        if type(p) is _FromInput:
            t: Tensor = self.top_unpack(p.value)
            return t
        return _unpack_kept(p)


def _run_saved(
    key: Region, run_kept: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[Any, Rebuilt | None]:
    """Run a saved region's body in forward: its backward state kept for real, except the saves recompute can
    rebuild from its inputs, which the checkpoint beneath keeps as positions (unless the region keeps inputs)."""
    beneath = None if keeps_inputs(key) else _compat.checkpoint_forward_hooks()
    if beneath is None:
        with torch.autograd.graph.saved_tensors_hooks(_identity, _identity):
            return run_kept(*args, **kwargs), None
    saves = _Saves(input_layouts(args, kwargs), beneath)
    try:
        with torch.autograd.graph.saved_tensors_hooks(saves.pack, saves.unpack):
            out = run_kept(*args, **kwargs)
    finally:
        saves.layouts = []  # autograd keeps the hooks in its graph: they must not keep the inputs
    return out, saves.rebuilt()


def _rerun(entry: Saved, run_kept: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Run a saved region's body again in recompute (forward kept its backward state, but for the saves it handed
    to the checkpoint: those are saved again, in the same order)."""
    rebuilt: Rebuilt | None = entry.rebuilt
    top = _compat.top_saved_tensors_hooks() if rebuilt is not None else None
    if rebuilt is None or top is None:
        with torch.autograd.graph.saved_tensors_hooks(_identity, _identity):
            return run_kept(*args, **kwargs)
    hooks = _Rerun(rebuilt[0], top)
    with torch.autograd.graph.saved_tensors_hooks(hooks.pack, hooks.unpack):
        return run_kept(*args, **kwargs)


def _replayable(rebuilt: Rebuilt, inputs: list[Tensor]) -> bool:
    """Whether each input a rebuilt save lives in came back in recompute with the layout it had in forward."""
    for j, _, _, _, size, stride in rebuilt[1]:
        if j >= len(inputs) or tuple(inputs[j].shape) != size or tuple(inputs[j].stride()) != stride:
            return False
    return True


def _pack_rebuilt(rebuilt: Rebuilt, inputs: list[Tensor]) -> None:
    """Serving a saved region in recompute: rebuild each save forward handed to the checkpoint from the replayed
    inputs and hand it to the checkpoint's recompute hooks, in forward's order, at the region's place."""
    top = _compat.top_saved_tensors_hooks()
    if top is None:
        return
    pack = top[0]
    for j, size, stride, offset, _, _ in rebuilt[1]:
        t = inputs[j]
        pack(t.as_strided(size, stride, t.storage_offset() + offset))


def record_region(
    record: Record,
    key: Region,
    save: bool,
    offload: bool,
    run: Callable[..., Any],
    run_kept: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    """Run a region call in forward and append its entry to ``record``: its key, or a ``Saved`` entry."""
    if not save:
        out = run(*args, **kwargs)
        record.log.append(key)
        return out
    before = writes.tensor_versions(args, kwargs)
    with _compat.no_modes():
        rng = rng_before(True, args, kwargs)
    out, rebuilt = _run_saved(key, run_kept, args, kwargs)
    entry = Saved(key)
    entry.rebuilt = rebuilt
    written = writes.writes_of(key, args, kwargs, out, before)
    entry.keep_region(out, written)
    with _compat.no_modes():
        entry.rng = rng_moved(rng)  # recompute skips the region: skip the numbers it drew, too
    if written is None:
        warn_once("unseen-writes", key, messages.unseen_writes(op_name(key)))
    record.add_region(entry, offload)
    return out


def replay_region(
    record: Record,
    i: int,
    key: Region,
    run: Callable[..., Any],
    run_kept: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    """The region call at position ``i`` of recompute: serve what forward saved, else run it."""
    log = record.log
    entry = log[i] if i < len(log) else None
    if entry is key:
        return run(*args, **kwargs)
    if type(entry) is not Saved or entry.key is not key:
        ran = record.describe(i) if entry is not None else f"only {len(log)} ops"
        raise RuntimeError(messages.region_diverged(i, ran, key.name))
    if entry.unseen_writes:
        return _rerun(entry, run_kept, args, kwargs)  # forward kept its backward state (but what it rebuilds)
    if entry.modified():
        warn_once("modified-after-region", key, messages.stale_after_region(record.describe(i)))
        return _rerun(entry, run_kept, args, kwargs)
    rebuilt: Rebuilt | None = entry.rebuilt
    if rebuilt is None:
        with torch.no_grad(), _compat.no_modes():  # a region runs above autograd and the modes
            return record.serve(i, args, kwargs)
    inputs = _plain_inputs(args, kwargs)
    if not _replayable(rebuilt, inputs):
        return _rerun(entry, run_kept, args, kwargs)
    with torch.no_grad(), _compat.no_modes():
        _pack_rebuilt(rebuilt, inputs)  # first: the checkpoint may stop recomputing once the last one is back
        return record.serve(i, args, kwargs)


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
    """Forward of a region-only policy: regions ask ``saves`` and are recorded; nothing else is intercepted."""

    def __init__(self, saves: frozenset[PolicyOp], record: Record) -> None:
        super().__init__(record)
        self.saves = saves
        #: As ``CachingMode.saved_tensors_hooks``: the user's hooks saved regions go through, or None.
        self.saved_tensors_hooks: _compat.HookPair | None = None

    def __enter__(self) -> Self:
        count_forward()
        return super().__enter__()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        super().__exit__(exc_type, exc, tb)
        if exc_type is None:
            self.record.end_forward(self.saved_tensors_hooks)

    def region(
        self,
        key: Region,
        run: Callable[..., Any],
        run_kept: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        return record_region(self.record, key, key in self.saves, False, run, run_kept, args, kwargs)


class RegionReplay(_Context):
    """Recompute of a region-only policy: serves saved regions in order, runs the others, checks the sequence."""

    def __init__(self, record: Record) -> None:
        super().__init__(record)
        self._cursor = 0

    def __enter__(self) -> Self:
        self._cursor = 0
        self.record.start_recompute()
        return super().__enter__()

    def region(
        self,
        key: Region,
        run: Callable[..., Any],
        run_kept: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        i = self._cursor
        self._cursor = i + 1
        return replay_region(self.record, i, key, run, run_kept, args, kwargs)

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        super().__exit__(exc_type, exc, tb)
        self.record.end_recompute()
        cursor, n = self._cursor, len(self.record.log)
        if exc_type is None and cursor < n:
            raise RuntimeError(messages.regions_ended_early(cursor, n, self.record.describe(cursor)))


def region_only(policy: object) -> frozenset[PolicyOp] | None:
    """The regions a policy saves if it can only ever save ``sac2.region`` calls, else None.

    That is a save list of ``sac2.Region``s while compiled code does not run as ``inductor_compiled_code``
    (``wrap_inductor_compiled_regions`` off): then no op but a ``sac2.region`` call can match a ``Region``.
    """
    if type(policy) is SaveList and policy.ops and all(type(op) is Region for op in policy.ops):
        if not _compat.compiled_regions_wrapped():
            return policy.ops
    return None
