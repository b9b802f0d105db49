"""What a saved region's body saves for backward: kept for real, or rebuilt in recompute from the region's inputs.

A saved region keeps its backward state itself (it never runs in backward), but a tensor its body saves that is
(a view of) one of the region's own inputs need not be kept: recompute replays the ops that made the input anyway.
Such a save goes to the checkpoint's pack hook beneath as an ordinary position, and when recompute serves the
region it is rebuilt from the replayed input (``as_strided``) and packed at the same place. Anything else (a
parameter, a tensor the body made, negative strides, another dtype, partial overlap) is kept for real.
``keep_inputs`` makes a region keep its inputs too (for inputs from a nondeterministic producer).
"""

from __future__ import annotations

from typing import Any

import torch

from sac2 import _compat, messages
from sac2.invariants import InternalError
from sac2.keys import Region
from sac2.region_call import RegionCall
from sac2.saved import Saved

__all__ = [
    "keep_inputs", "keeps_inputs", "input_layouts", "rebuilds", "plain_inputs", "run_saved", "rerun",
    "replayable", "pack_rebuilt", "Rebuilt",
]

Tensor = torch.Tensor
#: Per tensor input of a region call (its tensor leaves in order, exact ``torch.Tensor``s and strided only):
#: (tensor, storage id or None when nothing is rebuilt from it, version at the call's start). Where it lies in its
#: storage is read only when a body save shares that storage (``rebuilds``).
InputLayout = tuple[Tensor, int | None, int]
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


def plain_inputs(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Tensor]:
    """The tensor leaves of a call that recompute can rebuild body saves from: plain strided tensors (a wrapper
    subclass such as DTensor has no real storage to compare)."""
    plain = not kwargs and all(type(a) is Tensor for a in args)  # a module's call on tensors: no tree to walk
    return [
        t for t in (args if plain else _compat.tree_leaves((args, kwargs)))
        if type(t) is Tensor and t.layout is torch.strided and not t.is_nested
    ]


def _last(t: Tensor) -> int:
    """The storage offset of ``t``'s last element (non-negative strides)."""
    last = int(t.storage_offset())
    for n, st in zip(t.shape, t.stride(), strict=True):
        if n > 1:
            last += (n - 1) * st
    return last


def _dense(t: Tensor) -> bool:
    """Whether ``t``'s elements fill the storage range from its first to its last element, each once."""
    if t.is_contiguous():
        return True
    expected = 1
    for n, st in sorted(((n, st) for n, st in zip(t.shape, t.stride(), strict=True) if n != 1), key=lambda d: d[1]):
        if st != expected:
            return False
        expected *= n
    return True


def input_layouts(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[InputLayout]:
    """What ``rebuilds`` compares a saved tensor with, for each input of a region call, read when it starts."""
    storage_id, version = _compat.storage_id, _compat.version
    layouts: list[InputLayout] = []
    for t in plain_inputs(args, kwargs):
        if t.numel() and all(st >= 0 for st in t.stride()):
            layouts.append((t, storage_id(t), version(t)))
        else:
            layouts.append((t, None, 0))  # nothing is rebuilt from it
    return layouts


def _spec(j: int, x: Tensor, offset: int, t: Tensor) -> Spec:
    return j, tuple(x.shape), tuple(x.stride()), offset, tuple(t.shape), tuple(t.stride())


def rebuilds(x: Tensor, layouts: list[InputLayout]) -> Spec | None:
    """Where ``x``, a tensor a region's body saves, lives inside one of the region's inputs, so that recompute
    can rebuild it from the replayed input with ``as_strided``; None when it must be kept for real.

    It must share the input's storage, dtype and (unchanged) version, have non-negative strides and lie inside the
    input: anywhere between its first and last element for a dense input, with its exact layout otherwise.
    """
    if type(x) is not Tensor or x.layout is not torch.strided or x.is_nested or not x.numel():
        return None
    version = _compat.version(x)
    for j, (t, tsid, tversion) in enumerate(layouts):  # the input itself, the common case: no layout to read
        if x is t and tsid is not None and version == tversion:
            return _spec(j, x, 0, t)
    sid = _compat.storage_id(x)
    if not any(tsid == sid for _, tsid, _ in layouts) or any(st < 0 for st in x.stride()):
        return None
    first = int(x.storage_offset())
    for j, (t, tsid, tversion) in enumerate(layouts):
        if tsid != sid or x.dtype != t.dtype or version != tversion:
            continue
        lo = int(t.storage_offset())
        if _dense(t):
            inside = lo <= first and _last(x) <= _last(t)
        else:
            inside = first == lo and x.shape == t.shape and x.stride() == t.stride()
        if inside:
            return _spec(j, x, first - lo, t)
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


def run_saved(call: RegionCall) -> tuple[Any, Rebuilt | None]:
    """Run a saved region's body in forward: its backward state kept for real, except the saves recompute can
    rebuild from its inputs, which the checkpoint beneath keeps as positions (unless the region keeps inputs)."""
    beneath = None if keeps_inputs(call.key) else _compat.checkpoint_forward_hooks()
    if beneath is None:
        return call.run_under(_compat.as_is, _compat.as_is), None
    saves = _Saves(input_layouts(call.args, call.kwargs), beneath)
    try:
        out = call.run_under(saves.pack, saves.unpack)
    finally:
        saves.layouts = []  # autograd keeps the hooks in its graph: they must not keep the inputs
    return out, saves.rebuilt()


def rerun(entry: Saved, call: RegionCall) -> Any:
    """Run a saved region's body again in recompute (forward kept its backward state, but for the saves it handed
    to the checkpoint: those are saved again, in the same order)."""
    rebuilt: Rebuilt | None = entry.rebuilt
    top = _compat.top_saved_tensors_hooks() if rebuilt is not None else None
    if rebuilt is None or top is None:
        return call.run_under(_compat.as_is, _compat.as_is)
    hooks = _Rerun(rebuilt[0], top)
    return call.run_under(hooks.pack, hooks.unpack)


def replayable(rebuilt: Rebuilt, inputs: list[Tensor]) -> bool:
    """Whether each input a rebuilt save lives in came back in recompute with the layout it had in forward."""
    for j, _, _, _, size, stride in rebuilt[1]:
        if j >= len(inputs) or tuple(inputs[j].shape) != size or tuple(inputs[j].stride()) != stride:
            return False
    return True


def pack_rebuilt(rebuilt: Rebuilt, inputs: list[Tensor]) -> None:
    """Serving a saved region in recompute: rebuild each save forward handed to the checkpoint from the replayed
    inputs and hand it to the checkpoint's recompute hooks, in forward's order, at the region's place."""
    top = _compat.top_saved_tensors_hooks()
    if top is None:
        return
    pack = top[0]
    for j, size, stride, offset, _, _ in rebuilt[1]:
        t = inputs[j]
        pack(t.as_strided(size, stride, t.storage_offset() + offset))
