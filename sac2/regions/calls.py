"""Regions: a callable (``sac2.region``) or a module call (``sac2.regions.in_models``) that selective checkpointing sees
as one op, named by a ``sac2.Region`` (``sac2.core.keys``).

Inside sac2 SAC a region call asks the policy once, before it runs (``ctx.op_output`` is None). Saved, it keeps its
outputs and what its body's backward needs, and its body does not run in backward; recomputed, its body runs once more
in backward. Either way the body runs in ``compiled_region()``, so compiled code in it runs at full speed. How a region
call is recorded and replayed is ``sac2.record.regions``; under torch.compile it is traced through inside an
annotation and the policy decides its nodes as one region (``sac2.modes.tracing``). Outside sac2 SAC it is a plain call.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Protocol, TypeVar, overload

import torch
from torch import nn
from torch.compiler import is_compiling

from sac2 import _compat
from sac2._compat import annotate_region  # by name: the compiled path reads no global another module reads
from sac2.core.keys import Region
from sac2.modes.compiled import compiled_region, sac2_modes_on_top
from sac2.record import region_saves, regions
from sac2.record.regions import RegionCall

__all__ = [
    "region", "call_region", "traced_region", "region_key", "in_region_context", "module_region", "plain_call",
    "RegionHandler",
]

F = TypeVar("F", bound=Callable[..., Any])


def _body(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """A region's body runs in ``compiled_region()``: compiled code in it runs at full speed (with no dispatch mode
    on the stack, a dispatch-free context's, there is nothing to take off). A saved region's body runs under
    saved-tensor hooks of ``sac2.record.region_saves``, which take precedence over the checkpoint's."""
    if not _compat.mode_stack_len():
        return fn(*args, **kwargs)
    with compiled_region():
        return fn(*args, **kwargs)


_regions: dict[str, Region] = {}


def region_key(name: str) -> Region:
    """The one ``Region`` object of a name (``ReplayMode`` matches keys by identity)."""
    key = _regions.get(name)
    if key is None:
        key = _regions[name] = Region(name)
    return key


def in_region_context() -> bool:
    """Whether a ``call_region`` here is a region call (inside sac2 SAC, or traced by torch.compile), not a plain
    call."""
    if is_compiling() or regions.active() is not None:
        return True
    return bool(_compat.mode_stack_len() and sac2_modes_on_top())


class RegionHandler(Protocol):
    """What decides a region call and records or replays it: the innermost sac2 mode (``SacMode.region``) or
    dispatch-free context (``sac2.record.regions.RegionForward``/``RegionReplay``)."""

    def region(self, call: RegionCall) -> Any:
        """Run ``call`` as one op of the policy's: saved, recomputed, or served in recompute."""
        ...


def call_region(
    key: Region, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], pure: bool = False
) -> Any:
    """``fn(*args, **kwargs)`` as a region call: one op for the policy inside sac2 SAC, traced inside an annotation
    under torch.compile, a plain call elsewhere. ``pure``: the caller knows ``fn`` draws no random numbers and
    writes none of its arguments here (``sac2.record.regions.RegionCall.pure``)."""
    if is_compiling():
        return traced_region(key.name, fn, args, kwargs)
    body = fn  # no mode on the stack: nothing for ``compiled_region()`` to take off
    handler: RegionHandler | None = None
    if _compat.mode_stack_len():
        body = functools.partial(_body, fn)
        modes = sac2_modes_on_top()
        if modes:
            handler = modes[-1]
    if handler is None:
        handler = regions.active()
    if handler is None:
        return fn(*args, **kwargs)
    return handler.region(RegionCall(key, body, args, kwargs, pure))


def traced_region(name: str, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``fn(*args, **kwargs)`` traced by torch.compile inside region ``name``'s annotation: the policy decides its
    ops as one region. Takes the name, not the ``Region``, so a caller can keep dynamo's guards to a constant."""
    with annotate_region(name):
        return fn(*args, **kwargs)


@overload
def region(fn: F, *, name: str | None = None, keep_inputs: bool | None = None) -> F: ...
@overload
def region(fn: None = None, *, name: str | None = None, keep_inputs: bool | None = None) -> Callable[[F], F]: ...
def region(fn: Callable[..., Any] | None = None, *, name: str | None = None, keep_inputs: bool | None = None) -> Any:
    """Make each call of ``fn`` one op for sac2's selective checkpointing, named ``name`` (``fn.__qualname__``).

    Use as ``@sac2.region``, ``@sac2.region(name="attn")`` or ``sac2.region(fn, name="attn")``. Inside sac2 SAC
    the policy receives ``sac2.Region(name)`` as ``op`` with the call's arguments, before the body runs, so
    ``ctx.op_output`` is None; ``sac2.Region(name)`` in a save list saves it. Saved: the outputs and what the
    body's backward needs are kept, and the body does not run in backward. Recomputed: the body runs once more in
    backward. Either way the body runs in ``compiled_region()``. Outside sac2 SAC, a call just calls ``fn``.

    What a saved body saves of its own inputs (a matmul's input) is rebuilt from them in recompute, not kept;
    ``keep_inputs=True`` keeps it for real (inputs a nondeterministic producer made, e.g. GPU atomics), ``False``
    rebuilds it again, None leaves the region's setting as it is (``sac2.record.region_saves.keep_inputs``).

    Args:
        fn: the function whose calls become regions. None (the default) makes the decorator form,
            ``@sac2.region(name=...)``.
        name: the region's name, what ``sac2.Region(name)`` matches; default ``fn.__qualname__``. Regions of one
            name share their ``keep_inputs`` setting.
        keep_inputs: True keeps for real what a saved body saves of its own inputs; False rebuilds it in
            recompute; None (the default) leaves the name's setting as it is (rebuilt unless set).

    Returns:
        A function that calls ``fn`` as a region (``functools.wraps(fn)``); in the decorator form, a decorator
        that makes one.
    """
    if fn is None:
        return functools.partial(region, name=name, keep_inputs=keep_inputs)
    key = region_key(name or fn.__qualname__)
    if keep_inputs is not None:
        region_saves.keep_inputs([key.name], keep_inputs)

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        return call_region(key, fn, args, kwargs)

    return call


def module_region(cls: type[nn.Module]) -> Callable[..., Any]:
    """The forward of ``cls``'s region subclass (``sac2.regions.in_models``): each call one call of the region its
    module is named for (``_sac2_region``), pure where it is ``nn.Linear``'s own forward on plain tensors."""
    parent = cls.forward
    linear = parent is _LINEAR_FORWARD

    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        name: str = vars(self)["_sac2_region"]  # set by make_regions (vars: nn.Module types its attributes as tensors)
        body = parent.__get__(self)
        if is_compiling():  # its name alone is guarded, not a Region every block shares
            return traced_region(name, body, args, kwargs)
        return call_region(region_key(name), body, args, kwargs, linear and _plain_linear(self, args, kwargs))

    return forward


_LINEAR_FORWARD = nn.Linear.forward


def _plain_linear(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether a call of ``nn.Linear``'s own forward draws no random numbers: its weight and bias plain parameters
    of the module (a parametrization computes them instead, and may draw: DropConnect), on plain tensors."""
    params = vars(module)["_parameters"]
    if "weight" not in params or "bias" not in params:
        return False
    return plain_call((*args, params["weight"], params["bias"]), kwargs)


def plain_call(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether calling a torch function with these arguments runs that function itself: no torch-function or
    dispatch mode on the stack, and no tensor subclass but ``Parameter`` among the arguments (any of which could
    run other code, random ops included). A matmul called so draws no random numbers."""
    if _compat.mode_stack_len() or _compat.function_mode_stack_len():
        return False
    for a in (*args, *kwargs.values()):
        if isinstance(a, Tensor) and type(a) is not Tensor and type(a) is not _Parameter:
            return False
    return True


Tensor, _Parameter = torch.Tensor, nn.Parameter
