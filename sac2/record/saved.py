"""One saved op or ``sac2.region`` call of a checkpoint's record: what serving it in recompute needs, and where its
values are (its ``State``).

An entry holds detached aliases of what the call returned and wrote, the generator states around it, and, for CPU
offload or the user's saved-tensor hooks, what carries its tensors (offload's parcels, ``sac2.offload``) or what the
hooks made of them. Its state says which of those it holds and so how
it is served; every change of state is a method of ``Saved`` that raises ``InternalError`` where its lifecycle
has no such step::

    HELD --mark_stale--> STALE            (a later write in the forward; STALE --mark_stale--> STALE too)
    HELD --offload_at_end--> OFFLOAD_PENDING --to_host--> ON_HOST  (back to HELD if no tensor is on a device)
                             OFFLOAD_PENDING --mark_stale--> STALE
    HELD --pack--> PACKED
    HELD --keep_region(written=None)--> RERUN

ON_HOST, PACKED and RERUN last for every recompute (a backward that keeps its graph serves them again); the record
forgets a STALE entry when the forward ends. It lives apart from the record (``sac2.record.record``), which only orders
entries, and from the storage tracker (``sac2.record.record.StorageTracker``), which marks them stale.
"""

from __future__ import annotations

import enum
from typing import Any, Callable, final

import torch

from sac2 import _compat, messages
from sac2._compat import tree_map
from sac2.core import writes
from sac2.core.keys import Key
from sac2.core.notices import warn_once
from sac2.core.rng import GeneratorState
from sac2.frame.inplace_check import hooks_keep
from sac2.messages.internal import InternalError
from sac2.offload import link as offload_link
from sac2.offload import schedule
from sac2.offload.parcel import Parcel

__all__ = ["State", "Saved"]

Tensor = torch.Tensor
#: (path, detached tensor) per argument a call wrote.
Written = tuple[tuple[writes.Path, Tensor], ...]
#: The user's (pack, unpack) saved-tensor hooks.
Hooks = _compat.HookPair
_detach = _compat.detach_keeping_version


class State(enum.Enum):
    """Where a saved entry's values are, and so what serving it takes."""

    HELD = "detached aliases on their device, watched for in-place writes (nothing watched under tracing)"
    STALE = "written into later in the forward: recomputed instead of served"
    OFFLOAD_PENDING = "answered CPU_OFFLOAD while the forward still runs: held as HELD until it ends"
    ON_HOST = "its device tensors in offload's parcels (sac2.offload): in pinned host memory, copied back for recompute"
    PACKED = "held by the user's saved-tensor hooks, unpacked before each recompute"
    RERUN = "a region that wrote where sac2 cannot see: replay runs it again"


# The per-op paths compare against these: reading a member off its Enum class costs a few times a global's lookup.
_HELD, _STALE, _OFFLOAD_PENDING = State.HELD, State.STALE, State.OFFLOAD_PENDING
_ON_HOST, _PACKED, _RERUN = State.ON_HOST, State.PACKED, State.RERUN


class _ArgRef:
    """Stands, in a saved output, for an output that is one of the op's own (written) arguments."""

    __slots__ = ("path",)

    def __init__(self, path: writes.Path) -> None:
        self.path = path


class _Packed:
    """What a user's pack hook returned for one tensor (any object: kept opaque for tree_map), and the tensor's
    strides: served with others (a hook's restrided copy), ``matmul`` would fold another way in recompute."""

    __slots__ = ("value", "stride")

    def __init__(self, value: object, tensor: Tensor) -> None:
        self.value = value
        self.stride = _compat.plain_strides(tensor)

    def unpack(self, unpack_hook: Callable[[Any], Any]) -> Tensor:
        t = _compat.restrided(unpack_hook(self.value), self.stride)
        if not isinstance(t, Tensor):
            raise TypeError(messages.unpack_hook_returned(type(t).__name__))
        return _detach(t)


@final  # so that ``type(e) is Saved`` tells a record entry from a key both ways
class Saved:
    """A saved op (or ``sac2.region`` call) in the record: what serving it in recompute needs.

    ``state``: its ``State``. ``out``: detached outputs, written arguments among them as ``_ArgRef``s. ``writes``:
    (path, detached tensor) per argument the call wrote. ``tensors``/``versions``: the aliases watched for
    in-place changes and their versions. ``requires_grad``: for regions, which outputs required grad (served ones
    must too). ``rng``: the generator it moved. ``host``: its outputs and writes with offload's parcels for their
    device tensors (ON_HOST). ``hooks``/``packed``: the user's saved-tensor hooks and what they hold (PACKED).
    """

    __slots__ = (
        "key", "state", "out", "tensors", "versions", "writes", "requires_grad", "rng", "host", "hooks",
        "packed", "rebuilt",
    )

    def __init__(self, key: Key) -> None:
        self.key = key
        self.state = _HELD
        self.out: Any = None
        # Tuples, not lists: a long region holds thousands of entries, and every container the garbage collector
        # tracks makes its collections (which run during the forward) slower.
        self.tensors: tuple[Tensor, ...] = ()
        self.versions: tuple[int, ...] = ()
        self.writes: Written = ()
        self.requires_grad: tuple[bool, ...] | None = None
        self.rng: GeneratorState | None = None
        self.host: tuple[Any, tuple[tuple[writes.Path, Any], ...]] | None = None
        self.hooks: Hooks | None = None
        #: What the hooks hold: the outputs with ``_Packed`` for tensors, and (path, ``_Packed``) per write.
        self.packed: tuple[Any, list[tuple[writes.Path, _Packed]]] | None = None
        #: A saved region's body saves that recompute rebuilds from its inputs (``sac2.record.regions``), or
        #: None.
        self.rebuilt: Any = None

    @property
    def unseen_writes(self) -> bool:
        """A region that wrote where sac2 cannot see (RERUN): replay runs it again."""
        return self.state is _RERUN

    def _move(self, to: State, *legal: State) -> None:
        """Go to state ``to``, from one of the ``legal`` states only."""
        if self.state not in legal:
            raise InternalError(messages.internal_error(messages.illegal_transition(self.state.name, to.name)))
        self.state = to

    # --- forward -----------------------------------------------------------------------------------------
    def keep_output(self, out: Tensor) -> None:
        """Keep a functional op's one output (the per-op short path)."""
        d = _detach(out)
        self.out = d
        self.tensors = (d,)

    def keep(self, out: Any, written: list[tuple[writes.Path, Tensor]]) -> None:
        """Keep detached aliases of what the call wrote and of its outputs (written arguments among the outputs
        become ``_ArgRef``s, served as the replayed arguments)."""
        paths = {id(t): path for path, t in written}
        self.writes = tuple([(path, _detach(t)) for path, t in written])
        tensors: list[Tensor] = []
        self.out = _detached(out, paths, tensors)
        self.tensors = (*tensors, *(t for _, t in self.writes))

    def keep_traced(self, out: Any) -> None:
        """Keep what a traced op returned (torch.compile tracing: the partitioner decides what is kept, nothing
        is watched)."""
        self.out = tree_map(lambda x: _detach(x) if isinstance(x, Tensor) else x, out)

    def keep_region(self, out: Any, written: list[tuple[writes.Path, Tensor]] | None) -> None:
        """Keep a region call's outputs and writes (None: it wrote where sac2 cannot see, so replay runs it
        again: HELD to RERUN), and which outputs required grad."""
        if written is None:
            self._move(_RERUN, _HELD)
        if not written and type(out) is Tensor:  # the common call (a Linear's): one output, nothing written
            self.keep_output(out)
            self.requires_grad = (out.requires_grad,)
            self.record_versions()
            return
        self.keep(out, written or [])
        ids = {id(t) for _, t in written or []}
        leaves = (out,) if type(out) is Tensor else _compat.tree_leaves(out)
        self.requires_grad = tuple(t.requires_grad for t in leaves if isinstance(t, Tensor) and id(t) not in ids)
        self.record_versions()

    def watch(self, alias: Tensor) -> None:
        """Also see in-place writes through ``alias``, which shares a storage but not a version counter."""
        self.tensors += (_detach(alias),)
        self.versions += (_compat.version(alias),)

    def record_versions(self) -> None:
        self.versions = _compat.versions(self.tensors)

    def modified(self) -> bool:
        """Whether what the entry serves was written in place since it was kept. For a PACKED entry, only where
        the hooks keep the tensors themselves (probed then): a copy the hooks made is what backward reads."""
        if self.state is _STALE:
            return True
        if _compat.versions(self.tensors) == self.versions:
            return False
        return self.state is not _PACKED or self.hooks is None or hooks_keep(self.hooks, self.tensors[0].device, {})

    def mark_stale(self) -> None:
        """A later op of the forward wrote into what the entry holds: recompute it instead (HELD or
        OFFLOAD_PENDING to STALE; STALE stays)."""
        state = self.state  # not _move: each write into a saved storage calls this, and _move's varargs allocate
        if state is not _HELD and state is not _OFFLOAD_PENDING and state is not _STALE:
            raise InternalError(messages.internal_error(messages.illegal_transition(state.name, _STALE.name)))
        self.state = _STALE

    def offload_at_end(self) -> None:
        """Answered CPU_OFFLOAD: move to the host when the forward ends (HELD to OFFLOAD_PENDING)."""
        self._move(_OFFLOAD_PENDING, _HELD)

    # --- between forward and backward ----------------------------------------------------------------------
    def to_host(self) -> None:
        """CPU_OFFLOAD, at the end of forward: hand the device tensors to offload's parcels in the forward's block,
        which the schedule moves to the host and back (OFFLOAD_PENDING to ON_HOST), or, with nothing on a device,
        stay a plain save (to HELD). The versions stay watched, through witnesses (a copy may run later than a write
        after the forward: backward raises autograd's error, as for a saved tensor)."""
        self._move(_ON_HOST, _OFFLOAD_PENDING)  # checked before anything moves
        block = schedule.current()
        if block is None or not any(block.link.device_of(t) is not None for t in self.tensors):
            if block is None and any(offload_link.current().device_of(t) is not None for t in self.tensors):
                warn_once("offload-frame", "torch's frame", messages.OFFLOAD_NEEDS_SAC2_FRAME)  # no schedule there
            self.state = _HELD  # nothing on a device (or no schedule): a plain save
            return
        moved = []

        def one(x: Any) -> Any:
            p = block.add(x, 1) if isinstance(x, Tensor) else None
            if p is None:
                return x
            moved.append(p)
            return p

        out, written = tree_map(one, self.out), tuple([(p, one(t)) for p, t in self.writes])
        if not moved:
            self.state = _HELD  # only empty tensors: a plain save
            return
        self.host = (out, written)
        self.out, self.writes = out, written
        self.tensors = tuple([_witness(t) for t in self.tensors])

    def pack(self, hooks: Hooks) -> None:
        """Hand the entry's tensors to the user's saved-tensor hooks (e.g. ``save_on_cpu``) until it is served
        (HELD to PACKED). It still watches their versions, through witnesses that hold no storage: hooks that keep
        the tensors themselves (``save_on_cpu`` on CPU) hand back what a write after the forward changed."""
        self._move(_PACKED, _HELD)
        pack_hook = hooks[0]

        def one(x: object) -> object:
            return _Packed(pack_hook(x), x) if isinstance(x, Tensor) else x

        self.hooks = hooks
        self.packed = (tree_map(one, self.out), [(p, _Packed(pack_hook(t), t)) for p, t in self.writes])
        self.out, self.writes = None, ()
        self.tensors = tuple([_witness(t) for t in self.tensors])

    # --- recompute -----------------------------------------------------------------------------------------
    def unpack(self) -> None:
        """Put what the hooks kept back into the entry (it stays PACKED, for another backward)."""
        if self.state is not _PACKED or self.hooks is None or self.packed is None:
            raise InternalError(messages.internal_error(messages.NEVER_PACKED))
        unpack_hook = self.hooks[1]

        # Detached: what a hook hands back may be a view made in no-grad mode (a restrided copy), which autograd
        # forbids writing into in place once served as an op's output.
        def one(x: object) -> object:
            return x.unpack(unpack_hook) if type(x) is _Packed else x

        out, written = self.packed
        self.out = tree_map(one, out, is_leaf=lambda x: type(x) is _Packed)
        self.writes = tuple([(p, t.unpack(unpack_hook)) for p, t in written])

    def restore(self, args: tuple[Any, ...], kwargs: dict[str, Any], final: bool = False) -> None:
        """Serving: leave the generator and the written arguments as running the op would have.

        The generator moves only when recompute is replaying forward's random stream (``preserve_rng_state``):
        then it stands where it stood before the op. Otherwise backward leaves every generator alone. An offloaded
        entry takes its tensors back from its parcels first (``final``: it is served for the last time).
        """
        if self.state is _ON_HOST:
            out, written = self._host()

            def take(x: Any) -> Any:
                return x.take(final) if type(x) is Parcel else x

            self.out, self.writes = tree_map(take, out), tuple([(p, take(t)) for p, t in written])
        if self.rng is not None:
            gen, before, after = self.rng
            if torch.equal(gen.get_state(), before):
                gen.set_state(after)
        for path, saved in self.writes:
            target = writes.locate(args, kwargs, path)
            if target.shape != saved.shape or target.stride() != saved.stride():
                _resize_like(target, saved)  # an out= op resized its output: do as it did, layout included
            target.copy_(saved)

    def serve(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Fresh aliases of the saved outputs (autograd attaches history to what a mode returns), the replayed
        arguments in place of ``_ArgRef``s, and, for regions, the outputs' requires_grad as in forward."""
        out = self.out
        if type(out) is Tensor:
            result = _detach(out)
            if self.requires_grad is not None:
                result.requires_grad_(self.requires_grad[0])
            return result
        result = _served(out, args, kwargs)
        if self.requires_grad is not None:
            fresh = [t for o, t in zip(_stored_leaves(out), _compat.tree_leaves(result), strict=True)
                     if isinstance(o, Tensor)]
            for t, requires_grad in zip(fresh, self.requires_grad, strict=True):
                t.requires_grad_(requires_grad)
        return result

    def hand_over(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Serve for the last time: a single output tensor is handed over as it is (no fresh alias)."""
        out = self.out
        return out if type(out) is Tensor and self.requires_grad is None else self.serve(args, kwargs)

    def release(self) -> None:
        """After serving an offloaded entry another recompute may serve again: hold its parcels only."""
        if self.state is _ON_HOST:
            self.out, self.writes = self._host()

    def _host(self) -> tuple[Any, tuple[tuple[writes.Path, Any], ...]]:
        """What an ON_HOST entry holds: its outputs and writes with parcels for their device tensors."""
        if self.state is not _ON_HOST or self.host is None:
            raise InternalError(messages.internal_error(messages.NOT_OFFLOADED))
        return self.host


def _resize_like(target: Tensor, saved: Tensor) -> None:
    """Give ``target`` the sizes and strides of ``saved``, as an ``out=`` op resizing an empty output does (it may
    take its input's layout, e.g. a transposed one, which later ops such as matmul's reshape depend on)."""
    extent = 1 + sum((n - 1) * st for n, st in zip(saved.shape, saved.stride(), strict=True) if n > 0)
    target.resize_(extent if saved.numel() else 0)
    target.as_strided_(saved.shape, saved.stride())


def _detached(out: Any, written: dict[int, writes.Path], tensors: list[Tensor]) -> Any:
    """``out`` with tensors detached (collected into ``tensors``) and written arguments as ``_ArgRef``s."""

    def one(x: object) -> object:
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


def _served(out: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    def one(x: object) -> object:
        if type(x) is _ArgRef:
            return writes.locate(args, kwargs, x.path)
        return _detach(x) if isinstance(x, Tensor) else x

    if type(out) is tuple:
        return tuple(one(x) for x in out)
    return tree_map(one, out, is_leaf=lambda x: type(x) is _ArgRef)


def _stored_leaves(out: Any) -> list[Any]:
    """The leaves of a saved output, ``_ArgRef``s included."""
    return _compat.tree_leaves(out, is_leaf=lambda x: type(x) is _ArgRef)


def _witness(t: Tensor) -> Tensor:
    """A tensor sharing ``t``'s version counter and no storage, or ``t`` where none can be made."""
    w = _compat.version_witness(t)
    return t if w is None else w
