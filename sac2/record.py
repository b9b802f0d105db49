"""The record one checkpointed forward leaves for its recompute, and what its saved entries hold.

The record is a plain list, one entry per op in call order: the op's replay key (recompute it) or a ``Saved``
entry (serve it). A ``Saved`` entry holds detached aliases of what the op returned and wrote, the generator
states around it, and, for CPU offload or user saved-tensor hooks, packed copies.

While the forward runs, the record also tracks which storages its saved entries live in. Any later write into
one of those storages (an in-place op, ``out=``, a HOP or Triton kernel, through any alias: a view, a factory
op's Python-side tensor, matmul's ``_unsafe_view``) makes the entry stale, so it is recomputed instead of served.
The lookup is one dict access per written tensor: flat in the length of the region. Writes after the forward
are seen through version counters, which every served alias shares.
"""

from __future__ import annotations

from typing import Any

import torch

from sac2 import _compat, writes
from sac2._compat import tree_map
from sac2.answers import op_name
from sac2.keys import Region
from sac2.notices import stale_in_forward, warn_once

__all__ = ["Saved", "Record", "keep", "served", "rng_before", "GeneratorState"]

Tensor = torch.Tensor
_detach = _compat.detach_keeping_version

#: (generator, state before the op, state after it): serving moves the generator only from before to after.
GeneratorState = tuple[torch.Generator, Tensor, Tensor]


class _ArgRef:
    """Stands, in a saved output, for an output that is one of the op's own (written) arguments."""

    __slots__ = ("path",)

    def __init__(self, path: writes.Path) -> None:
        self.path = path


class Saved:
    """A saved op in the record: its key, its detached outputs, what it wrote and the generator it moved."""

    __slots__ = ("key", "out", "tensors", "versions", "writes", "rng", "offload", "stale", "hooks", "packed")

    def __init__(self, key: Any) -> None:
        self.key = key
        self.out: Any = None
        # Tuples, not lists: a long region holds thousands of entries, and every container the garbage collector
        # tracks makes its collections (which run during the forward) slower.
        self.tensors: tuple[Tensor, ...] = ()
        self.versions: tuple[int, ...] = ()
        self.writes: tuple[tuple[writes.Path, Tensor], ...] | None = ()  # None: a region wrote where sac2 can't see
        self.rng: GeneratorState | None = None
        self.offload: Any = None  # True while a CPU_OFFLOAD entry's forward runs, then sac2.offload's state
        self.stale = False  # written into later in the forward: recompute instead
        self.hooks: tuple[Any, Any] | None = None  # the user's saved-tensor hooks the entry was packed with
        self.packed: Any = None

    def record_versions(self) -> None:
        self.versions = tuple([t._version for t in self.tensors])

    def watch(self, alias: Tensor) -> None:
        """Also see in-place writes through ``alias``, which shares a storage but not a version counter."""
        self.tensors += (_detach(alias),)
        self.versions += (alias._version,)

    def modified(self) -> bool:
        if self.stale:
            return True
        for t, v in zip(self.tensors, self.versions):
            if t._version != v:
                return True
        return False

    def restore(self, args: tuple, kwargs: dict) -> None:
        """Serving: leave the generator and the written arguments as running the op would have.

        The generator moves only when recompute is replaying forward's random stream (``preserve_rng_state``):
        then it stands where it stood before the op. Otherwise backward leaves every generator alone.
        """
        if self.rng is not None:
            gen, before, after = self.rng
            if torch.equal(gen.get_state(), before):
                gen.set_state(after)
        for path, saved in self.writes:
            target = writes.locate(args, kwargs, path)
            if target.shape != saved.shape or target.stride() != saved.stride():
                _resize_like(target, saved)  # an out= op resized its output: do as it did, layout included
            target.copy_(saved)

    def pack(self, hooks: tuple[Any, Any]) -> None:
        """Hand the entry's tensors to the user's saved-tensor hooks (e.g. ``save_on_cpu``) until it is served."""
        pack_hook = hooks[0]

        def one(x: Any) -> Any:
            return _Packed(pack_hook(x)) if isinstance(x, Tensor) else x

        self.hooks = hooks
        self.packed = (tree_map(one, self.out), [(p, _Packed(pack_hook(t))) for p, t in self.writes])
        self.out, self.writes = None, ()
        self.tensors, self.versions = (), ()  # what the hooks hold is theirs: sac2 no longer watches it

    def unpack(self) -> None:
        """Put what the hooks kept back into the entry (the packed form stays, for another backward)."""
        unpack_hook = self.hooks[1]

        def one(x: Any) -> Any:
            return unpack_hook(x.value) if type(x) is _Packed else x

        out, written = self.packed
        self.out = tree_map(one, out, is_leaf=lambda x: type(x) is _Packed)
        self.writes = tuple([(p, one(t)) for p, t in written])


def _resize_like(target: Tensor, saved: Tensor) -> None:
    """Give ``target`` the sizes and strides of ``saved``, as an ``out=`` op resizing an empty output does (it may
    take its input's layout, e.g. a transposed one, which later ops such as matmul's reshape depend on)."""
    extent = 1 + sum((n - 1) * st for n, st in zip(saved.shape, saved.stride()) if n > 0) if saved.numel() else 0
    target.resize_(extent)
    target.as_strided_(saved.shape, saved.stride())


class _Packed:
    """What a user's pack hook returned for one tensor (any object: kept opaque for tree_map)."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value


class Record:
    """What one forward ran: per op, its key (recompute) or a ``Saved`` entry, in call order.

    ``saved_at`` lists the positions of saved op entries (regions are not in it); while the forward runs,
    ``by_storage`` maps each storage a saved entry holds to the entry holding it (a list when several do).
    """

    __slots__ = ("log", "saved_at", "by_storage", "packed")

    def __init__(self) -> None:
        self.log: list[Any] = []
        self.saved_at: list[int] = []
        self.by_storage: dict[int, Saved | list[Saved]] = {}
        self.packed = False  # some entries are held by the user's saved-tensor hooks

    def pack(self, hooks: tuple[Any, Any]) -> None:
        """At the end of forward: hand every saved entry not offloaded (ops and regions) to the user's hooks."""
        for e in self.log:
            # A region that wrote where sac2 cannot see runs again in recompute: it has nothing to hand over.
            if type(e) is Saved and not e.offload and e.writes is not None:
                e.pack(hooks)
        self.packed = True

    def unpack(self) -> None:
        """At the start of each recompute: take back what the hooks hold (no-op when nothing was packed)."""
        if self.packed:
            for e in self.log:
                if type(e) is Saved and e.hooks is not None:
                    e.unpack()

    def key_at(self, i: int) -> Any:
        e = self.log[i]
        return e.key if type(e) is Saved else e

    def describe(self, i: int) -> str:
        """``aten.mm.default (call 2 of that op, op 7 of the region)``: how errors name a position."""
        key = self.key_at(i)
        nth = sum(1 for j in range(i) if self.key_at(j) is key)
        return f"{op_name(key)} (call {nth} of that op, op {i} of the region)"

    def track(self, entry: Saved) -> None:
        """Watch the storages ``entry`` holds for later writes in this forward."""
        by_storage = self.by_storage
        for t in entry.tensors:
            k = _compat.storage_id(t)
            if k is not None:
                hit = by_storage.get(k)
                if hit is None:
                    by_storage[k] = entry
                elif type(hit) is Saved:
                    if hit is not entry:
                        by_storage[k] = [hit, entry]
                elif hit[-1] is not entry:
                    hit.append(entry)

    def wrote(self, tensors: list[Tensor]) -> None:
        """An op of the forward wrote into ``tensors``: saved entries holding their storages are stale."""
        by_storage = self.by_storage
        for t in tensors:
            hit = by_storage.get(_compat.storage_id(t))
            if type(hit) is Saved:
                hit.stale = True
            elif hit is not None:
                for entry in hit:
                    entry.stale = True

    def holders(self, t: Tensor) -> list[Saved]:
        """The saved entries holding ``t``'s storage."""
        hit = self.by_storage.get(_compat.storage_id(t))
        return [hit] if type(hit) is Saved else (hit or [])

    def stop_tracking(self) -> None:
        self.by_storage = {}

    def drop_modified(self) -> None:
        """At the end of forward: saved outputs a later op wrote into are recomputed instead (warned once)."""
        kept = []
        for i in self.saved_at:
            entry = self.log[i]
            if type(entry.key) is not Region and entry.modified():  # regions: replay_region checks them
                warn_once("modified-in-forward", entry.key, stale_in_forward(self.describe(i), bool(entry.writes)))
                self.log[i] = entry.key
            else:
                kept.append(i)
        self.saved_at = kept


def keep(entry: Saved, out: Any, written: list[tuple[writes.Path, Tensor]]) -> None:
    """Fill a saved entry: detached aliases of what the op wrote and of its outputs (written arguments among the
    outputs become ``_ArgRef``s, served as the replayed arguments)."""
    paths = {id(t): path for path, t in written}
    entry.writes = tuple([(path, _detach(t)) for path, t in written])
    tensors: list[Tensor] = []
    entry.out = _detached(out, paths, tensors)
    entry.tensors = (*tensors, *(t for _, t in entry.writes))


def rng_before(info_random: bool, args: tuple, kwargs: dict) -> tuple[torch.Generator, Tensor] | None:
    """The generator a random op or HOP is about to draw from, and its state now (None for ops that draw nothing)."""
    if not info_random:
        return None
    gen = kwargs.get("generator") or _compat.default_generator(_device_of(args, kwargs))
    return gen, gen.get_state()


def rng_moved(before: tuple[torch.Generator, Tensor] | None) -> GeneratorState | None:
    """(generator, state before the call, state after it); serving compares, so an unmoved one costs no more."""
    if before is None:
        return None
    gen, state = before
    return gen, state, gen.get_state()


def _device_of(args: tuple, kwargs: dict) -> torch.device:
    for x in args:
        if isinstance(x, Tensor):
            return x.device
    device = kwargs.get("device")
    return torch.device(device) if device is not None else torch.device("cpu")


def _detached(out: Any, written: dict[int, writes.Path], tensors: list[Tensor]) -> Any:
    """``out`` with tensors detached (collected into ``tensors``) and written arguments as ``_ArgRef``s."""

    def one(x: Any) -> Any:
        if not isinstance(x, Tensor):
            return x
        path = written.get(id(x))
        if path is not None:
            return _ArgRef(path)
        d = _detach(x)
        tensors.append(d)
        return d

    if type(out) is Tensor:
        return one(out)
    if type(out) is tuple:
        return tuple(one(x) for x in out)
    return tree_map(one, out)


def served(out: Any, args: tuple, kwargs: dict) -> Any:
    """A fresh alias of each saved tensor (autograd attaches history to what a mode returns) and the replayed
    arguments in place of ``_ArgRef``s."""

    def one(x: Any) -> Any:
        if type(x) is _ArgRef:
            return writes.locate(args, kwargs, x.path)
        return _detach(x) if isinstance(x, Tensor) else x

    if type(out) is Tensor:
        return _detach(out)
    if type(out) is tuple:
        return tuple(one(x) for x in out)
    return tree_map(one, out, is_leaf=lambda x: type(x) is _ArgRef)


def stored_leaves(out: Any) -> list[Any]:
    """The leaves of a saved output, ``_ArgRef``s included."""
    return _compat.tree_leaves(out, is_leaf=lambda x: type(x) is _ArgRef)
