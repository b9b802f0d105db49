"""Tensors autograd keeps that offload moves to host memory: a checkpoint's inputs (``saved_input``: what full AC
keeps) and what a saved region's body keeps for its backward (``body_save``).

Autograd checks no version of a tensor kept through saved-tensor hooks, so each ``HostSave`` keeps a witness of the
tensor's version counter (no storage) and raises autograd's error at unpack when the tensor was written in place
since it was saved, as without offload.
"""

from __future__ import annotations

import torch

from sac2 import _compat, messages
from sac2.offload.parcel import Parcel
from sac2.offload.schedule import Block

__all__ = ["HostSave", "can_move", "saved_input", "body_save", "unpack_body"]

Tensor = torch.Tensor


class HostSave:
    """A tensor's parcel, a witness of its version counter, the version it was saved at, and its number among the
    saves it belongs to (a checkpoint's inputs, a region body's saves)."""

    __slots__ = ("parcel", "witness", "version", "number", "shape")

    def __init__(self, parcel: Parcel, witness: Tensor, t: Tensor, number: int) -> None:
        self.parcel, self.witness, self.number = parcel, witness, number
        self.version, self.shape = _compat.version(t), list(t.shape)

    def written(self) -> int | None:
        """The tensor's version now if it was written in place since it was saved, else None."""
        now = _compat.version(self.witness)
        return None if now == self.version else now

    def described(self) -> str:
        return f"[{self.witness.type()} {self.shape}]"


def can_move(t: Tensor, block: Block) -> bool:
    """Whether offload can move ``t`` from the device of ``block``'s link."""
    return block.link.device_of(t) is not None and t.numel() > 0


def saved_input(t: Tensor, block: Block, index: int) -> _compat.SavedTensor:
    """``t``, input ``index`` of a checkpointed call, saved as autograd saves an input, its memory in ``block``'s
    parcel: each recompute reads it back (it stays on the host for a later recompute until the frame is gone)."""

    def pack(x: Tensor) -> HostSave | Tensor:
        return _host_save(x, block, 0, index) or x

    _compat.push_saved_tensors_hooks(pack, _unpack_input)
    try:
        return _compat.make_saved_tensor(t)
    finally:
        _compat.pop_saved_tensors_hooks()


def _unpack_input(h: HostSave | Tensor) -> Tensor:
    if isinstance(h, Tensor):
        return h
    now = h.written()
    if now is not None:
        raise RuntimeError(messages.checkpoint_input_modified(h.described(), now, h.version, h.number))
    return h.parcel.take(final=False)


def body_save(x: Tensor, block: Block, number: int) -> HostSave | None:
    """What a saved region's body keeps for its backward (``x``, its save ``number``), moved in ``block``'s parcel;
    None where ``x`` stays where it is."""
    return _host_save(x, block, 2, number)


def unpack_body(h: HostSave) -> Tensor:
    """The tensor back for the region's backward: autograd's error if it was written in place since it was saved.
    A backward that does not keep its graph reads it for the last time."""
    now = h.written()
    if now is not None:
        node = _compat.current_node_name()
        raise RuntimeError(messages.saved_tensor_modified(h.described(), now, h.version, node, h.number))
    final = _compat.graph_task() is not None and not _compat.backward_keeps_graph()
    return h.parcel.take(final)


def _host_save(x: Tensor, block: Block, rank: int, number: int) -> HostSave | None:
    witness = _compat.version_witness(x)
    if witness is None:
        return None
    parcel = block.add(x, rank)
    return None if parcel is None else HostSave(parcel, witness, x, number)


# Autograd calls these from C++, also inside compiled code, where dynamo would trace them as the user's code.
_compat.skip_dynamo_in_code(saved_input, _unpack_input, unpack_body)
