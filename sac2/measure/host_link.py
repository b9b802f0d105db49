"""The host link's bandwidth as offload gets it: one pinned host buffer copied to the device and back, each copy timed
on the host from its start to a synchronize, through offload's own link (``sac2.offload.link``: CUDA's side streams
and pinned memory, or the CPU stand-in for a device). ``sac2.advise`` shows it beside its offload rows: what moving a
row's host bytes each way costs, against what recomputing them costs.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from sac2.offload import link as links

__all__ = ["HostLink", "measure_host_link", "NBYTES", "REPEATS"]

#: The bytes copied each way: a block's input at long context (8192 tokens of 4096 bf16 values).
NBYTES = 64 * 2**20
#: Timed copies each way; the median counts.
REPEATS = 5


@dataclass(frozen=True)
class HostLink:
    """Bytes per second each way (``to_host``, ``to_device``), the median of ``repeats`` timed copies of an
    ``nbytes`` pinned buffer through ``link`` (``Link.description``)."""

    link: str
    nbytes: int
    repeats: int
    to_host: float
    to_device: float


def measure_host_link(device: torch.device) -> HostLink:
    """Time copies of an ``NBYTES`` pinned buffer between host memory and ``device`` through offload's link now in use,
    each way on the side stream offload copies that way on."""
    link = links.current()
    to_host, to_device = link.side_streams(device)
    host = link.host_buffer(NBYTES)
    dev = link.device_empty(device, ((NBYTES,), (1,), torch.uint8), to_device)
    link.synchronize()
    to_host_rate, to_device_rate = _rate(link, to_host, host, dev), _rate(link, to_device, dev, host)
    return HostLink(link.description, NBYTES, REPEATS, to_host_rate, to_device_rate)


def _rate(link: links.Link, stream: object, dst: torch.Tensor, src: torch.Tensor) -> float:
    """Bytes per second of ``dst.copy_(src)`` queued on ``stream``: the median over ``REPEATS`` copies."""
    seconds = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        link.copy(stream, dst, src)
        link.synchronize()
        seconds.append(time.perf_counter() - start)
    return src.nbytes / max(statistics.median(seconds), 1e-9)
