"""Compiled code inside selective checkpointing: ``compiled_region()``.

A checkpointed block that calls ``torch.compile``d code (``torch.compile(flex_attention)`` is the usual case)
runs it under sac2's dispatch modes. Every dispatcher-visible call of the compiled code then pays a Python
dispatch, and the policy never sees the generated kernels, so it can neither save nor recompute them as a unit.

- ``compiled_region()`` runs its body with sac2's modes off this thread's stack and torch's "inside a dispatch
  mode" flags cleared: compiled code inside compiles and runs as it would with no checkpoint. sac2 does not
  see the body, which autograd's checkpoint recomputes in backward like any un-recorded code.
- ``sac2.region(fn)`` (``sac2.regions.calls``) makes each call of ``fn`` one op for the policy; its body runs in a
  ``compiled_region()``.
"""

from __future__ import annotations

from typing import Any, Callable, TypeVar

from torch.compiler import is_compiling

from sac2 import _compat, messages
from sac2.modes import dispatch_flags
from sac2.modes.forward import SacMode

__all__ = ["compiled_region", "sac2_modes_on_top"]

F = TypeVar("F", bound=Callable[..., Any])


def sac2_modes_on_top() -> list[SacMode]:
    """The sac2 modes at the top of this thread's dispatch-mode stack, innermost last; [] outside sac2 SAC."""
    stack = _compat.dispatch_mode_stack()
    k = len(stack)
    while k and isinstance(stack[k - 1], SacMode):
        k -= 1
    if k and any(isinstance(m, SacMode) for m in stack[:k]):
        raise RuntimeError(messages.mode_above_sac2_modes(stack[k - 1]))
    return [m for m in stack[k:] if isinstance(m, SacMode)]  # all of them: the isinstance is for the type


class compiled_region:
    """Run the body outside sac2's modes: compiled code in it compiles and runs with no Python dispatch overhead.

    Inside a sac2 forward or recompute, pops sac2's modes (which must be the innermost ones) and clears torch's
    dispatch-mode flags for the body; on exit, normal or by exception, restores both. Nests; a no-op outside
    sac2 SAC and under torch.compile tracing. sac2 records nothing the body runs, so the checkpoint recomputes the
    body in backward; use ``sac2.region`` to let the policy save it instead. Takes no arguments:
    ``with sac2.compiled_region(): out = compiled_fn(x)``.

    Raises:
        RuntimeError: on entering, another dispatch mode is on the stack above sac2's modes (enter it outside the
            checkpointed function, or inside the body).
    """

    __slots__ = ("_popped",)

    def __init__(self) -> None:
        self._popped: list[_compat.TorchDispatchMode] = []

    def __enter__(self) -> None:
        if is_compiling():
            return
        modes = sac2_modes_on_top()
        for mode in modes:
            mode.before_unrecorded()
        for _ in modes:
            self._popped.append(_compat.pop_mode())
        if modes:
            dispatch_flags.sync()

    def __exit__(self, *exc: object) -> None:
        if not self._popped:
            return
        while self._popped:
            _compat.push_mode(self._popped.pop())
        dispatch_flags.sync()
