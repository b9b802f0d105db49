"""What the saved regions of one checkpointed forward share, so that none keeps or rebuilds a tensor twice.

``sac2.record.region_saves`` hands a checkpoint position to each tensor a saved region's body saves of its own inputs,
rebuilt in recompute. Two cases need no position of their own:

- (a view of) what an earlier saved region returned: the record keeps that output until backward anyway
  (``note_outputs``), so the body keeps it for real at no cost, and recompute need not reach the region;
- the same view of the same unchanged input that an earlier saved region's body saved (q/k/v projections of one
  normed input, an MLP's gate and up projections): the save shares that region's position (``Shared``), and the
  first of them to unpack it in a backward hands it to the others.

A ``Forward`` lives on the record while the forward runs and holds weak references only.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

import torch

from sac2 import _compat

__all__ = ["Forward", "Shared", "note_outputs", "kept_anyway"]

Tensor = torch.Tensor
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
