"""How a checkpointed call enters a frame: ``run`` (``sac2.checkpoint``) and ``frames`` (torch's ``checkpoint``
while sac2 is installed) pick sac2's frame or torch's, then enter the forward's saved-tensor hooks and the
policy's contexts, and leave them as the forward ends or raises.

Of the rules ``sac2.frame.frame`` lists, this module keeps 7 (what a selective policy saves and the user's saved-tensor
hooks) and 8 (exceptions in forward leave no hook, mode or flag behind). Code traced by torch.compile, export or
FX, and calls under ``use_torch_frame``, run torch's own frame (``_compat.torch_frame``), told about the user's
hooks as sac2's is.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any, Callable, ContextManager

import torch

from sac2 import _compat, messages
from sac2.core import notices
from sac2.core.notices import count_forward
from sac2.frame.debug_trace import OpTrace
from sac2.frame.frame import Frame, Holder
from sac2.frame.switches import torch_frame_in_use
from sac2.messages.internal import InternalError

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
    function: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], **options: Unpack[_compat.FrameOptions]
) -> Any:
    """``function(*args, **kwargs)`` checkpointed by sac2's frame, or by torch's where sac2's does not apply."""
    _validate(options["determinism_check"])
    if _delegated():
        told: list[ContextManager[object] | None] = []
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
    """The same as ``run``, in the shape of torch's frame: a generator that yields once, while the function runs,
    and that torch's ``checkpoint`` drives with ``next``/``throw`` while sac2 is installed."""
    _validate(options["determinism_check"])
    if _delegated():
        told: list[ContextManager[object] | None] = []
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
        frame = Frame(function, args, kwargs, o["preserve_rng_state"], recompute_context, o["determinism_check"],
                      o["early_stop"] if early_stop is None else early_stop)
        # torch's checkpoint operator run eagerly (the eager backend) sets its graph id on its contexts: no fallback
        operator = getattr(forward_context, "ac_graph_id", None) is not None
        debug = _compat.checkpoint_debug_override()  # torch.utils.checkpoint.set_checkpoint_debug_enabled, if in effect
        if o["debug"] if debug is None else debug:
            frame.trace = OpTrace()
            forward_context = frame.trace.around(forward_context)
        forward = cls(frame, forward_context, warn_bypassed)
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
        _exit(self.context, self.pack, error)
        if error is not None:
            return
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
    if not hasattr(forward_context, "saved_tensors_hooks"):  # not sac2's: torch's or the user's own contexts
        return forward_context, recompute_context, False
    hooks = _compat.user_saved_tensors_hooks()
    forward_context.saved_tensors_hooks = hooks if respect_saved_tensors_hooks else None
    return forward_context, recompute_context, hooks is not None and respect_saved_tensors_hooks is None


def _warn_if_bypassed(contexts: list[ContextManager[object] | None], stacklevel: int) -> None:
    """torch's FutureWarning, once the forward is done, if one of ``contexts`` (forward contexts whose saves
    bypassed the user's hooks by default) saved something."""
    for context in contexts:
        record = getattr(context, "record", None)
        if record is not None and record.saves_anything():
            warnings.warn(messages.HOOKS_BYPASSED, FutureWarning, stacklevel=stacklevel)
            return


def _telling(options: _compat.FrameOptions, told: list[ContextManager[object] | None]) -> _compat.FrameOptions:
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
