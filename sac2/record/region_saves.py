"""What a saved region's body saves for backward: kept for real, or rebuilt in recompute from the region's inputs.

A saved region keeps its backward state itself (it never runs in backward), but a tensor its body saves that is (a view
of) one of the region's own inputs need not be kept: recompute replays the ops that made the input anyway. Such a save
goes to the checkpoint's pack hook beneath as an ordinary position, and when recompute serves the region it is rebuilt
from the replayed input (the input itself, or ``as_strided`` of it) and packed at the same place. Anything else (a
parameter, a tensor the body made, another dtype, a lazy conjugate or negation, partial overlap, an alias that is no
view of the input's base) is kept for real; what the forward's saved regions share (an earlier region's output, a view
an earlier region's body saved) is ``sac2.record.region_sharing``. A region keeps its inputs too where its policy says
so (``apply_ac(keep_inputs=True)``: ``SaveList.keep_inputs``) or its name does (``keep_inputs``,
``sac2.region(keep_inputs=True)``): for inputs from a nondeterministic producer.

Every save of a saved region's body passes through here, so the common cases (the input itself, a contiguous
reshape of it, a parameter) read as few tensor attributes as they can: each costs a Python-to-C call.
"""

from __future__ import annotations

from typing import Any

import torch

from sac2 import _compat, messages
from sac2.core.keys import Region
from sac2.offload import saves as host_saves
from sac2.offload import schedule
from sac2.record.region_call import RegionCall
from sac2.record.region_sharing import Forward, Shared, kept_anyway
from sac2.record.saved import Saved

__all__ = [
    "keep_inputs", "keeps_inputs", "rebuilds", "run_saved", "rerun",
    "pack_rebuilt", "Rebuilt",
]

Tensor = torch.Tensor
#: Where a tensor a saved region's body saved lives in the call's inputs: (the input's position among the call's
#: tensor arguments, ``sac2.core.writes.tensor_args``; size, stride, offset from the input's first element, size and
#: stride None for the input itself; the input's size, the input's stride).
Spec = tuple[int, tuple[int, ...] | None, tuple[int, ...] | None, int, tuple[int, ...], tuple[int, ...]]
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


def keeps_inputs(key: Region, policy_keeps: bool = False) -> bool:
    """Whether a saved call of region ``key`` keeps its inputs for real: its policy's setting (``policy_keeps``,
    ``SaveList.keep_inputs``) or its name's (``keep_inputs``)."""
    return policy_keeps or key.name in _keeping_inputs


def _plain(t: Tensor) -> bool:
    """Whether recompute can rebuild a save from ``t``: a plain strided tensor (a wrapper subclass such as DTensor
    has no real storage to compare, and a parameter is kept anyway: autograd's graph holds it)."""
    return type(t) is Tensor and t.layout is torch.strided and not t.is_nested


def _extent(t: Tensor) -> int:
    """How many elements from ``t``'s first to its last one in memory, less one (torch has no negative strides)."""
    extent = 0
    for n, st in zip(t.shape, t.stride(), strict=True):
        extent += (n - 1) * st
    return extent


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


def rebuilds(x: Tensor, inputs: list[tuple[Tensor, int]]) -> Spec | None:
    """Where ``x``, a tensor a region's body saves, lives inside one of the region's tensor arguments (``inputs``:
    each with its version when the call started), so that recompute can rebuild it from the replayed input; None
    when it must be kept for real.

    It is a plain input itself, or a view of what one views, of the same dtype, conjugate and negative bits and
    inside the input's memory: anywhere between its first and last element for a dense input, with its exact
    layout otherwise; and the input is unchanged since the call started (else recompute, which replays the input's
    producer, would not see the write). A parameter or a view of one (a Linear's transposed weight) is kept:
    autograd's graph holds it anyway.
    """
    base = _view_base(x)
    if type(base) is _Parameter:
        return None  # a parameter's view (a Linear's transposed weight), an input or not
    for j, (t, version) in enumerate(inputs):  # the input itself, the common case: no layout to read
        if x is t:
            if _version(x) != version or not _plain(t):
                return None
            return (j, None, None, 0, t.shape, t.stride())
    return None if base is None else _view_of_input(x, base, inputs)  # None: a tensor the body made


def _view_of_input(x: Tensor, base: Tensor, inputs: list[tuple[Tensor, int]]) -> Spec | None:
    """``rebuilds`` for ``x``, a view of ``base`` that is no input itself: the first input that views ``base`` too
    and holds ``x`` inside its memory."""
    for j, (t, version) in enumerate(inputs):
        if t is not base and _view_base(t) is not base:
            continue
        if x.dtype != t.dtype or _version(x) != version or not _plain(t):
            continue
        if x.is_conj() != t.is_conj() or x.is_neg() != t.is_neg():
            return None  # a lazy conjugate or negation of the input: as_strided would read it plainly
        spec = _inside(x, t)
        if spec is not None:
            return (j, *spec, t.shape, t.stride())
    return None


_version, _view_base, _Parameter = _compat.version, _compat.view_base, torch.nn.Parameter


def _inside(x: Tensor, t: Tensor) -> tuple[tuple[int, ...], tuple[int, ...], int] | None:
    """(size, stride, offset from ``t``'s first element) of ``x``, a view of what ``t`` views (so of one storage,
    and of one dtype), where it lies inside ``t``'s memory; None where it does not (partial overlap, another layout
    in a non-dense input)."""
    offset: int = x.storage_offset() - t.storage_offset()  # type: ignore[assignment]  # eager: ints, no SymInts
    n, m = x.numel(), t.numel()
    if offset < 0 or not n or not m:
        return None
    if t.is_contiguous():  # a contiguous input (a Linear's, reshaped by its matmul): extents without layouts
        inside = offset + (n - 1 if x.is_contiguous() else _extent(x)) <= m - 1
    elif _dense(t):
        inside = offset + _extent(x) <= _extent(t)
    else:
        inside = offset == 0 and x.shape == t.shape and x.stride() == t.stride()
    return (x.shape, x.stride(), offset) if inside else None


#: A body save kept for real: (the tensor, its version then, its number among the body's saves). autograd checks
#: no version through hooks, so the unpack does (a saved region's tensors are the forward's own, and a later
#: in-place write would reach backward). A tuple, which no checkpoint's pack hook returns, so unpack tells them apart.
Kept = tuple[Tensor, int, int]


def _unpack_kept(p: Kept) -> Tensor:
    t, version, number = p
    if _compat.version(t) != version:
        tensor = f"[{t.type()} {list(t.shape)}]"
        node = _compat.current_node_name()
        raise RuntimeError(messages.saved_tensor_modified(tensor, _compat.version(t), version, node, number))
    return t


def _kept(x: Tensor, n: int, block: schedule.Block | None) -> Kept | host_saves.HostSave:
    """Save ``n`` of a saved region's body, kept for real: on the device, or, for an offloaded region (``block``:
    its forward's offload block), in host memory (not a parameter: autograd's graph holds it anyway)."""
    if block is not None and _compat.parameter_of(x) is None:
        moved = host_saves.body_save(x, block, n)
        if moved is not None:
            return moved
    return (x, _compat.version(x), n)


def _unpack_any(p: Kept | host_saves.HostSave) -> Tensor:
    """A kept save back: from host memory for an offloaded region's."""
    if isinstance(p, host_saves.HostSave):
        return host_saves.unpack_body(p)
    return _unpack_kept(p)


class _KeepAll:
    """The saved-tensor hooks of a saved region's body that keeps every save for real (``keep_inputs``), each with
    its version: autograd checks none through hooks, so a write into a kept tensor before backward would be silently
    read (``_unpack_kept`` raises autograd's error instead)."""

    __slots__ = ("count", "block", "forward")

    def __init__(self, block: schedule.Block | None, forward: Forward | None) -> None:
        self.count = 0
        self.block = block  # an offloaded region's: what it keeps goes to host memory, but what the record keeps
        self.forward = forward

    def pack(self, x: Tensor) -> Kept | host_saves.HostSave:
        n = self.count
        self.count = n + 1
        if self.block is None or (self.forward is not None and kept_anyway(x, self.forward)):
            return (x, _compat.version(x), n)
        return _kept(x, n, self.block)


class _Saves:
    """The saved-tensor hooks a saved region's body runs under in forward: a save that is (a view of) an input goes to
    the checkpoint's hooks beneath (which keep a position, not the tensor), shared with an earlier save of the same view
    (``sac2.record.region_sharing``); anything else is kept for real. Autograd keeps a ``Shared`` or a ``Kept``.
    """

    __slots__ = ("inputs", "beneath_pack", "beneath_unpack", "forward", "count", "numbers", "specs", "block")

    def __init__(self, inputs: list[tuple[Tensor, int]], beneath: _compat.HookPair, forward: Forward,
                 block: schedule.Block | None) -> None:
        self.inputs = inputs  # the call's tensor arguments, each with its version when it started
        self.beneath_pack, self.beneath_unpack = beneath
        self.forward: Forward | None = forward
        self.count = 0
        self.numbers: list[int] = []
        self.specs: list[Spec] = []
        self.block = block  # an offloaded region's: what it keeps for real goes to host memory

    def pack(self, x: Tensor) -> Kept | Shared | host_saves.HostSave:
        n = self.count
        self.count = n + 1
        spec = rebuilds(x, self.inputs)
        forward = self.forward
        if spec is None or forward is None or kept_anyway(x, forward):
            if self.block is None or spec is not None or forward is None or kept_anyway(x, forward):
                return (x, _version(x), n)  # on the device, or there anyway (the record keeps it)
            return _kept(x, n, self.block)  # a tensor the body of an offloaded region made
        t, version = self.inputs[spec[0]]
        key = (id(t), spec[1], spec[2], spec[3])
        shared = forward.position(key, t, version)
        if shared is None:
            self.numbers.append(n)
            self.specs.append(spec)
            shared = forward.positions[key] = Shared(self.beneath_pack(x), t, version)
        return shared

    def unpack(self, p: Kept | Shared | host_saves.HostSave) -> Tensor:
        if isinstance(p, Shared):
            return p.unpack(self.beneath_unpack)
        return _unpack_any(p)

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
        return self.top_pack(x) if n in self.numbers else (x, _compat.version(x), n)

    def unpack(self, p: object) -> Tensor:
        if type(p) is tuple:
            return _unpack_kept(p)
        t: Tensor = self.top_unpack(p)
        return t


def run_saved(
    call: RegionCall, before: list[tuple[Tensor, int]], forward: Forward, keep: bool = False, offload: bool = False
) -> tuple[Any, Rebuilt | None]:
    """Run a saved region's body in forward (``before``: its tensor arguments with their versions): its backward
    state kept for real, except the saves recompute can rebuild from its inputs, which the checkpoint beneath keeps
    as positions, shared with the forward's other saved regions (``forward``), unless the region keeps inputs
    (``keep``: its policy says so; or its name does, ``keep_inputs``). An ``offload``ed region keeps what it keeps
    for real in host memory (``sac2.offload``)."""
    block = schedule.current() if offload else None
    beneath = None if keeps_inputs(call.key, keep) else _compat.checkpoint_forward_hooks()
    if beneath is None:
        keep_all = _KeepAll(block, forward)
        try:
            return call.run_under(keep_all.pack, _unpack_any), None
        finally:
            keep_all.forward = None  # autograd keeps the hooks in its graph
    saves = _Saves(before, beneath, forward, block)
    try:
        out = call.run_under(saves.pack, saves.unpack)
    finally:
        saves.inputs = []  # autograd keeps the hooks in its graph: they must not keep the inputs
        saves.forward = None
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


def pack_rebuilt(rebuilt: Rebuilt, inputs: list[Tensor]) -> bool:
    """Serving a saved region in recompute, in no-grad mode (the views are backward's to read: no autograd node for
    them): rebuild each save forward handed to the checkpoint from the replayed ``inputs`` (``writes.tensor_args``)
    and hand it to the checkpoint's recompute hooks, in forward's order, at the region's place. False, packing
    nothing, when an input it lives in came back with another layout than in forward (then the body runs again:
    ``rerun``)."""
    specs = rebuilt[1]
    for j, _, _, _, size, stride in specs:
        if j >= len(inputs) or inputs[j].shape != size or inputs[j].stride() != stride:
            return False
    top = _compat.top_saved_tensors_hooks()
    if top is None:
        return True
    pack = top[0]
    for j, view_size, view_stride, offset, _, _ in specs:
        t = inputs[j]
        if view_size is None or view_stride is None:
            pack(t)  # the input itself
        else:
            pack(t.as_strided(view_size, view_stride, t.storage_offset() + offset))
    return True


# Autograd calls these from C++, also inside compiled code (a compiled submodule in a saved region's body), where
# dynamo would trace them as the user's code.
_compat.skip_dynamo_in_code(
    _KeepAll.pack, _Saves.pack, _Saves.unpack, _Rerun.pack, _Rerun.unpack, _unpack_kept, _unpack_any, _kept
)
