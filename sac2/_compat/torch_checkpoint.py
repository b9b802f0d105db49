"""torch's own non-reentrant checkpoint frame: its generator (which ``use_torch_frame``, debug traces and traced code
run on), its options and errors, and the module globals through which torch's ``checkpoint`` and the composable
``checkpoint(module)`` call it (which ``install()`` points at sac2's frame).

Each shim names, in a ``Removable:`` line, the torch change that would let it go. They all hold on torch 2.13-2.15.
"""

from __future__ import annotations

import inspect
import types
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Generator, TypeAlias, TypedDict

import torch.utils.checkpoint as _tuc

from sac2 import messages
from sac2._compat.autograd import noop_context_fn

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = [
    "ContextFn",
    "FrameOptions",
    "FrameGenerator",
    "CheckpointError",
    "DEBUG_TIP",
    "checkpoint_debug_override",
    "early_stop_override",
    "TORCH_FRAME",
    "torch_frame",
    "run_torch_frame",
    "tell_torch_sac_modes",
    "as_torch_frame",
    "torch_frame_bindings",
]


#: A checkpoint's ``context_fn``: the (forward, recompute) context managers for one call.
ContextFn: TypeAlias = Callable[[], tuple[ContextManager[object], ContextManager[object]]]
#: A checkpoint frame as torch's checkpoint drives it: yields once, while the function runs.
FrameGenerator: TypeAlias = Generator[None, None, None]


class FrameOptions(TypedDict):
    """The keyword options of a checkpoint frame (``sac2.frame.entry.run``/``frames``, torch's generator)."""

    preserve_rng_state: bool
    context_fn: ContextFn
    determinism_check: str
    debug: bool
    early_stop: bool
    respect_saved_tensors_hooks: bool | None


# Removable: never: public; kept beside torch's frame.
CheckpointError = _tuc.CheckpointError

#: The tip torch's frame appends to its determinism errors.
# Removable: torch stops appending a private tip, or exports it.
DEBUG_TIP: str = getattr(_tuc, "_debug_tip_msg", "")


def checkpoint_debug_override() -> bool | None:
    """What ``torch.utils.checkpoint.set_checkpoint_debug_enabled`` set (it overrides ``debug``, True or False), or
    None outside it.

    Removable: torch exposes the state of ``set_checkpoint_debug_enabled``.
    """
    override: bool | None = getattr(_tuc, "_checkpoint_debug_enabled", None)
    return override


def early_stop_override() -> bool | None:
    """What ``torch.utils.checkpoint.set_checkpoint_early_stop`` set, or None outside it.

    Removable: torch exposes the state of ``set_checkpoint_early_stop``.
    """
    override: bool | None = getattr(_tuc, "_enable_checkpoint_early_stop", None)
    return override


#: torch's own non-reentrant frame generator, as torch's checkpoint calls it on this version.
#: Removable: sac2 stops offering torch's frame (``use_torch_frame``, one release) and install() stops
#: swapping the frame under torch's checkpoint.
TORCH_FRAME: Callable[..., FrameGenerator] = getattr(
    _tuc, "_checkpoint_without_reentrant_generator_impl", _tuc._checkpoint_without_reentrant_generator
)


_FRAME_TAKES_TUPLES = TORCH_FRAME.__name__.endswith("_impl")  # 2.15: (fn, args, kwargs, *, options)
_FRAME_TAKES_HOOKS_FLAG = "respect_saved_tensors_hooks" in inspect.signature(TORCH_FRAME).parameters


def torch_frame(
    function: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], **options: Unpack[FrameOptions]
) -> FrameGenerator:
    """torch's frame generator for one call (``options``: the keyword options of ``sac2.frame.entry.frames``).

    Removable: sac2 stops offering torch's frame (``use_torch_frame``, kept for one release).
    """
    o = options
    if _FRAME_TAKES_TUPLES:
        flag = {"respect_saved_tensors_hooks": o["respect_saved_tensors_hooks"]} if _FRAME_TAKES_HOOKS_FLAG else {}
        return TORCH_FRAME(function, args, kwargs, preserve_rng_state=o["preserve_rng_state"],
                           context_fn=o["context_fn"], determinism_check=o["determinism_check"], debug=o["debug"],
                           early_stop=o["early_stop"], **flag)
    return TORCH_FRAME(function, o["preserve_rng_state"], o["context_fn"], o["determinism_check"], o["debug"],
                       o["early_stop"], *args, **kwargs)


def run_torch_frame(
    function: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], **options: Unpack[FrameOptions]
) -> Any:
    """``function(*args, **kwargs)`` under torch's frame, driven as torch's ``checkpoint`` drives it.

    Removable: sac2 stops offering torch's frame (``use_torch_frame``, kept for one release).
    """
    gen = torch_frame(function, args, kwargs, **options)
    next(gen)
    try:
        out = function(*args, **kwargs)
    except BaseException as error:
        try:
            gen.throw(error)
        except StopIteration as stop:
            raise RuntimeError(messages.CONTEXT_SUPPRESSED_ERROR) from stop
        raise
    try:
        next(gen)
    except StopIteration:
        return out
    raise AssertionError(messages.FRAME_YIELDED_TWICE)


_TorchCachingMode = _tuc._CachingTorchDispatchMode


def tell_torch_sac_modes(forward_context: object, respect_saved_tensors_hooks: bool | None) -> None:
    """torch 2.14+'s frame tells its own SAC caching mode whether to route saved tensors through the user's hooks.

    Removable: torch 2.13 support ends (2.14+ passes the flag itself) or torch's SAC modes take it in their constructor.
    """
    if _FRAME_TAKES_HOOKS_FLAG and isinstance(forward_context, _TorchCachingMode):
        # torch 2.13's mode has no such attribute (and never gets here); 2.14+'s has.
        forward_context.respect_saved_tensors_hooks = (  # type: ignore[attr-defined,unused-ignore]
            respect_saved_tensors_hooks
        )


def as_torch_frame(frames: Callable[..., FrameGenerator]) -> Callable[..., FrameGenerator]:
    """``sac2.frame.entry.frames`` in the calling convention of torch's frame generator on this torch (2.13/2.14:
    positional options then ``*args, **kwargs``; 2.15: ``(fn, args, kwargs, *, options)``).

    Removable: torch's checkpoint accepts a frame publicly (or install() stops swapping the frame).
    """
    noop: ContextFn = noop_context_fn
    # One signature per torch version: mypy wants conditional definitions alike (the [misc] ignores below).
    if _FRAME_TAKES_TUPLES:

        def generator(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], *,
                      preserve_rng_state: bool = True, context_fn: ContextFn = noop,
                      determinism_check: str = "default", debug: bool = False, early_stop: bool = True,
                      respect_saved_tensors_hooks: bool | None = None) -> FrameGenerator:
            return frames(fn, args, kwargs, preserve_rng_state=preserve_rng_state, context_fn=context_fn,
                          determinism_check=determinism_check, debug=debug, early_stop=early_stop,
                          respect_saved_tensors_hooks=respect_saved_tensors_hooks)

    elif _FRAME_TAKES_HOOKS_FLAG:

        def generator(fn: Callable[..., Any], preserve_rng_state: bool = True,  # type: ignore[misc]
                      context_fn: ContextFn = noop, determinism_check: str = "default", debug: bool = False,
                      early_stop: bool = True, *args: Any, respect_saved_tensors_hooks: bool | None = None,
                      **kwargs: Any) -> FrameGenerator:
            return frames(fn, args, kwargs, preserve_rng_state=preserve_rng_state, context_fn=context_fn,
                          determinism_check=determinism_check, debug=debug, early_stop=early_stop,
                          respect_saved_tensors_hooks=respect_saved_tensors_hooks)

    else:

        def generator(fn: Callable[..., Any], preserve_rng_state: bool = True,  # type: ignore[misc]
                      context_fn: ContextFn = noop, determinism_check: str = "default", debug: bool = False,
                      early_stop: bool = True, *args: Any, **kwargs: Any) -> FrameGenerator:
            return frames(fn, args, kwargs, preserve_rng_state=preserve_rng_state, context_fn=context_fn,
                          determinism_check=determinism_check, debug=debug, early_stop=early_stop,
                          respect_saved_tensors_hooks=None)

    generator.__name__ = generator.__qualname__ = TORCH_FRAME.__name__
    return generator


def torch_frame_bindings() -> list[tuple[types.ModuleType, str]]:
    """(module, attribute) of each module global through which torch calls its frame generator: its
    ``checkpoint``'s, and the composable ``torch.distributed._composable.checkpoint``'s.

    Removable: torch's checkpoint accepts a frame publicly (or install() stops swapping the frame).
    """
    name = TORCH_FRAME.__name__
    found: list[tuple[types.ModuleType, str]] = [(_tuc, name)]
    try:
        import torch.distributed._composable.checkpoint_activation as composable
    except ImportError:  # torch built without distributed
        return found
    if getattr(composable, name, None) is TORCH_FRAME:
        found.append((composable, name))
    return found
