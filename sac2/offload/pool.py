"""Pinned host buffers, reused step after step within a cap on the pinned memory they hold.

Allocating pinned memory per tensor per step (``empty_like(..., pin_memory=True)``) is a host allocation each time,
and a fresh one (``cudaHostAlloc``) is slow and stalls the device; a training step offloads the same sizes every
step, so a buffer given back after backward serves the next step's forward. A buffer goes back with the event of
its last copy: the next copy into it waits for that event on its stream, never on the host.

``take`` finds a buffer of the exact size, else allocates one while the pool holds less than the cap, else lends a
larger free one, else drops free buffers of other sizes to make room; at the cap with every buffer lent, it
answers None and the tensor stays on the device.
"""

from __future__ import annotations

import threading

import torch

from sac2.offload.link import Link

__all__ = ["Pool", "Buffer"]

Tensor = torch.Tensor
#: A pinned buffer (uint8) and the event its last copy recorded (None: never copied).
Buffer = tuple[Tensor, object | None]


class Pool:
    """Pinned host buffers of one link, by size in bytes. ``cap``: the most pinned bytes it holds, lent and free
    together (None: no cap). ``held``: the bytes it holds now; ``allocations``: host allocations made so far."""

    def __init__(self, link: Link, cap: int | None) -> None:
        self.link = link
        self.cap = cap
        self.held = 0
        self.allocations = 0
        self._free: dict[int, list[Buffer]] = {}
        self._lock = threading.RLock()  # a parcel collected while the pool works gives its buffer back

    def take(self, nbytes: int) -> Buffer | None:
        """A buffer of at least ``nbytes`` bytes, lent until ``give_back``; None at the cap."""
        with self._lock:
            same = self._free.get(nbytes)
            if same:
                return same.pop()
            if self._room(nbytes):
                return self._allocate(nbytes)
            larger = min((n for n, bufs in self._free.items() if n > nbytes and bufs), default=None)
            if larger is not None:
                return self._free[larger].pop()
            self._drop_free(nbytes)
            return self._allocate(nbytes) if self._room(nbytes) else None

    def give_back(self, buffer: Buffer) -> None:
        """A lent buffer is free again once its last copy (the event with it) has run."""
        with self._lock:
            nbytes = buffer[0].numel()
            if self.cap is not None and self.held > self.cap:  # the cap was lowered while it was lent
                self.held -= nbytes
                return
            self._free.setdefault(nbytes, []).append(buffer)

    def set_cap(self, cap: int | None) -> None:
        """Hold at most ``cap`` pinned bytes from now on: free buffers beyond it go now, lent ones when given back."""
        with self._lock:
            self.cap = cap
            self._drop_free(0)

    def free_bytes(self) -> int:
        """The bytes of the buffers not lent now."""
        with self._lock:
            return sum(n * len(bufs) for n, bufs in self._free.items())

    def _room(self, nbytes: int) -> bool:
        return self.cap is None or self.held + nbytes <= self.cap

    def _allocate(self, nbytes: int) -> Buffer:
        self.held += nbytes
        self.allocations += 1
        return self.link.host_buffer(nbytes), None

    def _drop_free(self, nbytes: int) -> None:
        """Drop free buffers, largest first, until ``nbytes`` more fit under the cap."""
        for n in sorted(self._free, reverse=True):
            bufs = self._free[n]
            while bufs and not self._room(nbytes):
                bufs.pop()  # torch's host allocator keeps it until its recorded copies have run
                self.held -= n
            if not bufs:
                del self._free[n]
