"""Compiled code inside selective checkpointing: ``compiled_region()`` and ``region()``.

A checkpointed block that calls ``torch.compile``d code (``torch.compile(flex_attention)`` is the usual case)
runs it under sac2's dispatch modes. Every dispatcher-visible call of the compiled code then pays a Python
dispatch, and the policy never sees the generated kernels, so it can neither save nor recompute them as a unit.

- ``compiled_region()`` runs its body with sac2's modes off this thread's stack and torch's "inside a dispatch
  mode" flags cleared: compiled code inside compiles and runs as it would with no checkpoint. sac2 does not
  see the body, which autograd's checkpoint recomputes in backward like any un-recorded code.
- ``region(fn)`` makes each call of ``fn`` one op for the policy, named by a ``sac2.Region``: saved, it keeps
  its outputs and its backward state and never runs in backward; recomputed, it runs exactly once in backward.
  Either way its body runs in a ``compiled_region()``.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, TypeVar, overload

import torch

from sac2 import _compat, dispatch_flags, regions
from sac2.keys import Region
from sac2.modes import SacMode

__all__ = ["compiled_region", "region", "call_region", "region_key"]

F = TypeVar("F", bound=Callable[..., Any])


def _sac2_top() -> list:
    """The sac2 modes at the top of this thread's dispatch-mode stack, innermost last; [] outside sac2 SAC."""
    stack = _compat.dispatch_mode_stack()
    k = len(stack)
    while k and isinstance(stack[k - 1], SacMode):
        k -= 1
    if k and any(isinstance(m, SacMode) for m in stack[:k]):
        above = stack[k - 1]
        raise RuntimeError(
            f"sac2.compiled_region: {type(above).__module__}.{type(above).__qualname__} is on the dispatch-mode "
            f"stack above sac2's modes; sac2 pops only its own modes, which must be innermost. Enter that mode "
            f"outside the checkpointed function, or inside the region's body."
        )
    return stack[k:]


class compiled_region:
    """Run the body outside sac2's modes: compiled code in it compiles and runs with no Python dispatch overhead.

    Inside a sac2 forward or recompute, pops sac2's modes (which must be the innermost ones) and clears torch's
    dispatch-mode flags for the body; on exit, normal or by exception, restores both. Nests; a no-op outside
    sac2 SAC and under torch.compile tracing. sac2 records nothing the body runs, so the checkpoint recomputes the
    body in backward; use ``sac2.region`` to let the policy save it instead.
    """

    __slots__ = ("_popped",)

    def __init__(self) -> None:
        self._popped: list = []

    def __enter__(self) -> None:
        if torch.compiler.is_compiling():
            return
        modes = _sac2_top()
        for mode in modes:
            mode.before_unrecorded()
        for _ in modes:
            self._popped.append(_compat.pop_mode())
        if modes:
            dispatch_flags.sync()

    def __exit__(self, *exc: Any) -> None:
        if not self._popped:
            return
        while self._popped:
            _compat.push_mode(self._popped.pop())
        dispatch_flags.sync()


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


def _run(fn: Callable, *args: Any, **kwargs: Any) -> Any:
    with compiled_region():
        return fn(*args, **kwargs)


def _run_kept(fn: Callable, *args: Any, **kwargs: Any) -> Any:
    # Hooks pushed inside the checkpoint take precedence: autograd keeps real tensors, not checkpoint placeholders.
    with torch.autograd.graph.saved_tensors_hooks(_identity, _identity), compiled_region():
        return fn(*args, **kwargs)


_regions: dict[str, Region] = {}


def region_key(name: str) -> Region:
    """The one ``Region`` object of a name (``ReplayMode`` matches keys by identity)."""
    return _regions.setdefault(name, Region(name))


def call_region(key: Region, fn: Callable, args: tuple, kwargs: dict) -> Any:
    """``fn(*args, **kwargs)`` as a region call: one op for the policy inside sac2 SAC, traced inside an annotation
    under torch.compile, a plain call elsewhere."""
    if torch.compiler.is_compiling():
        with _compat.annotate_region(key.name):  # traced through: the policy decides its ops as one region
            return fn(*args, **kwargs)
    modes = _sac2_top() if _compat.mode_stack_len() else ()
    if modes:
        return modes[-1].region(key, functools.partial(_run, fn), functools.partial(_run_kept, fn), args, kwargs)
    context = regions.active()
    if context is not None:
        return context.region(key, functools.partial(_run, fn), functools.partial(_run_kept, fn), args, kwargs)
    return fn(*args, **kwargs)


@overload
def region(fn: F, *, name: str | None = None) -> F: ...
@overload
def region(fn: None = None, *, name: str | None = None) -> Callable[[F], F]: ...
def region(fn: Callable | None = None, *, name: str | None = None) -> Any:
    """Make each call of ``fn`` one op for sac2's selective checkpointing, named ``name`` (``fn.__qualname__``).

    Use as ``@sac2.region``, ``@sac2.region(name="attn")`` or ``sac2.region(fn, name="attn")``. Inside sac2 SAC
    the policy receives ``sac2.Region(name)`` as ``op`` with the call's arguments, before the body runs, so
    ``ctx.op_output`` is None; ``sac2.Region(name)`` in a save list saves it. Saved: the outputs and what the
    body's backward needs are kept, and the body does not run in backward. Recomputed: the body runs once more in
    backward. Either way the body runs in ``compiled_region()``. Outside sac2 SAC, a call just calls ``fn``.
    """
    if fn is None:
        return functools.partial(region, name=name)
    key = region_key(name or fn.__qualname__)

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        return call_region(key, fn, args, kwargs)

    return call
