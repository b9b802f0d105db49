"""The drop-in entry points: ``checkpoint`` and ``create_selective_checkpoint_contexts``.

In eager, ``checkpoint`` runs sac2's frame (``sac2.frame.frame``: saved-tensor hooks, RNG and autocast replay, early
stop, the determinism check, the user's saved-tensor hooks) with sac2's two modes deciding what is kept. Under
torch.compile, and for ``use_reentrant=True``, it calls torch's checkpoint, which dynamo turns into its
``tag_activation_checkpoint`` HOP; the modes tag the traced nodes there.
"""

from __future__ import annotations

import functools
import inspect
from typing import TYPE_CHECKING, Any, Callable, TypeVar, overload

import torch.utils.checkpoint as _tuc
from torch.compiler import is_compiling

from sac2 import _compat, messages
from sac2.core import notices
from sac2.core.decisions import Policy, as_policy
from sac2.frame import entry
from sac2.modes.forward import CachingMode
from sac2.modes.region_contexts import RegionForward, RegionReplay, region_only
from sac2.modes.replay import ReplayMode
from sac2.record.record import Record

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["checkpoint", "create_selective_checkpoint_contexts"]

T = TypeVar("T")
ContextFn = _compat.ContextFn


class _Options(_compat.FrameOptions):
    """``checkpoint``'s own keyword options, bound by its decorator form: the frame's, and ``use_reentrant``."""

    use_reentrant: bool | None


def create_selective_checkpoint_contexts(
    policy_fn_or_list: Policy, allow_cache_entry_mutation: bool = False
) -> tuple[CachingMode | RegionForward, ReplayMode | RegionReplay]:
    """sac2's (forward, recompute) dispatch modes for a policy function or a list of ops to save.

    A policy is called as ``policy_fn(ctx, op, *args, **kwargs)`` once per op in forward (``ctx.op_output`` holds
    the op's output) and returns a ``CheckpointPolicy`` or a bool (True saves). A list saves exactly its ops.
    One ``ctx`` serves every op of one checkpointed forward (torch makes one per op): a policy can keep
    per-forward state keyed by it, but must read ``ctx.op_output`` during its call.
    The pair works as ``context_fn`` for ``sac2.checkpoint`` and for ``torch.utils.checkpoint.checkpoint``.

    A list of only ``sac2.Region``s needs no dispatch mode: in eager the pair is two plain context managers that
    only ``sac2.region`` calls talk to (``sac2.modes.region_contexts``), so the ops between regions cost nothing extra.

    Args:
        policy_fn_or_list: a policy callable (``policy_fn(ctx, op, *args, **kwargs)``, e.g. a
            ``sac2.policies`` preset), or a list, tuple or set of ``OpOverload``s, higher-order ops and
            ``sac2.Region``s to save (everything else is recomputed).
        allow_cache_entry_mutation: True recomputes in backward a saved output that was modified in place after
            the checkpointed forward, instead of raising. The default False raises autograd's "modified by an
            inplace operation" error in backward. Modifications inside the forward are always handled by
            recomputing. A list of only regions ignores it: in eager, a write into what a saved region kept
            raises autograd's error in backward.

    Returns:
        The (forward context, recompute context) pair a ``context_fn`` returns: sac2's ``CachingMode`` and
        ``ReplayMode`` dispatch modes, or for a list of only regions in eager, the dispatch-free
        ``RegionForward`` and ``RegionReplay``. A new pair per call: call it once per checkpointed call
        (``functools.partial(create_selective_checkpoint_contexts, policy)`` as the ``context_fn``).

    Raises:
        TypeError: ``policy_fn_or_list`` is neither callable nor a list, tuple or set. In forward, a policy that
            answers something other than a ``CheckpointPolicy`` or a bool raises TypeError naming the op.
        ValueError: the list holds an ``OpOverloadPacket`` (``torch.ops.aten.mm`` rather than
            ``torch.ops.aten.mm.default``) or something that is not an op or a ``sac2.Region``.
    """
    policy, record = as_policy(policy_fn_or_list), Record()
    regions = region_only(policy)
    if regions is not None and not _compat.tracing_for_compile():
        return RegionForward(regions, record), RegionReplay(record)
    return CachingMode(policy, record), ReplayMode(record, allow_cache_entry_mutation)


@overload
def checkpoint(
    function: Callable[..., T],
    *args: Any,
    use_reentrant: bool | None = None,
    preserve_rng_state: bool = True,
    context_fn: ContextFn = _compat.noop_context_fn,
    determinism_check: str = "default",
    debug: bool = False,
    early_stop: bool = True,
    respect_saved_tensors_hooks: bool | None = None,
    **kwargs: Any,
) -> T: ...
@overload
def checkpoint(
    function: None = None,
    *,
    use_reentrant: bool | None = None,
    preserve_rng_state: bool = True,
    context_fn: ContextFn = _compat.noop_context_fn,
    determinism_check: str = "default",
    debug: bool = False,
    early_stop: bool = True,
    respect_saved_tensors_hooks: bool | None = None,
) -> Callable[[Callable[..., T]], Callable[..., T]]: ...
def checkpoint(
    function: Callable[..., Any] | None = None,
    *args: Any,
    use_reentrant: bool | None = None,
    preserve_rng_state: bool = True,
    context_fn: ContextFn = _compat.noop_context_fn,
    determinism_check: str = "default",
    debug: bool = False,
    early_stop: bool = True,
    respect_saved_tensors_hooks: bool | None = None,
    **kwargs: Any,
) -> Any:
    """Checkpoint ``function(*args, **kwargs)``: keep what ``context_fn``'s policy saves, recompute the rest.

    torch 2.14's signature and semantics, on every torch sac2 supports, with ``use_reentrant=False`` as the
    default (``None`` means False, without torch's warning). Without ``function``, a decorator:
    ``checkpoint(use_reentrant=False)(fn)``, also on methods. ``use_reentrant=True`` runs torch's reentrant
    checkpoint, which recomputes everything and cannot apply a policy, so it rejects ``context_fn``. In eager
    the call runs sac2's frame; under torch.compile it is torch's checkpoint, which dynamo traces.

    Args:
        function: what to checkpoint (a function or a module). None (the default) with no ``args`` makes the
            decorator form: the result, applied to a function, checkpoints each of its calls with these options.
        *args: the positional arguments ``function`` is called with.
        use_reentrant: True runs torch's reentrant checkpoint (all recomputed, no policy); False and the default
            None run the non-reentrant checkpoint, None without torch's warning about the default.
        preserve_rng_state: True (the default) replays the CPU and device RNG states in recompute, so random ops
            draw the same numbers as in forward; False skips saving and restoring them.
        context_fn: returns the (forward, recompute) context pair, e.g.
            ``functools.partial(sac2.create_selective_checkpoint_contexts, policy)``. The default, torch's
            ``noop_context_fn``, is full activation checkpointing: only the inputs are kept.
        determinism_check: ``"default"`` checks in recompute that each saved tensor has the shape, dtype and
            device it had in forward; ``"none"`` skips the check.
        debug: True records the ops forward and recompute ran and adds them, side by side, to a recompute
            error's message.
        early_stop: True (the default) stops the recompute as soon as every tensor the backward needs is back;
            False runs the function to its end. ``torch.utils.checkpoint.set_checkpoint_early_stop`` overrides it.
        respect_saved_tensors_hooks: whether what the policy saves goes through the user's saved-tensor hooks
            in scope (``save_on_cpu``): True routes it through them, False bypasses them, None (the default)
            bypasses them and warns (FutureWarning) when such hooks are in scope and something was saved, as
            torch 2.14+ does.
        **kwargs: the keyword arguments ``function`` is called with.

    Returns:
        What ``function(*args, **kwargs)`` returns; in the decorator form, the checkpointed function.

    Raises:
        ValueError: keyword arguments other than the options in the decorator form; a ``determinism_check``
            other than ``"default"`` or ``"none"``; ``use_reentrant=True`` with a ``context_fn`` (or, on torch
            2.13, with ``respect_saved_tensors_hooks``).
        RuntimeError: the forward context of ``context_fn`` suppressed an exception of the forward; a device
            was initialized during the forward with ``preserve_rng_state=True``. In backward: a tensor the
            forward saved was written in place afterwards (autograd's "modified by an inplace operation"), or
            the recompute ran other ops than the forward did.
        torch.utils.checkpoint.CheckpointError: in backward, the recompute saved more tensors, a different
            number of tensors, or tensors of other shape, dtype or device than the forward (with
            ``determinism_check="default"``), or a saved tensor was unpacked twice in one backward.
    """
    options = _Options(
        use_reentrant=use_reentrant,
        preserve_rng_state=preserve_rng_state,
        context_fn=context_fn,
        determinism_check=determinism_check,
        debug=debug,
        early_stop=early_stop,
        respect_saved_tensors_hooks=respect_saved_tensors_hooks,
    )
    if function is None and not args:
        if kwargs:
            raise ValueError(messages.unexpected_keyword_arguments(kwargs))
        return functools.partial(_Checkpointed, **options)
    # function is None only with args (``checkpoint(None, x)``), which fails when called, as in torch.
    return _run(function, args, kwargs, **options)  # type: ignore[arg-type]


class _Checkpointed:
    """``function`` with checkpoint options bound: what ``checkpoint(**options)`` makes of it. As a method
    decorator it binds the function to the instance first, as torch 2.14's curried form does."""

    def __init__(self, function: Callable[..., Any], **options: Unpack[_Options]) -> None:
        self.function = function
        self.options = options
        functools.update_wrapper(self, function, updated=())

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return _run(self.function, args, kwargs, **self.options)

    def __get__(self, instance: object, owner: type | None = None) -> _Checkpointed:
        bind = getattr(self.function, "__get__", None)
        if instance is None or bind is None:
            return self
        return type(self)(bind(instance, owner), **self.options)


#: torch's checkpoint parameters, which a function's own keyword arguments must not be confused with.
_OPTIONS = frozenset(_Options.__annotations__)
#: torch 2.14+ takes ``respect_saved_tensors_hooks`` (for its own SAC modes); torch 2.13 would hand it to the
#: checkpointed function as a keyword argument.
_TORCH_TAKES_HOOKS_FLAG = "respect_saved_tensors_hooks" in inspect.signature(_tuc.checkpoint).parameters


def _run(
    function: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    use_reentrant: bool | None,
    **options: Unpack[_compat.FrameOptions],
) -> Any:
    """One checkpointed call: sac2's frame in eager, torch's checkpoint (its HOP) under torch.compile and for
    ``use_reentrant=True``."""
    if kwargs and not _OPTIONS.isdisjoint(kwargs):  # the decorator form passes them to the function, as torch's does
        function, kwargs = functools.partial(function, **kwargs), {}
    compiling = is_compiling()
    if use_reentrant or compiling:
        return _torch_checkpoint(function, args, kwargs, bool(use_reentrant), options)
    return entry.run(function, args, kwargs, **options)


def _torch_checkpoint(
    function: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    use_reentrant: bool,
    frame_options: _compat.FrameOptions,
) -> Any:
    """torch's own checkpoint: its reentrant frame, or, under torch.compile, what dynamo turns into its HOP (which
    rejects torch's default context_fn passed in, and needs the user's own; saved-tensor hooks are skipped under
    compile, as in torch), with ``_traced_body`` as its body."""
    options: dict[str, Any] = dict(frame_options)
    context_fn, respect = options.pop("context_fn"), options.pop("respect_saved_tensors_hooks")
    options["use_reentrant"] = use_reentrant
    if respect is not None and _TORCH_TAKES_HOOKS_FLAG:
        options["respect_saved_tensors_hooks"] = respect
    if use_reentrant:
        if context_fn is not _compat.noop_context_fn:
            raise ValueError(messages.REENTRANT_WITH_POLICY)
        if respect is not None and not _TORCH_TAKES_HOOKS_FLAG:
            raise ValueError(messages.REENTRANT_OPTIONS)  # torch 2.14's own error
    else:
        if context_fn is not _compat.noop_context_fn:
            options["context_fn"] = context_fn
        args = (function, *args)
        function = _traced_body
    return _tuc.checkpoint(function, *args, **options, **kwargs)


def _traced_body(function: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """What torch's checkpoint runs for a sac2 checkpoint under torch.compile. Traced by dynamo as the body of the
    checkpoint's HOP, it keeps the function's changes to Python objects from outside the checkpoint in the graph
    (``_compat.side_effects_kept``: transformers 5.25 sets and resets a context variable in every attention call)
    rather than breaking it. Run eagerly, dynamo broke the graph at this checkpoint anyway and torch's eager frame
    runs it: its forward warns, naming the block (``EagerFallbackWarning``); its recompute does not."""
    if is_compiling():
        return _compat.side_effects_kept(function, *args, **kwargs)
    if _compat.in_checkpoint_forward():
        notices.fell_back(function)
    return function(*args, **kwargs)
