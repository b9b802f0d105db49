"""torch's own non-reentrant checkpoint frame: its generator (which ``use_torch_frame``, debug traces and traced code
run on), its options and errors, and the module globals through which torch's ``checkpoint`` and the composable
``checkpoint(module)`` call it (which ``install()`` points at sac2's frame).

Each shim names, in a ``Removable:`` line, the torch change that would let it go. They all hold on torch 2.13-2.15.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

import torch.utils.checkpoint as _tuc

from sac2._compat.autograd import graph_exec_group, noop_context_fn

__all__ = [
    "CheckpointError",
    "DEBUG_TIP",
    "unpacked_twice_message",
    "checkpoint_debug_override",
    "early_stop_override",
    "TORCH_FRAME",
    "torch_frame",
    "run_torch_frame",
    "tell_torch_sac_modes",
    "as_torch_frame",
    "torch_frame_bindings",
]


# Removable: never: public; kept beside torch's frame.
CheckpointError = _tuc.CheckpointError

#: The tip torch's frame appends to its determinism errors.
# Removable: torch stops appending a private tip, or exports it.
DEBUG_TIP: str = getattr(_tuc, "_debug_tip_msg", "")


def unpacked_twice_message() -> str:
    """torch's error for a saved tensor unpacked a second time in one backward.

    Removable: torch exports its checkpoint error messages.
    """
    extra = ""
    if graph_exec_group() is not None:
        extra = (
            "Performing two backward calls that overlap (i.e. require the same saved activation in order to compute "
            "gradients) is not allowed while under the torch.utils.checkpoint.GraphExecGroup context. "
        )
    return (
        "torch.utils.checkpoint: Unpack is being triggered for a tensor that was already unpacked once. "
        f"{extra}If you are calling ctx.saved_tensors in backward, make sure to do so only once. Otherwise please "
        "open an issue with details on your use case."
    )


def checkpoint_debug_override() -> bool:
    """``torch.utils.checkpoint.set_checkpoint_debug_enabled(True)`` in effect.

    Removable: torch exposes the state of ``set_checkpoint_debug_enabled``.
    """
    return bool(getattr(_tuc, "_checkpoint_debug_enabled", None))


def early_stop_override() -> bool | None:
    """What ``torch.utils.checkpoint.set_checkpoint_early_stop`` set, or None outside it.

    Removable: torch exposes the state of ``set_checkpoint_early_stop``.
    """
    return getattr(_tuc, "_enable_checkpoint_early_stop", None)


#: torch's own non-reentrant frame generator, as torch's checkpoint calls it on this version.
#: Removable: sac2 stops offering torch's frame (``use_torch_frame``, one release) and install() stops
#: swapping the frame under torch's checkpoint.
TORCH_FRAME: Callable[..., Any] = getattr(
    _tuc, "_checkpoint_without_reentrant_generator_impl", _tuc._checkpoint_without_reentrant_generator
)


_FRAME_TAKES_TUPLES = TORCH_FRAME.__name__.endswith("_impl")  # 2.15: (fn, args, kwargs, *, options)
_FRAME_TAKES_HOOKS_FLAG = "respect_saved_tensors_hooks" in inspect.signature(TORCH_FRAME).parameters


def torch_frame(function: Callable, args: tuple, kwargs: dict, **options: Any) -> Any:
    """torch's frame generator for one call (``options``: the keyword options of ``sac2.frame.frames``).

    Removable: sac2 stops offering torch's frame (``use_torch_frame``, kept for one release).
    """
    flag = options.pop("respect_saved_tensors_hooks", None)
    if _FRAME_TAKES_HOOKS_FLAG:
        options["respect_saved_tensors_hooks"] = flag
    if _FRAME_TAKES_TUPLES:
        return TORCH_FRAME(function, args, kwargs, **options)
    o = options
    return TORCH_FRAME(function, o["preserve_rng_state"], o["context_fn"], o["determinism_check"], o["debug"],
                       o["early_stop"], *args, **kwargs)


def run_torch_frame(function: Callable, args: tuple, kwargs: dict, **options: Any) -> Any:
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
            raise RuntimeError(
                "torch.utils.checkpoint: the forward context provided by context_fn suppressed an exception raised "
                "during the checkpointed forward. This is not supported because checkpoint cannot return a value "
                "for a failed forward."
            ) from stop
        raise
    try:
        next(gen)
    except StopIteration:
        return out
    raise AssertionError("torch.utils.checkpoint: expected the frame generator to yield exactly once")


_TorchCachingMode = getattr(_tuc, "_CachingTorchDispatchMode", None)


def tell_torch_sac_modes(forward_context: Any, respect_saved_tensors_hooks: bool | None) -> None:
    """torch 2.14+'s frame tells its own SAC caching mode whether to route saved tensors through the user's hooks.

    Removable: torch 2.13 support ends (2.14+ passes the flag itself) or torch's SAC modes take it in their constructor.
    """
    if _FRAME_TAKES_HOOKS_FLAG and isinstance(forward_context, _TorchCachingMode):
        forward_context.respect_saved_tensors_hooks = respect_saved_tensors_hooks


def as_torch_frame(frames: Callable[..., Any]) -> Callable[..., Any]:
    """``sac2.frame.frames`` in the calling convention of torch's frame generator on this torch (2.13/2.14:
    positional options then ``*args, **kwargs``; 2.15: ``(fn, args, kwargs, *, options)``).

    Removable: torch's checkpoint accepts a frame publicly (or install() stops swapping the frame).
    """
    noop = noop_context_fn
    if _FRAME_TAKES_TUPLES:

        def generator(fn: Callable, args: tuple, kwargs: dict, *, preserve_rng_state: bool = True,
                      context_fn: Callable = noop, determinism_check: str = "default", debug: bool = False,
                      early_stop: bool = True, respect_saved_tensors_hooks: bool | None = None) -> Any:
            return frames(fn, args, kwargs, preserve_rng_state=preserve_rng_state, context_fn=context_fn,
                          determinism_check=determinism_check, debug=debug, early_stop=early_stop,
                          respect_saved_tensors_hooks=respect_saved_tensors_hooks)

    elif _FRAME_TAKES_HOOKS_FLAG:

        def generator(fn: Callable, preserve_rng_state: bool = True, context_fn: Callable = noop,  # type: ignore[misc]
                      determinism_check: str = "default", debug: bool = False, early_stop: bool = True, *args: Any,
                      respect_saved_tensors_hooks: bool | None = None, **kwargs: Any) -> Any:
            return frames(fn, args, kwargs, preserve_rng_state=preserve_rng_state, context_fn=context_fn,
                          determinism_check=determinism_check, debug=debug, early_stop=early_stop,
                          respect_saved_tensors_hooks=respect_saved_tensors_hooks)

    else:

        def generator(fn: Callable, preserve_rng_state: bool = True, context_fn: Callable = noop,  # type: ignore[misc]
                      determinism_check: str = "default", debug: bool = False, early_stop: bool = True, *args: Any,
                      **kwargs: Any) -> Any:
            return frames(fn, args, kwargs, preserve_rng_state=preserve_rng_state, context_fn=context_fn,
                          determinism_check=determinism_check, debug=debug, early_stop=early_stop)

    generator.__name__ = generator.__qualname__ = TORCH_FRAME.__name__
    return generator


def torch_frame_bindings() -> list[tuple[Any, str]]:
    """(module, attribute) of each module global through which torch calls its frame generator: its
    ``checkpoint``'s, and the composable ``torch.distributed._composable.checkpoint``'s.

    Removable: torch's checkpoint accepts a frame publicly (or install() stops swapping the frame).
    """
    name = TORCH_FRAME.__name__
    found: list[tuple[Any, str]] = [(_tuc, name)]
    try:
        import torch.distributed._composable.checkpoint_activation as composable
    except ImportError:  # torch built without distributed
        return found
    if getattr(composable, name, None) is TORCH_FRAME:
        found.append((composable, name))
    return found
