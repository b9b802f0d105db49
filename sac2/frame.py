"""sac2's eager checkpoint frame: torch's non-reentrant checkpoint semantics at a small constant cost per tensor.

A checkpoint frame decides what autograd keeps. In forward it pushes a pair of saved-tensor hooks: each tensor
autograd would save becomes a ``_Holder`` (its position in the forward), and the function's tensor inputs are saved
as autograd saves tensors, so an enclosing checkpoint, or the user's ``save_on_cpu``, manages them. The first unpack
of a backward (one graph task, or one ``GraphExecGroup``) runs the function again under recompute hooks that store
each saved tensor at its position, with the forward's RNG, autocast and device context; each unpack hands its
tensor over and forgets it. Recompute stops once the last tensor the forward saved is back (early stop), and the
shapes, dtypes and devices are compared with the forward's (the determinism check).

That is what torch's non-reentrant checkpoint does, with its rules for nesting, backward inside forward, dead
holders, ``retain_graph`` and errors (``CheckpointError``, torch's messages). The cost is a few list operations per
saved tensor and hook, where torch's frame builds per-tensor dictionaries and handles and calls through
``torch._dynamo.disable`` wrappers. ``debug=True`` and code traced by torch.compile, export or FX run on torch's own
frame, which is also one switch away (``use_torch_frame``).
"""

from __future__ import annotations

import enum
import threading
import weakref
from typing import Any, Callable, ContextManager, Final, TypeAlias

import torch
from torch.utils.checkpoint import GraphExecGroup

from sac2 import _compat, messages
from sac2.notices import count_forward

__all__ = ["run", "frames", "use_torch_frame", "torch_frame_in_use", "CheckpointError"]

Tensor = torch.Tensor
CheckpointError = _compat.CheckpointError
ContextFn = _compat.ContextFn
#: What the determinism check compares of a saved tensor: its shape, dtype and device.
Meta: TypeAlias = tuple[torch.Size, torch.dtype, torch.device]

_DETERMINISM_CHECKS = ("default", "none")


class _Holder:
    """What autograd keeps for one tensor the checkpointed forward saved: its position. The frame references it
    weakly, so a recompute does not keep tensors whose part of the graph is gone."""

    __slots__ = ("index", "__weakref__")
    index: int


class _Stop(Exception):
    """Raised by the recompute hook once every saved tensor is back (early stop); caught by the frame."""


class _Slot(enum.Enum):
    UNPACKED = 0


#: A slot whose tensor this backward has already unpacked.
_UNPACKED: Final = _Slot.UNPACKED
#: What recompute leaves at each position: the tensor, None where its holder was gone, or ``_UNPACKED``.
Store: TypeAlias = list["Tensor | None | _Slot"]


class _Switch(threading.local):
    torch_frame: bool = False


_switch = _Switch()


class use_torch_frame:
    """Run sac2's eager checkpoints on torch's own non-reentrant frame instead of sac2's, to compare the two.

    Like ``torch.set_grad_enabled``: ``sac2.use_torch_frame()`` switches this thread until switched back
    (``sac2.use_torch_frame(False)``), and ``with sac2.use_torch_frame(): ...`` switches for the block only.
    """

    def __init__(self, enabled: bool = True) -> None:
        self.prev = _switch.torch_frame
        _switch.torch_frame = bool(enabled)

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        _switch.torch_frame = self.prev


def torch_frame_in_use() -> bool:
    """Whether ``use_torch_frame`` is on in this thread."""
    return _switch.torch_frame


class Frame:
    """One checkpointed call: what its recompute needs, and what each backward recomputed.

    Built when the call starts, in grad mode; ``hooks()`` are the saved-tensor hooks its forward runs under.
    """

    __slots__ = (
        "fn", "kwargs", "inputs", "early_stop", "check", "holders", "metas", "recompute_context", "rng",
        "devices", "autocast", "device_context", "stores", "completed", "ignore_mismatch",
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
    ) -> None:
        self.fn, self.kwargs = fn, kwargs
        self.recompute_context = recompute_context
        self.early_stop = early_stop
        self.check = determinism_check == "default"
        self.holders: list[weakref.ref[_Holder]] = []
        self.metas: list[Meta] = []
        self.stores: dict[GraphExecGroup | int, Store] = {}
        self.completed = False
        self.ignore_mismatch = False
        self.devices = _compat.checkpoint_devices(args)
        self.autocast = _compat.autocast_state(self.devices)
        self.rng = _compat.rng_states(self.devices) if preserve_rng_state else None
        self.device_context = _compat.device_context()
        # Saved as autograd saves tensors: an enclosing checkpoint holds them (and recomputes to give them back).
        self.inputs: list[object] = [_compat.make_saved_tensor(a) if isinstance(a, Tensor) else a for a in args]

    def hooks(self) -> tuple[Callable[[Tensor], _Holder], Callable[[_Holder], Tensor]]:
        """The forward's (pack, unpack) pair. The pack hook holds no reference to the frame (autograd keeps the
        hooks in its graph): only the unpack hook does."""
        holders, metas, check, ref, new = self.holders, self.metas, self.check, weakref.ref, _Holder.__new__

        def pack(x: Tensor) -> _Holder:
            h = new(_Holder)
            h.index = len(holders)
            holders.append(ref(h))
            if check:
                metas.append((x.shape, x.dtype, x.device))
            return h

        return pack, self.unpack

    def unpack(self, h: _Holder) -> Tensor:
        """The tensor saved at ``h``'s position, recomputing first if this backward has not yet."""
        gid = _compat.graph_task()
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
        assert isinstance(t, Tensor), "recompute fills the slot of every live holder"
        return t

    def recompute(self) -> Store:
        """Run the function again; return what it saved, by position (None where the holder is gone)."""
        holders = self.holders
        n = len(holders)
        store: Store = [None] * n
        count = 0
        early_stop = self.early_stop
        finish_op = getattr(self.recompute_context, "finish_op", None)  # sac2's replay mode
        # sac2's modes ignore detach (the recompute hook's own): skip their Python dispatch for plain tensors
        detach = _compat.detach_below_sac2 if finish_op is not None else _detach

        def pack(x: Tensor) -> Tensor:
            nonlocal count
            i = count
            count = i + 1
            if x.requires_grad:
                x = detach(x)
            if i >= n:
                if early_stop:  # the op that saved the last tensor finished (see below): stop
                    raise _Stop
                if not self.completed:  # a backward inside the forward, without early stop
                    self.ignore_mismatch = True
                    return x
                raise CheckpointError(messages.more_saved_in_recompute(_compat.DEBUG_TIP))
            if holders[i]() is not None:
                store[i] = x
            if early_stop and count == n and (finish_op is None or not finish_op(_Stop)):
                raise _Stop  # the last saved tensor is back; an op that writes into it finishes first
            return x

        inputs = [_compat.unpack_saved_tensor(a) for a in self.inputs]
        contexts = _compat.autocast_contexts(self.autocast)
        if self.recompute_context is not None:
            contexts.append(self.recompute_context)
        if self.device_context is not None:
            contexts.append(_compat.fresh_device_context(self.device_context))
        rng = _compat.set_rng_states(self.rng) if self.rng is not None else None
        grad_was = _compat.set_grad_enabled(True)
        _compat.push_checkpoint_hooks(pack, _identity)
        try:
            _run_in(contexts, self.fn, inputs, self.kwargs)
        except _Stop:
            pass
        finally:
            _compat.pop_checkpoint_hooks(pack)
            _compat.set_grad_enabled(grad_was)
            if rng is not None:
                _compat.set_rng_states(rng)
        if not self.ignore_mismatch:
            self._check(count, store)
        return store

    def _check(self, count: int, store: Store) -> None:
        """torch's determinism check: as many tensors saved as in forward, each with its shape, dtype and device."""
        n = len(self.holders)
        if count != n:
            raise CheckpointError(messages.saved_count_differs(n, count, _compat.DEBUG_TIP))
        if not self.check:
            return
        bad = [
            (i, _meta(meta), _meta((t.shape, t.dtype, t.device)))
            for i, (meta, t) in enumerate(zip(self.metas, store, strict=True))
            if isinstance(t, Tensor) and (meta[0] != t.shape or meta[1] != t.dtype or meta[2] != t.device)
        ]
        if bad:
            raise CheckpointError(messages.metadata_differs(bad, _compat.DEBUG_TIP))


def _run_in(
    contexts: list[ContextManager[object]], fn: Callable[..., Any], args: list[object], kwargs: dict[str, Any]
) -> None:
    """``fn(*args, **kwargs)`` inside ``contexts``, entered in order and exited in reverse, as nested ``with``s."""
    if not contexts:
        fn(*args, **kwargs)
        return
    with contexts[0]:
        _run_in(contexts[1:], fn, args, kwargs)


def _identity(x: Tensor) -> Tensor:
    return x


def _detach(x: Tensor) -> Tensor:
    return x.detach()


def _meta(meta: Meta) -> dict[str, object]:
    return {"shape": meta[0], "dtype": meta[1], "device": meta[2]}


# What backward calls: never traced by dynamo (compiled autograd would see eager hooks), as torch disables its own.
_compat.skip_dynamo_in_code(Frame.unpack, Frame.recompute, _run_in)


def _delegated(debug: bool) -> bool:
    """Whether this call runs on torch's frame: debug traces, code torch.compile/export/FX traces, or the switch."""
    return debug or _switch.torch_frame or _compat.checkpoint_debug_override() or _compat.traced_checkpoint()


def _validate(determinism_check: str) -> None:
    if determinism_check not in _DETERMINISM_CHECKS:
        raise ValueError(messages.bad_determinism_check(_DETERMINISM_CHECKS, determinism_check))


def run(
    function: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    preserve_rng_state: bool,
    context_fn: ContextFn,
    determinism_check: str,
    debug: bool,
    early_stop: bool,
    respect_saved_tensors_hooks: bool | None = None,
) -> Any:
    """``function(*args, **kwargs)`` checkpointed by sac2's frame, or by torch's where sac2's does not apply."""
    _validate(determinism_check)
    if _delegated(debug):
        return _compat.run_torch_frame(function, args, kwargs, preserve_rng_state=preserve_rng_state,
                                       context_fn=context_fn, determinism_check=determinism_check, debug=debug,
                                       early_stop=early_stop, respect_saved_tensors_hooks=respect_saved_tensors_hooks)
    forward_context, recompute_context = _contexts(context_fn, respect_saved_tensors_hooks)
    if not torch.is_grad_enabled():
        return function(*args, **kwargs)
    frame = _frame(function, args, kwargs, preserve_rng_state, recompute_context, determinism_check, early_stop)
    pack, unpack = frame.hooks()
    _enter(forward_context, pack, unpack)
    try:
        out = function(*args, **kwargs)
    except BaseException as error:
        _exit(forward_context, pack, error)
        raise
    _exit(forward_context, pack, None)
    _completed(frame)
    return out


def frames(
    function: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    preserve_rng_state: bool,
    context_fn: ContextFn,
    determinism_check: str,
    debug: bool,
    early_stop: bool,
    respect_saved_tensors_hooks: bool | None = None,
) -> _compat.FrameGenerator:
    """The same as ``run``, in the shape of torch's frame: a generator that yields once, while the function runs,
    and that torch's ``checkpoint`` drives with ``next``/``throw`` while sac2 is installed."""
    _validate(determinism_check)
    if _delegated(debug):
        yield from _compat.torch_frame(function, args, kwargs, preserve_rng_state=preserve_rng_state,
                                       context_fn=context_fn, determinism_check=determinism_check, debug=debug,
                                       early_stop=early_stop, respect_saved_tensors_hooks=respect_saved_tensors_hooks)
        return
    if context_fn is _compat.noop_context_fn:
        count_forward()  # full AC through sac2 counts, so a check that sac2 runs holds for it too
    forward_context, recompute_context = _contexts(context_fn, respect_saved_tensors_hooks)
    if not torch.is_grad_enabled():
        yield
        return
    frame = _frame(function, args, kwargs, preserve_rng_state, recompute_context, determinism_check, early_stop)
    pack, unpack = frame.hooks()
    _enter(forward_context, pack, unpack)
    try:
        yield
    except BaseException as error:
        _exit(forward_context, pack, error)
        raise
    _exit(forward_context, pack, None)
    _completed(frame)


def _contexts(
    context_fn: ContextFn, respect_saved_tensors_hooks: bool | None
) -> tuple[ContextManager[object] | None, ContextManager[object] | None]:
    """The (forward, recompute) contexts ``context_fn`` gives; (None, None) for torch's no-op default, which the
    frame then skips entering."""
    if context_fn is _compat.noop_context_fn:
        return None, None
    forward_context, recompute_context = context_fn()
    _compat.tell_torch_sac_modes(forward_context, respect_saved_tensors_hooks)
    return forward_context, recompute_context


def _frame(
    function: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    preserve_rng_state: bool,
    recompute_context: ContextManager[object] | None,
    determinism_check: str,
    early_stop: bool,
) -> Frame:
    override = _compat.early_stop_override()  # torch.utils.checkpoint.set_checkpoint_early_stop, if in effect
    return Frame(function, args, kwargs, preserve_rng_state, recompute_context, determinism_check,
                 early_stop if override is None else override)


def _enter(
    forward_context: ContextManager[object] | None,
    pack: Callable[[Tensor], _Holder],
    unpack: Callable[[_Holder], Tensor],
) -> None:
    _compat.push_checkpoint_hooks(pack, unpack, forward=True)
    if forward_context is None:
        return
    try:
        forward_context.__enter__()
    except BaseException:
        _compat.pop_checkpoint_hooks(pack)
        raise


def _exit(
    forward_context: ContextManager[object] | None, pack: Callable[[Tensor], _Holder], error: BaseException | None
) -> None:
    """Leave the forward context, then pop the hooks (``with hooks, forward_context:`` in torch's frame)."""
    try:
        if forward_context is None:
            pass
        elif error is None:
            forward_context.__exit__(None, None, None)
        elif forward_context.__exit__(type(error), error, error.__traceback__):
            raise RuntimeError(messages.CONTEXT_SUPPRESSED_ERROR)
    finally:
        _compat.pop_checkpoint_hooks(pack)


def _completed(frame: Frame) -> None:
    frame.completed = True
    if frame.rng is not None and _compat.device_initialized_since(frame.devices, frame.rng):
        raise RuntimeError(messages.DEVICE_INITIALIZED_IN_FORWARD)
