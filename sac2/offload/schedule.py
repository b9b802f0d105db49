"""When offload's copies run: one ``Block`` per checkpointed forward, its parcels sent to the host and fetched back
at the points of the step where the copies hide behind compute.

- **To the host** when the next checkpointed forward starts (``begin``): the copy runs while that block computes,
  after the block's own kernels (its ``ready`` event). The last block of a forward has no next one before backward
  starts, so its tensors stay on the device and backward reads them with no copy at all.
- **Back** when backward reaches a block (``reached``: its recompute starts): its own parcels not yet back are
  fetched, then those of the block backward reaches next, while this one runs, within the prefetch allowance (by
  default the next block with parcels, whole; ``set_limits``). Which block that is comes from the autograd graph,
  not from forward order: each block knows the blocks whose outputs its inputs are (``preds``: the nodes that made
  them, by their sequence numbers, inside a block's range), so gradient accumulation, pipeline schedules (forward of
  several micro-batches, then their backwards in any order) and a second backward each prefetch what they read.
- Reading a parcel waits for its own copy only; the host buffer goes back to the pool once its readers are done.

Blocks are per thread (a forward's sequence numbers are its thread's); a block made in backward (a nested
checkpoint's forward inside a recompute) keeps its tensors on the device, as they are read moments later.
"""

from __future__ import annotations

import collections
import os
import threading
import weakref
from typing import Any, NamedTuple

import torch

from sac2 import _compat, messages
from sac2.core.notices import warn_once
from sac2.offload import link as links
from sac2.offload.parcel import LOCK, Parcel
from sac2.offload.pool import Pool

__all__ = [
    "Block", "Limits", "use", "begin", "end", "abandon", "forget", "in_frame", "current", "reached", "set_limits",
    "limits", "pool", "host_bytes",
]

Tensor = torch.Tensor
#: How many finished blocks per thread a new block looks its producers up among, and how many autograd nodes it
#: walks through between blocks (ops no checkpoint holds) to find them.
_REMEMBERED, _WALK = 1024, 64


class Limits(NamedTuple):
    """``host_memory``: the most pinned host bytes offload holds (None: half the machine's memory). ``prefetch``:
    the most bytes copied back ahead of the block backward runs (None: the next block with parcels, whole)."""

    host_memory: int | None
    prefetch: int | None


class Block:
    """The parcels of one checkpointed forward, and its place in the graph: ``start``/``end``, the sequence numbers of
    the autograd nodes its forward made; ``preds``, the blocks whose outputs its inputs are, latest first."""

    __slots__ = ("link", "parcels", "keys", "start", "end", "preds", "ready", "pending", "__weakref__")

    def __init__(self, link: links.Link, start: int) -> None:
        self.link = link
        self.parcels: list[Parcel] = []
        self.keys: dict[tuple[Any, ...], Parcel] = {}  # while the forward runs: one parcel per tensor
        self.start, self.end = start, start
        self.preds: list[weakref.ref[Block]] = []
        self.ready: dict[torch.device, object] = {}  # per device, the compute stream's event at the forward's end
        self.pending = False  # ended, not yet sent: the last block so far

    def add(self, t: Tensor, rank: int) -> Parcel | None:
        """The parcel that moves ``t`` (one per tensor: a second reader shares it), or None where ``t`` stays put
        (not on the link's device, or empty)."""
        device = self.link.device_of(t)
        if device is None or not t.numel():
            return None
        key = (_compat.storage_id(t), t.storage_offset(), t.shape, t.stride(), t.dtype)
        with LOCK:
            p = self.keys.get(key)
            if p is not None:
                p.users += 1
                return p
            p = self.keys[key] = Parcel(self.link, pool(self.link), device, t, rank)
            self.parcels.append(p)
        return p

    def pred(self) -> Block | None:
        """The latest block whose output this one's input is, if it is still alive."""
        for ref in self.preds:
            b = ref()
            if b is not None:
                return b
        return None

    def send(self) -> None:
        """Queue every parcel's copy to the host on its device's side stream, after the forward's own kernels."""
        if not self.pending:
            return
        self.pending = False
        for device, ready in self.ready.items():
            stream = self.link.side_streams(device)[0]
            self.link.wait(stream, ready)
            parcels = [p for p in self.parcels if p.device == device]
            sent = [p for p in parcels if p.send(stream)]
            if len(sent) < len(parcels):
                cap = pool(self.link).cap
                warn_once("offload-host-memory", "pool", messages.offload_host_memory_full(cap or 0))
            event = self.link.record(stream)
            for p in sent:
                p.sent = event

    def fetch(self, allowance: int | None, ahead: int) -> int | None:
        """Queue the copies back of parcels on the host, in the order backward reads them, while ``ahead`` (the bytes
        already back ahead of backward) stays within ``allowance`` (None: all of them). Returns the new ``ahead``,
        or None when the allowance stopped it."""
        for p in self.parcels:
            if p.copy is not None:
                ahead += p.nbytes
            elif p.host is not None:
                if allowance is not None and ahead + p.nbytes > allowance:
                    return None
                p.fetch()
                ahead += p.nbytes
        return ahead


class _Thread(threading.local):
    def __init__(self) -> None:
        self.stack: list[Block | None] = []  # the forwards running in this thread, innermost last
        self.pending: list[weakref.ref[Block]] = []  # ended, not yet sent (a block whose graph is gone: never)
        self.done: collections.deque[weakref.ref[Block]] = collections.deque(maxlen=_REMEMBERED)


_thread = _Thread()
_pools: weakref.WeakKeyDictionary[links.Link, Pool] = weakref.WeakKeyDictionary()
_in_use = [False]


def _half_of_memory() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2
    except (AttributeError, ValueError, OSError):  # no sysconf (Windows), or no such name
        return None


_DEFAULT_HOST_MEMORY = _half_of_memory()
_limits = [Limits(None, None)]


def use() -> None:
    """Something asked for offload: checkpointed forwards become blocks from now on (before, they cost nothing)."""
    _in_use[0] = True


def pool(link: links.Link) -> Pool:
    """The pinned host buffers of ``link``."""
    p = _pools.get(link)
    if p is None:
        host = _limits[0].host_memory
        p = _pools[link] = Pool(link, _DEFAULT_HOST_MEMORY if host is None else host)
    return p


def host_bytes(link: links.Link) -> int:
    """The pinned bytes ``link``'s pool has lent now: what offloaded tensors hold in host memory (0: no pool yet)."""
    p = _pools.get(link)
    return 0 if p is None else p.held - p.free_bytes()


def limits() -> Limits:
    """Offload's limits now (``set_limits``)."""
    return _limits[0]


def set_limits(new: Limits) -> Limits:
    """Set offload's limits (``Limits``); return the ones they replace."""
    for name, value in new._asdict().items():
        if value is not None and (type(value) is not int or value < 0):
            raise ValueError(messages.bad_offload_limit(name, value))
    old, _limits[0] = _limits[0], new
    for p in list(_pools.values()):
        p.set_cap(_DEFAULT_HOST_MEMORY if new.host_memory is None else new.host_memory)
    return old


def begin(args: tuple[Any, ...]) -> Block | None:
    """A checkpointed forward starts: send the blocks whose forwards ended before it, and make its block, linked to
    the blocks its tensor ``args`` came out of. None while nothing asked for offload."""
    local = _thread
    if not _in_use[0]:
        local.stack.append(None)
        return None
    backward = _compat.graph_task() is not None
    if local.pending and not backward:
        with LOCK:
            for ref in local.pending:
                b = ref()
                if b is not None:
                    b.send()
        local.pending.clear()
    block = Block(links.current(), _compat.sequence_nr())
    if not backward:
        block.preds = _producers(args, local.done)
    local.stack.append(block)
    return block


def end() -> None:
    """The innermost checkpointed forward of this thread ended: its block waits to be sent (``begin``)."""
    local = _thread
    block = local.stack.pop()
    if block is None:
        return
    block.end, block.keys = _compat.sequence_nr(), {}
    backward = _compat.graph_task() is not None
    if block.start >= 0 and not backward:
        local.done.append(weakref.ref(block))
    if block.parcels:
        block.parcels.sort(key=_rank)
        for device in {p.device for p in block.parcels}:
            block.ready[device] = block.link.record(block.link.compute_stream(device))
        if not backward:
            block.pending = True
            local.pending.append(weakref.ref(block))


def forget(link: links.Link) -> None:
    """``link`` is no longer used (a stand-in's block ended): this thread sends none of its blocks later."""
    local = _thread
    local.pending = [ref for ref in local.pending if (b := ref()) is not None and b.link is not link]


def abandon() -> None:
    """The innermost checkpointed forward of this thread raised: its block is dropped, its tensors stay put."""
    _thread.stack.pop()


def in_frame() -> bool:
    """Whether a checkpointed forward on sac2's frame runs in this thread (torch's frame makes no block)."""
    return bool(_thread.stack)


def current() -> Block | None:
    """The block of the innermost checkpointed forward running in this thread (made now for one that started before
    anything asked for offload); None outside sac2's frame."""
    stack = _thread.stack
    if not stack:
        return None
    block = stack[-1]
    if block is None:
        use()
        block = stack[-1] = Block(links.current(), -1)  # no range: no block finds it as a producer
    return block


def reached(block: Block) -> None:
    """Backward reached ``block`` (its recompute starts): fetch what it reads, then prefetch what the block(s)
    backward reaches next will, within the allowance."""
    allowance = _limits[0].prefetch
    with LOCK:
        block.pending = False  # the last block: read where it is
        block.fetch(None, 0)
        ahead: int | None = 0
        b = block.pred()
        while b is not None and ahead is not None:
            b.pending = False  # not sent yet (a later forward has not started): read where it is too
            had = any(p.host is not None or p.copy is not None for p in b.parcels)
            ahead = b.fetch(allowance, ahead)
            if allowance is None and had:
                return  # the default: the next block with parcels
            b = b.pred()


def _rank(p: Parcel) -> int:
    return p.rank


def _producers(args: tuple[Any, ...], done: collections.deque[weakref.ref[Block]]) -> list[weakref.ref[Block]]:
    """The blocks whose outputs the tensors among ``args`` are (through ops between blocks), latest first."""
    found: list[Block] = []
    for a in args:
        node = a.grad_fn if isinstance(a, Tensor) else None
        if node is not None:
            b = _producer(node, done)
            if b is not None and b not in found:
                found.append(b)
    found.sort(key=_start, reverse=True)
    return [weakref.ref(b) for b in found]


def _start(b: Block) -> int:
    return b.start


def _producer(node: Any, done: collections.deque[weakref.ref[Block]]) -> Block | None:
    """The block whose forward made ``node``, or the one that made the nodes ``node`` was made from, looking
    through at most ``_WALK`` nodes made after the latest block ended."""
    latest = done[-1]() if done else None
    if latest is None:
        return None
    queue, walked = collections.deque([node]), 0
    while queue and walked < _WALK:
        n = queue.popleft()
        walked += 1
        seq = _compat.node_sequence_nr(n)
        if seq < latest.end:
            b = _block_at(seq, done)
            if b is not None:
                return b
            continue
        queue.extend(f for f, _ in n.next_functions if f is not None)
    return None


def _block_at(seq: int, done: collections.deque[weakref.ref[Block]]) -> Block | None:
    """The latest finished block whose range holds ``seq`` (an outer block before those nested in it)."""
    for ref in reversed(done):
        b = ref()
        if b is not None and b.start <= seq < b.end:
            return b
    return None
