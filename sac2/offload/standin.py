"""A CPU stand-in for an accelerator, its streams and its host link, so that offload's whole schedule runs, and is
checked, on any machine (the tests, ``benchmarks/gpu_offload.py --smoke``).

Every CPU tensor counts as a device tensor. The compute stream runs at once, as the program does; the two side
streams only queue their copies, and run them when something waits for them (the compute stream waiting for an
event, a side stream waiting for the other's), or at ``synchronize``. So a copy runs as late as a real device may
run it: a device copy read before its copy back ran holds NaN (it is made so), and a copy to the host reads its
tensor when it runs, after every write the program made since. ``log`` lists, in the order offload issued them,
the copies each way, the compute stream's waits and the pinned allocations, each copy named by ``name``'s label for
its tensor (else its dtype and shape).

Its device memory is torch's CPU allocator; its pinned host buffers are not (Python ``bytearray``s), so a
measurement of the device's allocations (``sac2.measure.memory``) leaves them out, as CUDA's allocator statistics
leave pinned memory out.

What it does not model: time (nothing overlaps; the benchmark measures that on a GPU), the device allocator's
reuse of memory across streams (``record_stream``), and pinned memory's cost.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Callable, Iterator, cast

import torch

from sac2 import _compat
from sac2.offload import link as links
from sac2.offload import schedule

__all__ = ["StandIn", "stand_in"]

Tensor = torch.Tensor
DEVICE = torch.device("cpu")


class _Stream:
    def __init__(self, name: str) -> None:
        self.name = name
        self.queue: list[Callable[[], None] | None] = []  # None once run: a copy holds its tensors until then
        self.ran = 0  # how many queued operations have run
        self.labels: list[str] = []  # per queued operation, what it copied ("" for a wait)

    def run_to(self, n: int) -> None:
        while self.ran < n:
            op, self.queue[self.ran] = self.queue[self.ran], None
            self.ran += 1
            if op is not None:
                op()


class _Event:
    def __init__(self, stream: _Stream) -> None:
        self.stream, self.at = stream, len(stream.queue)
        self.label = next((label for label in reversed(stream.labels) if label), "")  # the copy it follows


class StandIn(links.Link):
    """The stand-in link: ``log`` of what offload issued, ``host_allocations`` made, ``synchronize`` to run every
    queued copy."""

    description = "the CPU stand-in for a device, sac2.offload.standin"

    def __init__(self) -> None:
        self.compute = _Stream("compute")
        self.to_host, self.to_device = _Stream("to_host"), _Stream("to_device")
        self.log: list[tuple[str, object]] = []
        self.host_allocations = 0
        self._labels: dict[int, str] = {}
        self._copies_back: list[weakref.ref[Tensor]] = []

    def name(self, t: Tensor, label: str) -> None:
        """Call ``t``'s copies ``label`` in the log (by its memory: what shares it shares the name)."""
        self._labels[t.data_ptr()] = label

    def label(self, t: Tensor) -> str:
        return self._labels.get(t.data_ptr()) or f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}"

    def copies_back_alive(self) -> int:
        """How many of the device tensors copies back went into are still referenced by anyone."""
        return sum(ref() is not None for ref in self._copies_back)

    def synchronize(self) -> None:
        """Run every queued copy."""
        for stream in (self.to_host, self.to_device):
            stream.run_to(len(stream.queue))

    # --- the Link ---
    def available(self) -> bool:
        return True

    def device_of(self, t: Tensor) -> torch.device | None:
        plain = type(t) is Tensor and t.layout is torch.strided and not t.is_nested
        return DEVICE if plain and t.device.type == "cpu" else None

    def compute_stream(self, device: torch.device) -> object:  # noqa: ARG002 (Link's signature)
        return self.compute

    def side_streams(self, device: torch.device) -> tuple[object, object]:  # noqa: ARG002 (Link's signature)
        return self.to_host, self.to_device

    def record(self, stream: object) -> object:
        return _Event(_own(stream))

    def wait(self, stream: object, event: object) -> None:
        s, e = _own(stream), _own_event(event)
        if s is self.compute:
            self.log.append(("wait", e.label))
            e.stream.run_to(e.at)
            return
        s.queue.append(lambda: e.stream.run_to(e.at))
        s.labels.append("")

    def host_buffer(self, nbytes: int) -> Tensor:
        self.host_allocations += 1
        self.log.append(("host_alloc", nbytes))
        # Outside torch's allocator, which is the stand-in's device memory; all ones: read before its copy, NaN.
        return torch.frombuffer(bytearray(b"\xff") * nbytes, dtype=torch.uint8)

    def device_empty(self, device: torch.device, layout: links.Layout, stream: object) -> Tensor:  # noqa: ARG002
        shape, stride, dtype = layout
        t = torch.empty_strided(shape, stride, dtype=dtype)
        if dtype.is_floating_point or dtype.is_complex:
            t.fill_(float("nan"))  # read before its copy back has run: NaN, a wrong gradient
        else:
            t.fill_(True if dtype is torch.bool else -1)
        self._copies_back.append(weakref.ref(t))
        return t

    def copy(self, stream: object, dst: Tensor, src: Tensor) -> None:
        s = _own(stream)
        label = self.label(src)
        self._labels[dst.data_ptr()] = label
        self.log.append((s.name, label))

        def run() -> None:
            with _compat.no_modes(), torch.no_grad():
                dst.copy_(src)

        if s is self.compute:
            run()
            return
        s.queue.append(run)
        s.labels.append(label)

    def used_on(self, t: Tensor, stream: object) -> None:  # noqa: ARG002 (Link's signature)
        """Nothing to model: the stand-in's memory is the CPU's, kept by references."""


def _own(stream: object) -> _Stream:
    """A stream this stand-in made (opaque to the schedule)."""
    return cast(_Stream, stream)


def _own_event(event: object) -> _Event:
    return cast(_Event, event)


@contextlib.contextmanager
def stand_in() -> Iterator[StandIn]:
    """Offload through a new ``StandIn`` inside the block; its queued copies run when the block ends."""
    link = StandIn()
    with links.using(link):
        try:
            yield link
        finally:
            link.synchronize()
            schedule.forget(link)
