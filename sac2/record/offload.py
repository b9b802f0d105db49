"""Eager CPU offload for MUST/PREFER_CPU_OFFLOAD: saved outputs wait for backward in pinned host memory.

When the checkpointed forward ends, each offloaded entry's CUDA tensors are copied into pinned CPU memory on a
side stream and the entry drops its device aliases, so the device memory frees as soon as the forward's own
references go. When recompute starts, every offloaded entry is copied back on the side stream at once
(prefetch); serving an entry makes the compute stream wait for its copy only. The copy is taken at the end of
forward, so in-place changes made to the output afterwards cannot reach what backward reads. An entry with no
CUDA tensor (CPU training) stays an ordinary save. ``sac2.record.saved.Saved`` calls these functions and holds what they
return; this module holds no entry state of its own.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch

from sac2 import messages
from sac2._compat import tree_leaves, tree_map
from sac2.core.writes import Path
from sac2.messages.internal import InternalError

__all__ = ["Offloaded", "cuda_device", "to_host", "to_device", "wait"]

Tensor = torch.Tensor
#: (path, tensor) per argument a call wrote (``sac2.core.writes.Path``); on the host, the tensor's pinned copy.
Written = tuple[tuple[Path, Any], ...]
_streams: dict[torch.device, torch.cuda.Stream] = {}


class _Host:
    """A pinned host copy of a device tensor (host tensors the op returned stay plain tensors)."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: Tensor) -> None:
        self.tensor = tensor


class Offloaded:
    """An entry's outputs and writes in pinned host memory, the device they came from, and the event that marks
    the current prefetch's copy back."""

    __slots__ = ("host_out", "host_writes", "device", "event")

    def __init__(self, host_out: Any, host_writes: Written, device: torch.device) -> None:
        self.host_out = host_out
        self.host_writes = host_writes
        self.device = device
        self.event: torch.cuda.Event | None = None


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    s = _streams.get(device)
    if s is None:
        s = _streams[device] = torch.cuda.Stream(device)
    return s


def cuda_device(tensors: Iterable[Tensor]) -> torch.device | None:
    """The CUDA device of the first CUDA tensor among ``tensors``, or None (nothing to offload)."""
    for t in tensors:
        if t.is_cuda:
            return t.device
    return None


def to_host(out: Any, written: Written, device: torch.device) -> Offloaded:
    """Copy the CUDA tensors of ``out`` and ``written`` into pinned host memory on a side stream."""
    side = _side_stream(device)
    side.wait_stream(torch.cuda.current_stream(device))

    def host(x: object) -> object:
        if not (isinstance(x, Tensor) and x.is_cuda):
            return x
        h = torch.empty_like(x, device="cpu", pin_memory=True)
        h.copy_(x, non_blocking=True)
        x.record_stream(side)  # the allocator must not reuse x before the copy has read it
        return _Host(h)

    with torch.cuda.stream(side), torch.no_grad():
        return Offloaded(tree_map(host, out), tuple((p, host(t)) for p, t in written), device)


def to_device(off: Offloaded) -> tuple[Any, Written]:
    """Start copying ``off`` back to its device on the side stream; the device outputs and writes, to use once
    ``wait`` has made the compute stream wait for the copy."""
    side = _side_stream(off.device)
    side.wait_stream(torch.cuda.current_stream(off.device))

    def back(x: object) -> object:
        return x.tensor.to(off.device, non_blocking=True) if type(x) is _Host else x

    with torch.cuda.stream(side), torch.no_grad():
        out = tree_map(back, off.host_out, is_leaf=_is_host)
        written = tuple((p, back(t)) for p, t in off.host_writes)
        off.event = torch.cuda.Event()
        off.event.record(side)
    return out, written


def wait(off: Offloaded, out: Any, written: Written) -> None:
    """Make the compute stream wait for the copy back, and tell the allocator that stream now uses the tensors."""
    compute = torch.cuda.current_stream(off.device)
    if off.event is None:
        raise InternalError(messages.internal_error(messages.COPY_BACK_NOT_STARTED))
    compute.wait_event(off.event)
    for t in [*tree_leaves(out), *(t for _, t in written)]:
        if isinstance(t, Tensor) and t.is_cuda:
            t.record_stream(compute)


def _is_host(x: object) -> bool:
    return type(x) is _Host
