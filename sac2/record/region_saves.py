"""What a saved region's body saves for backward: kept for real, or rebuilt in recompute from the region's inputs.

A saved region keeps its backward state itself (it never runs in backward), but a tensor its body saves that is (a view
of) one of the region's own inputs need not be kept: recompute replays the ops that made the input anyway. Such a save
goes to the checkpoint's pack hook beneath as an ordinary position, and when recompute serves the region it is rebuilt
from the replayed input (the input itself, or ``as_strided`` of it) and packed at the same place. Anything else (a
parameter, a tensor the body made, another dtype, a lazy conjugate or negation, partial overlap, an alias that is no
view of the input's base) is kept for real; what the forward's saved regions share (an earlier region's output, a view
an earlier region's body saved) is shared (``Forward``, below). A region keeps its inputs too where its policy says
so (``apply_ac(keep_inputs=True)``: ``SaveList.keep_inputs``) or its name does (``keep_inputs``,
``sac2.region(keep_inputs=True)``): for inputs from a nondeterministic producer.

Every save of a saved region's body passes through here, so the common cases (the input itself, a contiguous
reshape of it, a parameter) read as few tensor attributes as they can: each costs a Python-to-C call.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

import torch

from sac2 import _compat, messages
from sac2.core.keys import Region
from sac2.offload import saves as host_saves
from sac2.offload import schedule

__all__ = [
    "keep_inputs", "keeps_inputs", "rebuilds", "run_saved", "run_under", "unpack_kept", "unpack_any", "Rebuilt",
    "Forward",
    "Shared", "note_outputs", "kept_anyway",
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


# ---- what the saved regions of one forward share ---------------------------------------------------------------
# So that none keeps or rebuilds a tensor twice, two cases need no checkpoint position of their own:
# - (a view of) what an earlier saved region returned: the record keeps that output until backward anyway
#   (``note_outputs``), so the body keeps it for real at no cost, and recompute need not reach the region;
# - the same view of the same unchanged input that an earlier saved region's body saved (q/k/v projections of one
#   normed input, an MLP's gate and up projections): the save shares that region's position (``Shared``), and the
#   first of them to unpack it in a backward hands it to the others.
# A ``Forward`` lives on the record while the forward runs (``sac2.record.regions`` alone fills it) and holds weak
# references only.

#: What a view of an input is, for sharing: the input's id, then the view's size, stride and offset (None, None, 0
#: for the input itself).
ViewKey = tuple[int, Any, Any, int]


class Shared:
    """A checkpoint position several saves of one forward share: what autograd keeps for each of them.

    ``holder``: what the checkpoint's pack hook returned for the first. ``uses``: how many saves share it. Per
    backward (graph task), the first unpack takes the tensor from the checkpoint and keeps it for the others.
    """

    __slots__ = ("holder", "input", "version", "uses", "taken")

    def __init__(self, holder: object, input: Tensor, version: int) -> None:
        self.holder = holder
        self.input = weakref.ref(input)  # to tell a later input with a reused id from this one
        self.version = version
        self.uses = 1
        self.taken: dict[object, list[Any]] = {}  # graph task -> [tensor, unpacks left]

    def unpack(self, unpack: Callable[[Any], Tensor]) -> Tensor:
        """The tensor, through the checkpoint's ``unpack`` for the first of this backward's unpacks."""
        if self.uses == 1:
            return unpack(self.holder)
        task = _compat.graph_task()
        if task is None:  # read outside any backward: the checkpoint recomputes for this read alone
            return unpack(self.holder)
        taken = self.taken.get(task)
        if taken is None:
            t = unpack(self.holder)
            self.taken[task] = [t, self.uses - 1]
            return t
        taken[1] -= 1
        if not taken[1]:
            del self.taken[task]
        out: Tensor = taken[0]
        return out


class Forward:
    """What the saved regions of one forward share: ``outputs``, a weak reference to the tensor each saved region's
    output is or views, by its id (None where the user's saved-tensor hooks take what the record keeps: then a
    later region keeping one would keep it twice); ``positions``, each ``Shared`` position by the view it holds."""

    __slots__ = ("outputs", "positions")

    def __init__(self, keep_outputs: bool) -> None:
        self.outputs: dict[int, weakref.ref[Tensor]] | None = {} if keep_outputs else None
        self.positions: dict[ViewKey, Shared] = {}

    def position(self, key: ViewKey, input: Tensor, version: int) -> Shared | None:
        """The position an earlier save of this view of ``input`` (at ``version``) holds, now shared once more."""
        shared = self.positions.get(key)
        if shared is None or shared.input() is not input or shared.version != version:
            return None
        shared.uses += 1
        return shared


def note_outputs(forward: Forward, out: Any) -> None:
    """Note what a saved region returned (``out``): the record keeps it on its device until backward."""
    outputs = forward.outputs
    if outputs is None:
        return
    for t in (out,) if type(out) is Tensor else _compat.tree_leaves(out):
        if type(t) is Tensor:
            base = _compat.view_base(t)
            root = t if base is None else base
            outputs[id(root)] = weakref.ref(root)


def kept_anyway(x: Tensor, forward: Forward) -> bool:
    """Whether ``x`` is (a view of) what an earlier saved region returned, which the record keeps anyway."""
    outputs = forward.outputs
    if not outputs:
        return False
    base = _compat.view_base(x)
    root = x if base is None else base
    held = outputs.get(id(root))
    return held is not None and held() is root


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


def unpack_kept(p: Kept) -> Tensor:
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


def unpack_any(p: Kept | host_saves.HostSave) -> Tensor:
    """A kept save back: from host memory for an offloaded region's."""
    if isinstance(p, host_saves.HostSave):
        return host_saves.unpack_body(p)
    return unpack_kept(p)


class _KeepAll:
    """The saved-tensor hooks of a saved region's body that keeps every save for real (``keep_inputs``), each with
    its version: autograd checks none through hooks, so a write into a kept tensor before backward would be silently
    read (``unpack_kept`` raises autograd's error instead)."""

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
    (``Forward``, below); anything else is kept for real. Autograd keeps a ``Shared`` or a ``Kept``.
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
        return unpack_any(p)

    def rebuilt(self) -> Rebuilt | None:
        return (frozenset(self.numbers), tuple(self.specs)) if self.numbers else None


def run_saved(
    body: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], before: list[tuple[Tensor, int]],
    forward: Forward, keep: bool = False, offload: bool = False,
) -> tuple[Any, Rebuilt | None]:
    """Run a saved region's body in forward (``before``: its tensor arguments with their versions): its backward
    state kept for real, except the saves recompute can rebuild from its inputs, which the checkpoint beneath keeps
    as positions, shared with the forward's other saved regions (``forward``), unless the region keeps its inputs
    (``keep``: ``keeps_inputs``). An ``offload``ed region keeps what it keeps for real in host memory
    (``sac2.offload``). The checkpoint's pack hook is found on torch's hook stack: it is the innermost pair while a
    checkpointed forward runs (``_compat.checkpoint_forward_hooks``), the one link to the frame that no import shows."""
    block = schedule.current() if offload else None
    beneath = None if keep else _compat.checkpoint_forward_hooks()
    if beneath is None:
        keep_all = _KeepAll(block, forward)
        try:
            return run_under(body, args, kwargs, keep_all.pack, unpack_any), None
        finally:
            keep_all.forward = None  # autograd keeps the hooks in its graph
    saves = _Saves(before, beneath, forward, block)
    try:
        out = run_under(body, args, kwargs, saves.pack, saves.unpack)
    finally:
        saves.inputs = []  # autograd keeps the hooks in its graph: they must not keep the inputs
        saves.forward = None
    return out, saves.rebuilt()


def run_under(
    body: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
    pack: Callable[[Tensor], Any], unpack: Callable[[Any], Tensor],
) -> Any:
    """``body(*args, **kwargs)`` with what it saves for backward going to ``pack``/``unpack`` (a saved region keeps
    its backward state itself)."""
    _compat.push_saved_tensors_hooks(pack, unpack)
    try:
        return body(*args, **kwargs)
    finally:
        _compat.pop_saved_tensors_hooks()


# Autograd calls these from C++, also inside compiled code (a compiled submodule in a saved region's body), where
# dynamo would trace them as the user's code.
_compat.skip_dynamo_in_code(_KeepAll.pack, _Saves.pack, _Saves.unpack, unpack_kept, unpack_any, _kept)
