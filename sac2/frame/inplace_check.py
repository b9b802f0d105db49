"""The versions of the tensors a checkpoint frame stands in for: autograd's in-place check, which the frame owns
because it keeps no saved tensor (frame rules 3 and 3a).

Without checkpointing, autograd raises when a tensor it saved was written in place before backward read it. The
frame saves positions, so it keeps, per position, a witness of the tensor's version counter (no storage) and the
version it packed. Under the user's saved-tensor hooks autograd checks nothing: backward reads whatever the hooks
kept, the written values where they keep the tensor itself (``save_on_cpu`` on a CPU tensor), the saved ones where
they copy; recompute then replays the write, or keeps a copy, to give the same.
"""

from __future__ import annotations

import weakref

import torch

from sac2 import _compat, messages

__all__ = ["SavedVersions", "Witnesses", "Entry", "Witnessed", "entry", "hooks_keep"]

Tensor = torch.Tensor
#: A tensor's witness (``_compat.version_witness``, or the parameter it is or views; else a weak reference to the
#: tensor), its version when saved, and, with a witness (whose shape may not be the tensor's), its shape.
Witnessed = tuple[Tensor | weakref.ref[Tensor], int, torch.Size | None]
#: A position's ``Witnessed``; None for a checkpoint input (autograd checks it).
Entry = Witnessed | None


class SavedVersions:
    """Per position of one frame's forward, what the in-place check needs (``entries``, appended to by the frame's
    pack hook; None under ``allow_mutation_on_saved_tensors``, where writing into a saved tensor is allowed)."""

    __slots__ = ("entries", "user_hooks", "end_versions", "hooks_keep", "inputs")

    def __init__(self, args: tuple[object, ...], nested: bool) -> None:
        self.entries: list[Entry] | None = None if _compat.mutation_on_saved_tensors_allowed() else []
        #: The user's saved-tensor hooks in scope when the forward started.
        self.user_hooks = _compat.user_saved_tensors_hooks()
        #: A nested call's tensor inputs, which the enclosing checkpoint holds (on its own, autograd checks them
        #: itself, in its words), where autograd would check them (no user hooks): (input index, entry).
        self.inputs: list[tuple[int, Witnessed]] = []
        if nested and self.entries is not None and self.user_hooks is None:
            for k, a in enumerate(args):
                if isinstance(a, Tensor):
                    self.inputs.append((k, entry(a)))
        #: Under those hooks: each position's version when the forward ended.
        self.end_versions: list[int | None] | None = None
        #: Whether the hooks hand back the tensor they were given, by device (probed when first needed).
        self.hooks_keep: dict[torch.device, bool] = {}

    def check(self, i: int, saved: Entry, here: bool) -> None:
        """autograd's error if the tensor saved at position ``i`` (its entry: ``saved``) was written in place since
        (rule 3), naming the backward node running when ``here`` (it is the one unpacking it); under the user's
        hooks, sac2's error for a write after the forward into a tensor they keep by reference, which recompute
        cannot make again (3a)."""
        if saved is None:
            return
        x = _tensor(saved)
        packed_version = saved[1]
        if x is None or _version(x) == packed_version:
            return
        tensor = _described(x, saved)
        if self.user_hooks is None:
            node = _compat.current_node_name() if here else None
            raise RuntimeError(messages.saved_tensor_modified(tensor, _version(x), packed_version, node, i))
        ended = self.end_versions[i] if self.end_versions is not None else packed_version
        if _version(x) != ended and self._hooks_keep(x.device):
            raise RuntimeError(messages.saved_tensor_written_after_forward(tensor, i))

    def check_inputs(self) -> None:
        """autograd's error, naming the input, if an input of a nested call was written in place since the call
        started: recompute runs the function again from its inputs and would compute from other values than the
        forward did (autograd's own check of the inputs, which it cannot make where the outer checkpoint holds
        them; that one's check would name a node that never saved them)."""
        for k, e in self.inputs:
            x = _tensor(e)
            if x is not None and _version(x) != e[1]:
                raise RuntimeError(messages.checkpoint_input_modified(_described(x, e), _version(x), e[1], k))

    def changed(self, i: int) -> bool:
        """Whether the tensor saved at position ``i`` was written in place since it was saved."""
        entry = self.entries[i] if self.entries is not None else None
        x = _tensor(entry)
        return entry is not None and x is not None and _version(x) != entry[1]

    def end_forward(self) -> None:
        """The forward is done: under the user's hooks, note each position's version (a later change is a write
        after the forward)."""
        if self.user_hooks is None or self.entries is None:
            return
        self.end_versions = [None if x is None else _version(x) for x in map(_tensor, self.entries)]

    def replaying_writes(self, early_stop: bool) -> tuple[bool, frozenset[int]]:
        """Rule 3a, for each tensor the forward wrote into after saving it under the user's hooks: where they keep
        the tensor itself, recompute runs to the end (no early stop) so the same writes reach the recomputed one;
        where they copy, recompute keeps a copy at that position. Returns (early stop, positions to copy)."""
        if self.end_versions is None or self.entries is None:
            return early_stop, frozenset()
        copy, replayed = set(), False
        for i, (entry, ended) in enumerate(zip(self.entries, self.end_versions, strict=True)):
            x = _tensor(entry)
            if entry is None or x is None or ended is None or ended == entry[1]:
                continue
            if self._hooks_keep(x.device):
                replayed = True
            else:
                copy.add(i)
        return early_stop and not replayed, frozenset(copy)

    def _hooks_keep(self, device: torch.device) -> bool:
        """Whether the user's hooks hand back the tensor they were given (not a copy) on ``device``."""
        return self.user_hooks is not None and hooks_keep(self.user_hooks, device, self.hooks_keep)


class Witnesses:
    """The witnesses of one frame's forward, one per version counter: the tensors a forward saves are often views of
    one base (q, k and v of one projection; a Linear's reshaped input) or one tensor saved by several ops, and a view
    shares its base's counter, so one witness of the base serves them all. Looked up by the base's id, checked
    against a weak reference (an id is reused once its tensor is gone); dropped when the forward ends."""

    __slots__ = ("by_root",)

    def __init__(self) -> None:
        self.by_root: dict[int, tuple[weakref.ref[Tensor], Tensor | None]] = {}

    def entry(self, x: Tensor, shape: torch.Size | None) -> Witnessed:
        """``entry(x)`` (``shape``: ``x.shape`` where the caller read it already, else None), with the witness of
        ``x``'s base made once per forward. Every saved tensor passes here: each step is a C call or a dict read."""
        base = _view_base(x)
        root = x if base is None or base.dtype != x.dtype else base  # the error names the tensor by its dtype
        if root.is_leaf and root.requires_grad:  # a parameter, or a view of one: its own witness
            return root, _version(x), x.shape if shape is None else shape
        by_root = self.by_root
        key = id(root)
        hit = by_root.get(key)
        if hit is not None and hit[0]() is root:
            w = hit[1]
        else:
            w = _witness(root)
            by_root[key] = (_Ref(root), w)
        if w is None:  # no witness (a subclass, a nested tensor): watched weakly, named by its own shape
            return _Ref(x), _version(x), None
        return w, _version(x), x.shape if shape is None else shape


def hooks_keep(hooks: _compat.HookPair, device: torch.device, probed: dict[torch.device, bool]) -> bool:
    """Whether ``hooks`` hand back the tensor they were given (not a copy) on ``device``, probed once per device
    (remembered in ``probed``) with a one-element tensor."""
    keep = probed.get(device)
    if keep is None:
        pack, unpack = hooks
        with _compat.no_modes(), torch.no_grad():
            probe = torch.zeros(1, device=device)
            back: object = unpack(pack(probe))
        keep = probed[device] = isinstance(back, Tensor) and _compat.storage_id(back) == _compat.storage_id(probe)
    return keep


def entry(x: Tensor) -> Witnessed:
    """``x``'s witness (or a weak reference where it has none), its version now, and its shape with a witness (which
    has no shape of its own: the error messages name it).

    A parameter (or a view of one, as a Linear saves its weight) is its own witness: it shares the counter, and
    autograd's graph keeps it alive anyway (its gradient accumulator holds it), so it costs no witness to make.
    """
    param = _compat.parameter_of(x)
    if param is not None:
        return param, _version(x), x.shape
    w = _witness(x)
    return (weakref.ref(x), _version(x), None) if w is None else (w, _version(x), x.shape)


_version, _witness, _view_base = _compat.version, _compat.version_witness, _compat.view_base
_Ref = weakref.ref


def _described(x: Tensor, e: Witnessed) -> str:
    """``[torch.DoubleTensor [4, 4]]``: how autograd's in-place error names the tensor of ``e`` (``x``)."""
    return f"[{x.type()} {list(x.shape if e[2] is None else e[2])}]"


def _tensor(entry: Entry) -> Tensor | None:
    """The witness (or the live tensor) of ``entry``, if any."""
    if entry is None:
        return None
    return entry[0] if isinstance(entry[0], Tensor) else entry[0]()
