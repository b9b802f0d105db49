"""What sac2 asks of torch.compile's dynamo around a checkpoint: to keep the Python side effects of a checkpointed
function in the graph rather than break it, whether code runs inside a compile region, and dynamo's last graph break.

A checkpointed function that sets and resets an attribute of an object from outside the checkpoint (transformers
5.25's attention wrapper, from the ``kernels`` package, does so with a context variable on every call) makes dynamo
refuse the checkpoint's body ("HOP: Unsafe side effect"): the graph breaks and the whole checkpoint runs eagerly,
because eager checkpointing replays such a change in recompute and a graph cannot. Compiled code without
checkpointing applies it once per call, and so does a checkpoint whose body dynamo lets keep it.

Each shim names, in a ``Removable:`` line, the torch change that would let it go. They all hold on torch 2.13-2.15.
"""

from __future__ import annotations

import sys
from types import FrameType
from typing import Any, Callable, TypeVar

from torch._C._dynamo.eval_frame import get_eval_frame_callback

from sac2._compat.dispatch import tracing_for_compile

__all__ = ["side_effects_kept", "keep_checkpoint_side_effects", "in_compile_region", "last_graph_break"]

T = TypeVar("T")

#: dynamo's switch that lets every checkpoint's body keep its Python side effects.
_KEEP_SIDE_EFFECTS = "skip_fwd_side_effects_in_bwd_under_checkpoint"


def side_effects_kept(function: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``function(*args, **kwargs)``. Traced by dynamo inside a checkpoint's body, the changes it makes to Python
    objects from outside the checkpoint are kept in the graph (applied once, as without checkpointing) instead of
    breaking it. Called only where dynamo is loaded (a checkpoint torch.compile traced).

    Removable: torch lets a checkpoint's body keep side effects per call publicly (this is its own hook for
    activation checkpointing outside torch, private).
    """
    from torch._dynamo.utils import _disable_side_effect_safety_checks_for_current_subtracer as keeping

    return keeping(function, *args, **kwargs)


def keep_checkpoint_side_effects(keep: bool) -> bool:
    """Set whether dynamo lets the body of every checkpoint it traces (torch's own ``checkpoint`` calls included)
    keep its Python side effects, as ``side_effects_kept`` does per call; return the setting it had.

    Removable: never, while ``install()`` routes torch's own checkpoint calls (a public dynamo setting).
    """
    import torch._dynamo.config as config

    was: bool = getattr(config, _KEEP_SIDE_EFFECTS)
    setattr(config, _KEEP_SIDE_EFFECTS, keep)
    return was


def in_compile_region() -> bool:
    """Whether this code runs, not traced, inside a call of code torch.compile compiled: Python dynamo left to run
    eagerly (after a graph break, or in a frame it skipped or that ``torch.compiler.disable`` wraps, such as torch's
    own ``checkpoint``). False in plain eager code (compiled submodules called from it included) and while dynamo
    traces or compiles.

    Removable: torch offers a public 'inside a compile region' query. Where dynamo compiles the frames this code
    calls, its frame callback is set (torch's own ``set_stance`` check reads it); beneath ``torch.compiler.disable``
    it is not, and the compiled code calling it is known by its code object (dynamo's map of the code it made).
    """
    if tracing_for_compile():
        return False
    callback = get_eval_frame_callback()
    if callback is not None and callback is not False:
        return True
    made = getattr(sys.modules.get("torch._dynamo.utils"), "orig_code_map", None)
    if made is None or not made.values:  # nothing compiled in this process (since torch._dynamo.reset())
        return False
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        if frame.f_code in made:
            return True
        frame = frame.f_back
    return False


def last_graph_break() -> tuple[str, str] | None:
    """dynamo's most recent graph break in this process, as (reason, ``file:line`` of the user code where it broke),
    or None if there was none since ``torch._dynamo.reset()``.

    Removable: dynamo reports graph breaks through a public callback.
    """
    utils = sys.modules.get("torch._dynamo.utils")
    reasons = getattr(utils, "graph_break_reasons", None)
    if not reasons:
        return None
    last = reasons[-1]
    stack = getattr(last, "user_stack", None) or []
    where = f"{stack[-1].filename}:{stack[-1].lineno}" if stack else "unknown"
    return str(getattr(last, "reason", last)), where
