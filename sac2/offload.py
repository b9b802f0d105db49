"""Eager CPU offload for MUST/PREFER_CPU_OFFLOAD: saved outputs wait for backward in pinned host memory.

When the checkpointed forward ends, each offloaded entry's CUDA tensors are copied into pinned CPU memory on a
side stream and the record drops its device aliases, so the device memory frees as soon as the forward's own
references go. When recompute starts, every offloaded entry is copied back on the side stream at once
(prefetch); serving an entry makes the compute stream wait for its copy only. The copy is taken at the end of
forward, so in-place changes made to the output afterwards cannot reach what backward reads. An entry with no
CUDA tensor (CPU training) stays an ordinary save.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch

from sac2._compat import tree_leaves, tree_map

__all__ = ["Offloaded", "to_host", "prefetch", "ready", "release"]

Tensor = torch.Tensor
_streams: dict[torch.device, torch.cuda.Stream] = {}


class _Host:
    """A pinned host copy of a device tensor (host tensors the op returned stay plain tensors)."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: Tensor) -> None:
        self.tensor = tensor


class Offloaded:
    """An entry's outputs and writes in pinned host memory, and the device copies of the current recompute."""

    __slots__ = ("host_out", "host_writes", "device", "event")

    def __init__(self, host_out: Any, host_writes: list, device: torch.device) -> None:
        self.host_out = host_out
        self.host_writes = host_writes
        self.device = device
        self.event: torch.cuda.Event | None = None


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    s = _streams.get(device)
    if s is None:
        s = _streams[device] = torch.cuda.Stream(device)
    return s


def _cuda_device(entry: Any) -> torch.device | None:
    for t in entry.tensors:
        if t.is_cuda:
            return t.device
    return None


def to_host(entries: Iterable[Any]) -> None:
    """Copy each entry's CUDA tensors to pinned host memory on a side stream; the record keeps only the copies."""
    for entry in entries:
        device = _cuda_device(entry)
        if device is None:
            entry.offload = None  # nothing on a device: an ordinary save
            continue
        side = _side_stream(device)
        side.wait_stream(torch.cuda.current_stream(device))

        def host(x: Any) -> Any:
            if not (isinstance(x, Tensor) and x.is_cuda):
                return x
            h = torch.empty_like(x, device="cpu", pin_memory=True)
            h.copy_(x, non_blocking=True)
            x.record_stream(side)  # the allocator must not reuse x before the copy has read it
            return _Host(h)

        with torch.cuda.stream(side), torch.no_grad():
            entry.offload = Offloaded(tree_map(host, entry.out), [(p, host(t)) for p, t in entry.writes], device)
        # Between forward and recompute the record holds only host copies; prefetch puts device tensors back.
        entry.out, entry.writes = entry.offload.host_out, entry.offload.host_writes
        entry.tensors, entry.versions = (), ()  # a copy cannot be modified in place by anyone else


def prefetch(entries: Iterable[Any]) -> None:
    """Start copying every offloaded entry back to its device, on the side stream, in record order."""
    for entry in entries:
        off = entry.offload
        side = _side_stream(off.device)
        side.wait_stream(torch.cuda.current_stream(off.device))

        def back(x: Any) -> Any:
            return x.tensor.to(off.device, non_blocking=True) if type(x) is _Host else x

        with torch.cuda.stream(side), torch.no_grad():
            entry.out = tree_map(back, off.host_out, is_leaf=_is_host)
            entry.writes = [(p, back(t)) for p, t in off.host_writes]
            off.event = torch.cuda.Event()
            off.event.record(side)


def ready(entry: Any) -> None:
    """Make the compute stream wait for this entry's copy, and tell the allocator that stream now uses it."""
    off = entry.offload
    compute = torch.cuda.current_stream(off.device)
    compute.wait_event(off.event)
    for t in [*tree_leaves(entry.out), *(t for _, t in entry.writes)]:
        if isinstance(t, Tensor) and t.is_cuda:
            t.record_stream(compute)


def release(entry: Any) -> None:
    """After serving: the record goes back to holding host copies only (another recompute prefetches again)."""
    off = entry.offload
    entry.out, entry.writes, off.event = off.host_out, off.host_writes, None


def _is_host(x: Any) -> bool:
    return type(x) is _Host
