"""sac2's eager checkpoint frame: torch's non-reentrant checkpoint semantics at a small constant cost per tensor.

A checkpoint frame decides what autograd keeps. In forward it pushes a pair of saved-tensor hooks: each tensor
autograd would save becomes a ``Holder`` (its position in the forward), and the function's tensor inputs are saved
as autograd saves tensors, so an enclosing checkpoint, or the user's ``save_on_cpu``, manages them. The first unpack
of a backward (one graph task, or one ``GraphExecGroup``) runs the function again under recompute hooks that store
each saved tensor at its position, with the forward's RNG, autocast and device context; each unpack hands its
tensor over and forgets it. Recompute stops once the last tensor the forward saved is back (early stop), and the
shapes, dtypes and devices are compared with the forward's (the determinism check).

The rules sac2's frame keeps (each proven by the test named; torch's NOTE [Nestable Checkpoint] states the same for
its frame): ``Frame`` keeps 1 to 6 and 9, ``sac2.frame.entry``, which enters and leaves the forward, keeps 7 and 8.

1. A tensor autograd saves in the checkpointed forward is kept as its position only; the first unpack of each
   backward (graph task or ``GraphExecGroup``) recomputes them all (``test_frame``: bytes kept, retain_graph twice).
2. Recompute replays the forward's CPU and device RNG states (``preserve_rng_state``), autocast state and device
   context, and the states of the generators named by ``preserve_generators`` (``test_frame``,
   ``test_never_silently_wrong``: explicit generators), and leaves every generator where it stood.
3. A tensor unpacked twice in one backward is torch's ``CheckpointError``; a tensor written in place after it was
   saved is autograd's own error, at unpack, as without checkpointing (``test_never_silently_wrong``).
   3a. Under the user's saved-tensor hooks autograd checks no version: backward reads what the hooks kept. Where
   they keep the tensor itself (``save_on_cpu`` on a CPU tensor, probed per device), a write later in the forward
   is replayed (recompute runs to the end) and a write after the forward ended is sac2's error; where they copy,
   recompute keeps a copy of the value at the save (``test_against_no_checkpointing``: under the user's hooks).
4. Early stop: recompute ends when the last saved tensor is back; sac2's replay mode lets an op that writes into
   that tensor finish first (``test_frame``: early stop on/off/global).
5. The determinism check compares the count, shapes, dtypes and devices of what recompute saved with the forward's
   (``test_frame``: determinism check).
6. Nesting: the inputs are saved as autograd saves tensors, so an inner checkpoint's recompute unpacks them from
   the outer one, which recomputes first (``test_frame``: nesting both ways); a nested call's input written in
   place since the call started raises autograd's error naming the input (``test_against_no_checkpointing``).
7. What a selective policy saves goes through the user's saved-tensor hooks in scope when
   ``respect_saved_tensors_hooks`` is True, bypasses them when False, and bypasses them with torch's FutureWarning
   when None (``test_saved_tensors_hooks``).
8. Exceptions in forward leave no hook, mode or flag behind (``test_frame``: exceptions leave nothing behind).
9. Offload (``sac2.offload``): a call is one block of its schedule, reached when its recompute starts; where the
   policy's contexts ask (``offload_inputs``) and no saved-tensor hooks are in effect, its activation inputs are
   saved through offload's hooks, autograd's in-place check of them made at unpack (``test_offload``: inputs
   written in place, nested checkpoints; ``test_offload_schedule``: the order of copies and waits).

The cost is a few list operations per saved tensor and hook, where torch's frame builds per-tensor dictionaries
and handles and calls through ``torch._dynamo.disable`` wrappers. Code traced by torch.compile, export or FX runs
on torch's own frame (its HOP), which is also one switch away (``use_torch_frame``); ``sac2.frame.entry`` picks
the frame for each call.
"""

from __future__ import annotations

import enum
import weakref
from typing import Any, Callable, ContextManager, Final, TypeAlias

import torch
from torch.utils.checkpoint import GraphExecGroup

from sac2 import _compat, messages
from sac2.frame import inplace_check
from sac2.frame.contexts import finishing
from sac2.frame.debug_trace import OpTrace
from sac2.frame.inplace_check import SavedVersions, Witnesses
from sac2.frame.switches import preserved_generators
from sac2.messages.internal import InternalError
from sac2.offload import saves, schedule

__all__ = ["Frame", "Holder", "CheckpointError"]

Tensor = torch.Tensor
CheckpointError = _compat.CheckpointError
_version, _graph_exec_group, _graph_task_id = _compat.version, _compat.graph_exec_group, _compat.graph_task_id
_Ref = weakref.ref  # an entry's weak reference (no witness): checked in full
#: What the determinism check compares of a saved tensor: its shape, dtype and device.
Meta: TypeAlias = tuple[torch.Size, torch.dtype, torch.device]


class Holder:
    """What autograd keeps for one tensor the checkpointed forward saved: its position, and its entry for the in-place
    check (``sac2.frame.inplace_check``; None where none is made), which the unpack reads from the object autograd hands
    back rather than through the frame's list. The frame references it weakly, so a recompute does not keep
    tensors whose part of the graph is gone."""

    __slots__ = ("index", "entry", "__weakref__")
    index: int
    entry: inplace_check.Entry


class _Stop(Exception):
    """Raised by the recompute hook once every saved tensor is back (early stop); caught by the frame."""


class _Slot(enum.Enum):
    UNPACKED = 0


#: A slot whose tensor this backward has already unpacked.
_UNPACKED: Final = _Slot.UNPACKED
#: What recompute leaves at each position: the tensor, None where its holder was gone, or ``_UNPACKED``.
Store: TypeAlias = list["Tensor | None | _Slot"]


class Frame:
    """One checkpointed call: what its recompute needs, and what each backward recomputed.

    Built when the call starts, in grad mode; ``hooks()`` are the saved-tensor hooks its forward runs under.
    """

    __slots__ = (
        "fn", "kwargs", "inputs", "early_stop", "check", "holders", "metas", "versions", "recompute_context", "rng",
        "generators", "input_ids", "input_strides", "devices", "autocast", "device_context", "stores",
        "completed", "ignore_mismatch", "trace", "witnesses", "block",
    )

    def __init__(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        preserve_rng_state: bool,
        recompute_context: ContextManager[object] | None,
        determinism_check: str,
        early_stop: bool,
        block: schedule.Block | None = None,
        offload_inputs: bool = False,
    ) -> None:
        self.fn, self.kwargs = fn, kwargs
        #: Offload's block for this call (``sac2.offload.schedule``), None while nothing asked for offload.
        self.block = block
        self.recompute_context = recompute_context
        self.early_stop = early_stop
        self.check = determinism_check == "default"
        self.holders: list[weakref.ref[Holder]] = []
        self.metas: list[Meta] = []
        #: The saved tensors' versions, for autograd's in-place check (rules 3 and 3a), through witnesses of their
        #: version counters made while the forward runs.
        self.versions = SavedVersions(args, nested=_compat.in_checkpoint_forward())
        self.witnesses = Witnesses()
        self.stores: dict[GraphExecGroup | int, Store] = {}
        self.completed = False
        self.ignore_mismatch = False
        self.devices = _compat.checkpoint_devices(args)
        self.autocast = _compat.autocast_state(self.devices)
        self.rng = _compat.rng_states(self.devices) if preserve_rng_state else None
        self.generators = [(g, g.get_state()) for g in preserved_generators()]
        self.trace: OpTrace | None = None  # debug=True: the ops forward and recompute ran
        self.device_context = _compat.device_context()
        # Saved as autograd saves tensors: an enclosing checkpoint holds them (and recomputes to give them back).
        # Offload moves them where autograd would keep them itself: no saved-tensor hooks at all (no enclosing
        # checkpoint's, in forward or recompute, nor the user's).
        if offload_inputs and block is not None and _compat.top_saved_tensors_hooks() is None:
            self.inputs: list[object] = [_saved_input(a, k, block) if isinstance(a, Tensor) else a
                                         for k, a in enumerate(args)]
        else:
            self.inputs = [_compat.make_saved_tensor(a) if isinstance(a, Tensor) else a for a in args]
        #: Their ids while the forward runs (they are alive then), so the version check leaves them to autograd.
        self.input_ids = frozenset(id(a) for a in args if isinstance(a, Tensor))
        #: Their strides: a user's hook may hand an input back with others (``save_on_cpu`` makes it contiguous),
        #: and ops whose result depends on strides (``empty_like`` then ``uniform_``) must see the forward's.
        self.input_strides = [_compat.plain_strides(a) for a in args]

    def hooks(self) -> tuple[Callable[[Tensor], Holder], Callable[[Holder], Tensor]]:
        """The forward's (pack, unpack) pair. The pack hook holds no reference to the frame (autograd keeps the
        hooks in its graph): only the unpack hook does."""
        holders, metas, versions, check = self.holders, self.metas, self.versions.entries, self.check
        ref, new, witnessed = weakref.ref, Holder.__new__, self.witnesses.entry
        # The inputs are saved as autograd saves tensors (see __init__): autograd checks their versions itself.
        inputs = self.input_ids

        def pack(x: Tensor) -> Holder:
            h = new(Holder)
            h.index = len(holders)
            holders.append(ref(h))
            shape = None
            if check:
                meta = (x.shape, x.dtype, x.device)
                metas.append(meta)
                shape = meta[0]
            if versions is None:
                h.entry = None
            else:
                e = h.entry = None if id(x) in inputs else witnessed(x, shape)
                versions.append(e)
            return h

        return pack, self.unpack

    def unpack(self, h: Holder) -> Tensor:
        """The tensor saved at ``h``'s position, recomputing first if this backward has not yet."""
        e = h.entry
        if e is not None:  # an unchanged witness is the common case, read inline; a weak reference is checked in full
            w = e[0]
            if isinstance(w, _Ref) or _version(w) != e[1]:
                self.versions.check(h.index, e, here=True)
        # ``_compat.graph_task``, read inline (two C calls, no Python frame): the GraphExecGroup, else the graph task
        gid: GraphExecGroup | int | None = _graph_exec_group()
        if gid is None:
            task = _graph_task_id()
            gid = None if task == -1 else task
        if gid is None:  # read outside any backward (``grad_fn._saved_self``): recompute for this read alone
            t = self.recompute()[h.index]
        else:
            store = self.stores.get(gid)
            if store is None:
                store = self.stores[gid] = self.recompute()
            i = h.index
            t = store[i]
            if t is _UNPACKED:
                raise CheckpointError(messages.unpacked_twice(_compat.graph_exec_group() is not None))
            store[i] = _UNPACKED
        if not isinstance(t, Tensor):
            raise InternalError(messages.internal_error(messages.SLOT_UNFILLED))
        return t

    def end_forward(self) -> None:
        self.completed = True
        self.witnesses.by_root.clear()
        self.versions.end_forward()

    def recompute(self) -> Store:
        """Run the function again; return what it saved, by position (None where the holder is gone)."""
        if self.block is not None:
            schedule.reached(self.block)  # offload: this block's tensors back, the next one's on their way
        store: Store = [None] * len(self.holders)
        early_stop, copy_at = self.versions.replaying_writes(self.early_stop)
        pack, count = self._recompute_hook(store, early_stop, copy_at)
        self.versions.check_inputs()
        inputs = [
            _compat.restrided(_compat.unpack_saved_tensor(a), stride)
            for a, stride in zip(self.inputs, self.input_strides, strict=True)
        ]
        contexts = self._recompute_contexts()
        rng = _compat.set_rng_states(self.rng) if self.rng is not None else None
        generators = [(g, _replace_state(g, state)) for g, state in self.generators]
        grad_was = _compat.set_grad_enabled(True)
        _compat.push_checkpoint_hooks(pack, _compat.as_is)
        try:
            _run_in(contexts, self.fn, inputs, self.kwargs)
        except _Stop:
            pass
        except RuntimeError as error:
            self._explain(error)
            raise
        finally:
            _compat.pop_checkpoint_hooks(pack)
            _restore(grad_was, rng, generators)
        if not self.ignore_mismatch:
            try:
                self._check(count[0], store)
            except CheckpointError as error:
                self._explain(error)
                raise
        return store

    def _recompute_hook(
        self, store: Store, early_stop: bool, copy_at: frozenset[int]
    ) -> tuple[Callable[[Tensor], Tensor], list[int]]:
        """The recompute's pack hook, which fills ``store`` by position (a copy at ``copy_at``), and the count of
        tensors it has seen."""
        holders, count = self.holders, [0]
        n = len(holders)
        replay = finishing(self.recompute_context)  # sac2's replay mode finishes the op under way first
        finish_op = replay.finish_op if replay is not None else None
        # sac2's modes ignore detach (the recompute hook's own): skip their Python dispatch for plain tensors
        detach = _compat.detach_below_sac2 if finish_op is not None else Tensor.detach

        def pack(x: Tensor) -> Tensor:
            i = count[0]
            count[0] = i + 1
            if x.requires_grad:
                x = detach(x)
            if i >= n:
                return self._extra(x, early_stop)
            if holders[i]() is not None:
                store[i] = _copy(x) if i in copy_at else x
            if early_stop and i + 1 == n and (finish_op is None or not finish_op(_Stop)):
                raise _Stop  # the last saved tensor is back; an op that writes into it finishes first
            return x

        return pack, count

    def _extra(self, x: Tensor, early_stop: bool) -> Tensor:
        """Recompute saved more tensors than forward did."""
        if early_stop:  # the op that saved the last tensor finished (see finish_op): stop
            raise _Stop
        if not self.completed:  # a backward inside the forward, without early stop
            self.ignore_mismatch = True
            return x
        raise CheckpointError(messages.more_saved_in_recompute(self._tip()))

    def _recompute_contexts(self) -> list[ContextManager[object]]:
        """What the recompute runs in: the forward's autocast state, the policy's replay, the device context, the
        debug trace; entered in that order."""
        contexts = _compat.autocast_contexts(self.autocast)
        if self.recompute_context is not None:
            contexts.append(self.recompute_context)
        if self.device_context is not None:
            contexts.append(_compat.fresh_device_context(self.device_context))
        if self.trace is not None:
            contexts.append(self.trace.recompute_mode())
        return contexts

    def _tip(self) -> str:
        """torch's tip to pass ``debug=True``, which its errors end with unless it was passed."""
        return _compat.DEBUG_TIP if self.trace is None else ""

    def _explain(self, error: RuntimeError) -> None:
        """With ``debug=True``, raise ``error`` again (its own type) with the forward's and recompute's ops, led by
        torch's debug wording where the recompute differs from the forward (the determinism check, a divergence)."""
        if self.trace is not None and type(error) in _EXPLAINED:
            differs = type(error) is not RuntimeError
            raise type(error)(self.trace.explain(str(error), differs)) from error

    def _check(self, count: int, store: Store) -> None:
        """torch's determinism check: as many tensors saved as in forward, each with its shape, dtype and device,
        but not where the forward's tensor was written after the save (a ``resize_``): its own node's unpack raises
        autograd's error if it runs (rule 3), and recompute may replay the write (rule 3a)."""
        n = len(self.holders)
        if count != n:
            raise CheckpointError(messages.saved_count_differs(n, count, self._tip()))
        if not self.check:
            return
        bad = [
            (i, _meta(meta), _meta((t.shape, t.dtype, t.device)))
            for i, (meta, t) in enumerate(zip(self.metas, store, strict=True))
            if isinstance(t, Tensor)
            and (meta[0] != t.shape or meta[1] != t.dtype or meta[2] != t.device) and not self.versions.changed(i)
        ]
        if bad:
            raise CheckpointError(messages.metadata_differs(bad, self._tip()))


#: What ``debug=True`` explains: a recompute that differs from its forward (torch's determinism check, sac2's
#: divergence), and plain RuntimeErrors raised in recompute.
_EXPLAINED = (CheckpointError, messages.RecomputeDiverged, RuntimeError)


def _run_in(
    contexts: list[ContextManager[object]], fn: Callable[..., Any], args: list[object], kwargs: dict[str, Any]
) -> None:
    """``fn(*args, **kwargs)`` inside ``contexts``, entered in order and exited in reverse, as nested ``with``s."""
    if not contexts:
        fn(*args, **kwargs)
        return
    with contexts[0]:
        _run_in(contexts[1:], fn, args, kwargs)


def _restore(grad_was: bool, rng: _compat.RngStates | None, generators: list[tuple[torch.Generator, Tensor]]) -> None:
    """Put grad mode, the global RNG and the named generators back as they were before a recompute."""
    _compat.set_grad_enabled(grad_was)
    if rng is not None:
        _compat.set_rng_states(rng)
    for g, state in generators:
        g.set_state(state)


def _replace_state(g: torch.Generator, state: Tensor) -> Tensor:
    """Set ``g`` to ``state``; return the state it had."""
    now = g.get_state()
    g.set_state(state)
    return now


def _saved_input(a: Tensor, k: int, block: schedule.Block) -> _compat.SavedTensor:
    """Input ``k``, saved as autograd saves tensors; in host memory (``block``: the call's offload block) where it is
    an activation (made by autograd, not a leaf the caller holds anyway) on the device: what full AC keeps."""
    if a.requires_grad and a.grad_fn is not None and saves.can_move(a, block):
        return saves.saved_input(a, block, k)
    return _compat.make_saved_tensor(a)


def _meta(meta: Meta) -> dict[str, object]:
    return {"shape": meta[0], "dtype": meta[1], "device": meta[2]}


def _copy(x: Tensor) -> Tensor:
    with _compat.no_modes(), torch.no_grad():  # not an op of the user's program
        return x.clone()


# What autograd calls (the pack hooks of forward and recompute, unpack, recompute): never traced by dynamo, even
# where it runs inside compiled code (a compiled submodule saving for backward), as torch disables its own.
_compat.skip_dynamo_in_code(Frame.hooks, Frame._recompute_hook, Frame.unpack, Frame.recompute, _run_in)
