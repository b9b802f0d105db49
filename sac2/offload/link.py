"""The accelerator, its streams and its host link, as offload uses them: ``Link``, CUDA's (``CudaLink``), and the
one in use (``current``; ``using`` swaps it, for ``sac2.offload.standin``'s CPU stand-in).

Offload needs little of a device: which tensors live on it, a compute stream and two side streams (one per
direction, so that copies to the host and back never wait for each other), events to order them, pinned host
buffers, device tensors allocated for a side stream, and copies that start without the host waiting. Everything
else (when to copy, what to wait for) is ``sac2.offload.schedule``'s, so a stand-in for these few calls runs the
whole schedule on a CPU.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, cast

import torch

__all__ = ["Link", "CudaLink", "Layout", "current", "using", "offloads"]

Tensor = torch.Tensor
#: A tensor's shape, strides and dtype.
Layout = tuple[tuple[int, ...], tuple[int, ...], torch.dtype]


class Link:
    """What offload calls on a device: each method one step of a copy's life. Streams and events are opaque.
    ``description`` says which device and host link it is, for reports (``sac2.advise``'s bandwidth line)."""

    description = "a device"

    def available(self) -> bool:
        """Whether the machine has this kind of device at all (else offload changes nothing)."""
        raise NotImplementedError

    def device_of(self, t: Tensor) -> torch.device | None:
        """The device ``t`` lives on when offload can move it to the host (a plain dense tensor there), else None."""
        raise NotImplementedError

    def compute_stream(self, device: torch.device) -> object:
        """The stream the program's own kernels run on now."""
        raise NotImplementedError

    def side_streams(self, device: torch.device) -> tuple[object, object]:
        """The (to host, to device) streams offload copies on: the same two for every call."""
        raise NotImplementedError

    def record(self, stream: object) -> object:
        """An event that completes when the work queued on ``stream`` so far has."""
        raise NotImplementedError

    def wait(self, stream: object, event: object) -> None:
        """Make ``stream``'s later work wait for ``event`` (the host does not wait)."""
        raise NotImplementedError

    def host_buffer(self, nbytes: int) -> Tensor:
        """A new pinned host buffer of ``nbytes`` bytes (uint8): a host allocation, which the pool makes rare."""
        raise NotImplementedError

    def device_empty(self, device: torch.device, layout: Layout, stream: object) -> Tensor:
        """An uninitialized device tensor of ``layout`` (shape, strides, dtype), allocated for ``stream``."""
        raise NotImplementedError

    def copy(self, stream: object, dst: Tensor, src: Tensor) -> None:
        """Queue ``dst.copy_(src)`` on ``stream``; device memory of both stays reserved until the copy has run."""
        raise NotImplementedError

    def used_on(self, t: Tensor, stream: object) -> None:
        """``t`` (allocated for a side stream) is used on ``stream`` too: its memory waits for that work."""
        raise NotImplementedError

    def synchronize(self) -> None:
        """Wait, on the host, until every copy queued so far has run (measuring: what the device holds then)."""
        raise NotImplementedError


class CudaLink(Link):
    """CUDA's streams, events, pinned memory and caching allocator (all public torch API)."""

    description = "CUDA"

    def __init__(self) -> None:
        self._streams: dict[torch.device, tuple[object, object]] = {}

    def available(self) -> bool:
        return torch.cuda.is_available()

    def device_of(self, t: Tensor) -> torch.device | None:
        if type(t) is not Tensor or not t.is_cuda or t.layout is not torch.strided or t.is_nested:
            return None
        return t.device

    def compute_stream(self, device: torch.device) -> object:
        return torch.cuda.current_stream(device)

    def side_streams(self, device: torch.device) -> tuple[object, object]:
        pair = self._streams.get(device)
        if pair is None:
            pair = self._streams[device] = (torch.cuda.Stream(device), torch.cuda.Stream(device))
        return pair

    def record(self, stream: object) -> object:
        event = torch.cuda.Event()
        event.record(_stream(stream))
        return event

    def wait(self, stream: object, event: object) -> None:
        _stream(stream).wait_event(cast(torch.cuda.Event, event))

    def host_buffer(self, nbytes: int) -> Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def device_empty(self, device: torch.device, layout: Layout, stream: object) -> Tensor:
        with torch.cuda.stream(_stream(stream)):
            return torch.empty_strided(layout[0], layout[1], dtype=layout[2], device=device)

    def copy(self, stream: object, dst: Tensor, src: Tensor) -> None:
        s = _stream(stream)
        with torch.cuda.stream(s):
            dst.copy_(src, non_blocking=True)
        for t in (dst, src):
            if t.is_cuda:
                t.record_stream(s)  # the allocator must not reuse it before the copy has run

    def used_on(self, t: Tensor, stream: object) -> None:
        t.record_stream(_stream(stream))

    def synchronize(self) -> None:
        torch.cuda.synchronize()


def _stream(stream: object) -> torch.cuda.Stream:
    """A stream this link made (opaque to the schedule)."""
    return cast(torch.cuda.Stream, stream)


_current: list[Link] = [CudaLink()]


def current() -> Link:
    """The link offload uses now: CUDA's, unless ``using`` put another in its place."""
    return _current[-1]


@contextlib.contextmanager
def using(link: Link) -> Iterator[Link]:
    """Offload through ``link`` inside the block (a stand-in); CUDA's again after it, also on an exception."""
    _current.append(link)
    try:
        yield link
    finally:
        _current.remove(link)


def offloads(device: torch.device) -> bool:
    """Whether offload moves tensors off ``device`` to host memory (a CUDA device, or the stand-in's CPU); elsewhere
    what it is asked to move stays where it is, saved."""
    return current().device_of(torch.empty(0, device=device)) is not None
