"""How a checkpointed call enters a frame: ``run`` (``sac2.checkpoint``) and ``frames`` (torch's ``checkpoint``
while sac2 is installed) pick sac2's frame or torch's, then enter the forward's saved-tensor hooks and the
policy's contexts, and leave them as the forward ends or raises.

Of the rules ``sac2.frame.frame`` lists, this module keeps 7 (what a selective policy saves and the user's saved-tensor
hooks) and 8 (exceptions in forward leave no hook, mode or flag behind). Code traced by torch.compile, export or
FX, and calls under ``use_torch_frame``, run torch's own frame (``_compat.torch_frame``), told about the user's
hooks as sac2's is.
"""

from __future__ import annotations

import inspect
import warnings
from typing import TYPE_CHECKING, Any, Callable, ContextManager

import torch
import torch.utils.checkpoint as _tuc
from torch.compiler import is_compiling

from sac2 import _compat, messages
from sac2.core import notices
from sac2.core.notices import count_forward
from sac2.frame.contexts import selective
from sac2.frame.debug_trace import OpTrace
from sac2.frame.frame import Frame, Holder
from sac2.frame.switches import torch_frame_in_use
from sac2.messages.internal import InternalError
from sac2.offload import schedule

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["run", "frames"]

Tensor = torch.Tensor
ContextFn = _compat.ContextFn

_DETERMINISM_CHECKS = ("default", "none")


def _delegated() -> bool:
    """Whether this call runs on torch's frame: code torch.compile/export/FX traces, or the switch."""
    return torch_frame_in_use() or _compat.traced_checkpoint()


def _validate(determinism_check: str) -> None:
    if determinism_check not in _DETERMINISM_CHECKS:
        raise ValueError(messages.bad_determinism_check(_DETERMINISM_CHECKS, determinism_check))


def run(
    function: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    use_reentrant: bool | None = None,
    **options: Unpack[_compat.FrameOptions],
) -> Any:
    """``function(*args, **kwargs)`` checkpointed (``sac2.checkpoint``): the one place a call's checkpoint is chosen.
    torch's own checkpoint for ``use_reentrant=True`` (its reentrant frame) and under torch.compile (what dynamo
    turns into its HOP); else torch's eager frame where sac2's does not apply (``_delegated``); else sac2's."""
    if use_reentrant or is_compiling():
        return _torch_checkpoint(function, args, kwargs, bool(use_reentrant), options)
    _validate(options["determinism_check"])
    if _delegated():
        told: list[object] = []
        out = _compat.run_torch_frame(function, args, kwargs, **_telling(options, told))
        _warn_if_bypassed(told, stacklevel=5)
        return out
    forward = _Forward.start(function, args, kwargs, options)
    if forward is None:
        return function(*args, **kwargs)
    try:
        out = function(*args, **kwargs)
    except BaseException as error:
        forward.end(error)
        raise
    forward.end(None)
    return out


def frames(
    function: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], **options: Unpack[_compat.FrameOptions]
) -> _compat.FrameGenerator:
    """The same as ``run``'s eager frames, in the shape of torch's frame: a generator that yields once, while the
    function runs, and that torch's ``checkpoint`` drives with ``next``/``throw`` while sac2 is installed (torch's
    checkpoint has already chosen its reentrant frame or its HOP where they apply)."""
    _validate(options["determinism_check"])
    if _delegated():
        told: list[object] = []
        yield from _compat.torch_frame(function, args, kwargs, **_telling(options, told))
        _warn_if_bypassed(told, stacklevel=4)
        return
    forward = _Forward.start(function, args, kwargs, options)
    if forward is None:
        yield
        return
    try:
        yield
    except BaseException as error:
        forward.end(error)
        raise
    forward.end(None, stacklevel=5)  # warnings point at the line calling torch's checkpoint


class _Forward:
    """One checkpointed forward on sac2's frame, between ``start`` (before the function runs) and ``end``."""

    __slots__ = ("frame", "context", "pack", "warn_bypassed")

    def __init__(self, frame: Frame, context: ContextManager[object] | None, warn_bypassed: bool) -> None:
        self.frame, self.context, self.warn_bypassed = frame, context, warn_bypassed
        self.pack, unpack = frame.hooks()
        _enter(context, self.pack, unpack)

    @classmethod
    def start(
        cls, function: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], o: _compat.FrameOptions
    ) -> _Forward | None:
        """The forward's frame, entered; None in no-grad mode, where nothing is saved to checkpoint."""
        forward_context, recompute_context, warn_bypassed = _contexts(o["context_fn"], o["respect_saved_tensors_hooks"])
        if not torch.is_grad_enabled():
            return None
        if forward_context is None:
            count_forward()  # full AC on sac2's frame; a selective forward counts when its context enters
        early_stop = _compat.early_stop_override()  # torch.utils.checkpoint.set_checkpoint_early_stop, if in effect
        # The policy's contexts may ask for the inputs in host memory (``sac2.offload``): what full AC keeps.
        sac2s = selective(forward_context) if forward_context is not None else None
        offload_inputs = sac2s is not None and sac2s.offload_inputs
        block = schedule.begin(args)  # left as this forward ends or raises
        try:
            frame = Frame(function, args, kwargs, o["preserve_rng_state"], recompute_context, o["determinism_check"],
                          o["early_stop"] if early_stop is None else early_stop, block, offload_inputs)
            # torch's checkpoint operator run eagerly (the eager backend) sets its graph id on its contexts (torch's
            # or sac2's): no fallback
            operator = forward_context is not None and getattr(forward_context, "ac_graph_id", None) is not None
            debug = _compat.checkpoint_debug_override()  # torch's set_checkpoint_debug_enabled, if in effect
            if o["debug"] if debug is None else debug:
                frame.trace = OpTrace()
                forward_context = frame.trace.around(forward_context)
            forward = cls(frame, forward_context, warn_bypassed)
        except BaseException:
            schedule.abandon()
            raise
        if not operator and _compat.in_compile_region() and _compat.graph_task() is None:
            # an eager forward inside a compiled caller: dynamo broke the graph at this checkpoint (not in a recompute)
            try:
                notices.fell_back(function)
            except BaseException as error:  # the warnings filter makes it an error: leave nothing entered
                forward.end(error)
                raise
        return forward

    def end(self, error: BaseException | None, stacklevel: int = 6) -> None:
        """Leave the forward (``error``: what it raised); ``stacklevel`` of the line that called ``checkpoint``."""
        try:
            _exit(self.context, self.pack, error)
        except BaseException:
            schedule.abandon()
            raise
        if error is not None:
            schedule.abandon()
            return
        schedule.end()
        _completed(self.frame)
        if self.warn_bypassed:
            _warn_if_bypassed([self.context], stacklevel)


def _contexts(
    context_fn: ContextFn, respect_saved_tensors_hooks: bool | None
) -> tuple[ContextManager[object] | None, ContextManager[object] | None, bool]:
    """The (forward, recompute) contexts ``context_fn`` gives ((None, None) for torch's no-op default, which the
    frame then skips entering), told whether what they save goes through the user's saved-tensor hooks in scope
    (rule 7); and whether torch's FutureWarning is due if something is saved (the hooks were bypassed by default)."""
    if context_fn is _compat.noop_context_fn:
        return None, None, False
    forward_context, recompute_context = context_fn()
    _compat.tell_torch_sac_modes(forward_context, respect_saved_tensors_hooks)
    sac2s = selective(forward_context)
    if sac2s is None:  # not sac2's: torch's or the user's own contexts
        return forward_context, recompute_context, False
    hooks = _compat.user_saved_tensors_hooks()
    sac2s.saved_tensors_hooks = hooks if respect_saved_tensors_hooks else None
    return forward_context, recompute_context, hooks is not None and respect_saved_tensors_hooks is None


def _warn_if_bypassed(contexts: list[object], stacklevel: int) -> None:
    """torch's FutureWarning, once the forward is done, if one of ``contexts`` (forward contexts whose saves
    bypassed the user's hooks by default) saved something."""
    for context in contexts:
        sac2s = selective(context)
        if sac2s is not None and sac2s.saves_anything():
            warnings.warn(messages.HOOKS_BYPASSED, FutureWarning, stacklevel=stacklevel)
            return


def _telling(options: _compat.FrameOptions, told: list[object]) -> _compat.FrameOptions:
    """``options`` for torch's frame, with a ``context_fn`` that tells sac2's forward context about the user's
    saved-tensor hooks as sac2's frame does (rule 7); forward contexts owing the warning go to ``told``."""
    context_fn, respect = options["context_fn"], options["respect_saved_tensors_hooks"]
    if context_fn is _compat.noop_context_fn:
        return options

    def telling() -> tuple[ContextManager[object], ContextManager[object]]:
        forward, recompute, warn = _contexts(context_fn, respect)
        if forward is None or recompute is None:
            raise InternalError(messages.internal_error(messages.NO_CONTEXTS))
        if warn:
            told.append(forward)
        return forward, recompute

    return {**options, "context_fn": telling}


def _enter(
    forward_context: ContextManager[object] | None,
    pack: Callable[[Tensor], Holder],
    unpack: Callable[[Holder], Tensor],
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
    forward_context: ContextManager[object] | None, pack: Callable[[Tensor], Holder], error: BaseException | None
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
    frame.end_forward()
    if frame.rng is not None and _compat.device_initialized_since(frame.devices, frame.rng):
        raise RuntimeError(messages.DEVICE_INITIALIZED_IN_FORWARD)


#: torch 2.14+ takes ``respect_saved_tensors_hooks`` (for its own SAC modes); torch 2.13 would hand it to the
#: checkpointed function as a keyword argument.
_TORCH_TAKES_HOOKS_FLAG = "respect_saved_tensors_hooks" in inspect.signature(_tuc.checkpoint).parameters


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


def _traced_body(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
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
