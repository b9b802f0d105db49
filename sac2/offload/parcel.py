"""One tensor's way to host memory and back (``Parcel``), each step a method that queues its copy on a side stream.

    held (on the device) --send--> on the host (pinned buffer from the pool) --fetch--> copied back --take-->

``take`` hands the tensor to whoever reads it (a served entry, an unpack), making the compute stream wait for that
copy alone; a held parcel (the last block's, or one the pool had no room for) hands over the tensor itself. One
parcel may serve several readers (a saved region's output is also what its body saves): the device copy is dropped
once each has taken it, so a second backward copies it again; the host buffer goes back to the pool once every
reader has taken it for the last time (``final``), or when the parcel is gone.
"""

from __future__ import annotations

import threading

import torch

from sac2 import _compat, messages
from sac2.messages.internal import InternalError
from sac2.offload.link import Layout, Link
from sac2.offload.pool import Buffer, Pool

__all__ = ["Parcel", "LOCK", "layout"]

Tensor = torch.Tensor
#: Guards every parcel and block: forward sends, backward threads fetch and take.
LOCK = threading.RLock()


class Parcel:
    """One tensor offload moves. ``rank`` orders a block's parcels by when backward reads them (0: checkpoint
    inputs, 1: served entries, 2: a saved region's backward state); ``users``: how many readers share it."""

    __slots__ = (
        "link", "pool", "device", "tensor", "layout", "nbytes", "rank", "users", "takes", "finals", "buffer", "host",
        "sent", "copy", "fetched",
    )

    def __init__(self, link: Link, pool: Pool, device: torch.device, tensor: Tensor, rank: int) -> None:
        self.link, self.pool, self.device, self.rank = link, pool, device, rank
        # On the device until sent (or for good: held); detached, so that no autograd graph hangs on the schedule.
        self.tensor: Tensor | None = tensor.detach() if tensor.requires_grad else tensor
        self.layout = layout(tensor)
        self.nbytes = tensor.numel() * tensor.element_size()
        self.users, self.takes, self.finals = 1, 0, 0
        self.buffer: Buffer | None = None  # lent by the pool while the parcel is on the host
        self.host: Tensor | None = None
        self.sent: object = None  # the event after its copy to the host
        self.copy: Tensor | None = None  # copied back, until every reader has taken it
        self.fetched: object = None  # the event after its copy back

    def send(self, stream: object) -> bool:
        """Queue the copy to a pinned host buffer on ``stream`` and let go of the device tensor; False (staying
        held) when the pool is at its cap."""
        tensor = self.tensor
        if tensor is None or self.buffer is not None:
            return True
        buffer = self.pool.take(self.nbytes)
        if buffer is None:
            return False
        flat, last_use = buffer
        if last_use is not None:
            self.link.wait(stream, last_use)  # the buffer's previous copy back must have read it
        shape, stride, dtype = self.layout
        with _compat.no_modes():  # offload's own ops are not the program's
            self.host = flat[: self.nbytes].view(dtype).as_strided(shape, stride)
            self.link.copy(stream, self.host, tensor)
        self.buffer, self.tensor = buffer, None
        return True

    def fetch(self) -> None:
        """Queue the copy back into a new device tensor on the to-device stream, after the copy to the host."""
        if self.tensor is not None or self.copy is not None or self.host is None:
            return
        stream = self.link.side_streams(self.device)[1]
        self.link.wait(stream, self.sent)
        with _compat.no_modes():
            self.copy = self.link.device_empty(self.device, self.layout, stream)
            self.link.copy(stream, self.copy, self.host)
        self.fetched = self.link.record(stream)

    def take(self, final: bool) -> Tensor:
        """The tensor on the device, for one reader: the compute stream waits for its copy back only (fetched now
        if it was not). ``final``: this reader will not read it again."""
        with LOCK:
            t = self.tensor
            if t is None:
                self.fetch()
                t = self.copy
                if t is None:
                    raise InternalError(messages.internal_error(messages.PARCEL_RELEASED))
                compute = self.link.compute_stream(self.device)
                self.link.wait(compute, self.fetched)
                self.link.used_on(t, compute)
                self.takes += 1
                if self.takes % self.users == 0:
                    self.copy = None  # each reader has it: the next backward copies it back again
            if final:
                self.finals += 1
                if self.finals >= self.users:
                    self.release()
            return t

    def release(self) -> None:
        """Nobody reads it again: the host buffer goes back to the pool, the device tensor is let go."""
        buffer, self.buffer, self.host, self.tensor, self.copy = self.buffer, None, None, None, None
        if buffer is not None:
            self.pool.give_back((buffer[0], self.fetched if self.fetched is not None else self.sent))

    def __del__(self) -> None:
        if self.buffer is not None:
            self.release()


def layout(t: Tensor) -> Layout:
    """The layout a copy of ``t`` takes: ``t``'s own where its elements fill their memory once each (a transpose,
    a permutation: what ``empty_like`` keeps), else contiguous (an expanded or sliced view copies only its
    elements)."""
    shape, stride = tuple(t.shape), tuple(t.stride())
    expected = 1
    for n, st in sorted(((n, st) for n, st in zip(shape, stride, strict=True) if n != 1), key=lambda d: d[1]):
        if st != expected:
            contiguous, step = [], 1
            for n_ in reversed(shape):
                contiguous.append(step)
                step *= max(n_, 1)
            return shape, tuple(reversed(contiguous)), t.dtype
        expected *= n
    return shape, stride, t.dtype
