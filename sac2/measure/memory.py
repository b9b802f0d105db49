"""Measure, never estimate, the memory a training step keeps for backward and its peak.

On CUDA the caching allocator's statistics answer directly. On CPU torch keeps no allocator statistics, but the
CPU allocator reports every allocation and free (with its size) to the profiler when ``profile_memory=True``;
summing those events in time order gives the same two numbers as ``memory_allocated`` and
``max_memory_allocated`` would. The profiler runs only for the measured step, which is then not timed.

What both methods count: tensor storages from torch's allocator, whoever holds them (autograd's saved tensors,
checkpoint inputs, sac2's record, stock SAC's storage). What they do not count: memory that does not come from
torch's allocator (oneDNN scratch buffers, Python objects, the CUDA caching allocator's reserved-but-free blocks).

Offload (``sac2.offload``) keeps tensors in pinned host memory, which neither counts: ``host`` is read from offload's
pinned pool instead, the bytes it has lent when forward returns, once the copies queued by then have run (a
synchronize, on CUDA as through the CPU stand-in for a device, whose host buffers are outside torch's allocator).
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from sac2 import _compat, messages
from sac2.offload import link as links
from sac2.offload import schedule

__all__ = ["DEVICE_TYPES", "Memory", "measure_step"]

#: The device types whose memory ``measure_step`` can measure.
DEVICE_TYPES = ("cpu", "cuda")


@dataclass(frozen=True)
class Memory:
    """Bytes of one forward+backward, relative to what was allocated when the step started.

    ``kept``: allocated by forward and still allocated when it returned: what it keeps for backward (plus its
    output). ``peak``: the most allocated at any moment of forward and backward. ``host``: what forward left in
    offload's pinned host memory for backward (none of ``kept``).
    """

    kept: int
    peak: int
    host: int = 0


def measure_step(forward: Callable[[], torch.Tensor], device: torch.device | str) -> tuple[Memory, torch.Tensor]:
    """Run ``forward()`` (returning a scalar loss), then backward from it; return the measured memory and the loss."""
    device = torch.device(device)
    if device.type == "cuda":
        return _measure_cuda(forward, device)
    if device.type == "cpu":
        return _measure_cpu(forward)
    raise ValueError(messages.bench_memory_bad_device(device, DEVICE_TYPES))


def _measure_cuda(forward: Callable[[], torch.Tensor], device: torch.device) -> tuple[Memory, torch.Tensor]:
    link = links.current()
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    start, host = torch.cuda.memory_allocated(device), schedule.host_bytes(link)
    loss = forward()
    torch.cuda.synchronize(device)
    kept, host = torch.cuda.memory_allocated(device) - start, schedule.host_bytes(link) - host
    loss.backward()
    torch.cuda.synchronize(device)
    return Memory(kept=kept, peak=torch.cuda.max_memory_allocated(device) - start, host=host), loss


def _measure_cpu(forward: Callable[[], torch.Tensor]) -> tuple[Memory, torch.Tensor]:
    link = links.current() if links.offloads(torch.device("cpu")) else None  # the stand-in's CPU is a device
    host = 0 if link is None else schedule.host_bytes(link)
    with _allocations() as fwd:
        loss = forward()
        if link is not None:
            link.synchronize()  # the copies to the host run: the device tensors they read are let go
    host = 0 if link is None else schedule.host_bytes(link) - host
    with _allocations() as bwd:
        loss.backward()
    kept, fwd_peak = _net_and_peak(fwd)
    _, bwd_peak = _net_and_peak(bwd)
    return Memory(kept=kept, peak=max(fwd_peak, kept + bwd_peak), host=host), loss


def _net_and_peak(sizes: list[int]) -> tuple[int, int]:
    total = peak = 0
    for n in sizes:
        total += n
        peak = max(peak, total)
    return total, peak


@contextlib.contextmanager
def _allocations() -> Iterator[list[int]]:
    """Collect the signed sizes of the CPU allocator's allocations (+) and frees (-) inside the block, in order."""
    sizes: list[int] = []
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)
    with _quiet_stderr():  # kineto prints a line to fd 2 on every start and stop
        prof.__enter__()
    try:
        yield sizes
    finally:
        with _quiet_stderr():
            prof.__exit__(None, None, None)
    sizes.extend(_compat.allocation_sizes(prof))


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
