"""torch's dispatch-mode machinery as sac2 uses it: the mode stack, the "inside a mode" flags, detaching below
autograd, tracing for torch.compile and the FX metadata sac2's regions and tags ride on.

Each shim names, in a ``Removable:`` line, the torch change that would let it go. They all hold on torch 2.13-2.15.
"""

from __future__ import annotations

import contextlib
import itertools
import types
from typing import Callable, ContextManager, Protocol, TypeVar

import torch
import torch.fx._symbolic_trace as _fx_trace
import torch.fx.traceback as fx_traceback
import torch.utils.checkpoint as _tuc
from torch._C._dynamo.guards import set_is_in_mode_without_ignore_compile_internals as _set_not_ignoring
from torch.utils import _python_dispatch as _pd

__all__ = [
    "TorchDispatchMode", "detach_keeping_version", "detach_below_sac2", "tracing_for_compile", "tag_traced_nodes",
    "annotate_region", "traced_region", "mode_stack_len", "function_mode_stack_len", "dispatch_mode_stack",
    "no_modes", "pop_mode", "push_mode",
    "mode_classes", "set_dispatch_flags", "dispatch_flags", "skip_dynamo_in_mode", "skip_dynamo_in_code",
    "traced_checkpoint",
]


# Removable: ``torch.utils._python_dispatch`` becomes public.
TorchDispatchMode = _pd.TorchDispatchMode
_ADInplaceOrView = torch._C.DispatchKey.ADInplaceOrView
_is_excluded = torch._C._dispatch_tls_is_dispatch_key_excluded
_set_excluded = torch._C._dispatch_tls_set_dispatch_key_excluded


def detach_keeping_version(t: torch.Tensor) -> torch.Tensor:
    """Detach below autograd so the alias shares the version counter and carries no autograd metadata.

    The version counter lets sac2 see later in-place writes; no autograd metadata lets autograd treat the
    tensor as a fresh output (view ops call ``as_view`` on it) when it is served in recompute.

    Below autograd (a dispatch mode's handler) ADInplaceOrView, whose detach shares the counter, is excluded: it
    is included again for the call. Elsewhere (the region paths, once per served region) nothing is to change, and
    a guard object would cost more than the detach.

    Removable: a public detach that keeps the version counter below autograd exists.
    """
    if not _is_excluded(_ADInplaceOrView):
        return t.detach()
    _set_excluded(_ADInplaceOrView, False)
    try:
        return t.detach()
    finally:
        _set_excluded(_ADInplaceOrView, True)


_get_mode = torch._C._get_dispatch_mode
_PROXY = torch._C._TorchDispatchModeKey.PROXY
_FAKE = torch._C._TorchDispatchModeKey.FAKE
_FUNCTIONAL = torch._C._TorchDispatchModeKey.FUNCTIONAL


def detach_below_sac2(t: torch.Tensor) -> torch.Tensor:
    """``t.detach()``, past the Python dispatch modes when ``t`` is a plain tensor and every mode on the stack is
    sac2's (which do nothing for detach but cost a Python dispatch); otherwise through them, as torch's frame does.

    Removable: a Python mode can declare ops it ignores, so the dispatcher skips it for them.
    """
    if type(t) is torch.Tensor and all(getattr(m, "_sac2_mode", False) for m in _pd._get_current_dispatch_mode_stack()):
        with _no_python_dispatch():
            return t.detach()
    return t.detach()


_no_python_dispatch = torch._C._DisableTorchDispatch


def tracing_for_compile() -> bool:
    """True while torch.compile traces (dynamo's fake propagation, AOTAutograd's metadata pass, joint tracing,
    partitioning): a proxy, fake or functional mode is active, and tensors have no real storage. Export's
    non-strict tracing runs eagerly and is not tracing here.

    Removable: torch offers one public 'tracing with fake tensors' query (``is_compiling`` misses AOT's passes).
    """
    if _get_mode(_PROXY) is None and _get_mode(_FAKE) is None and _get_mode(_FUNCTIONAL) is None:
        return False
    return not torch.compiler._is_non_strict_tracing()


_T = TypeVar("_T")


def tag_traced_nodes(
    run: Callable[[], _T], ac_graph_id: int, policy_of: Callable[[_T], _tuc.CheckpointPolicy]
) -> _T:
    """Run ``run()`` under compile tracing and tag the FX nodes it adds with torch's recompute metadata.

    ``policy_of(out)`` returns the torch ``CheckpointPolicy`` for the op's output; the partitioner reads
    ``node.meta["recompute"]`` and ``node.meta["ac_graph_id"]``.

    Removable: SAC's FX tagging (``ac_graph_id``/``recompute`` meta) gets a public API.
    """
    from torch.fx.experimental.proxy_tensor import get_proxy_mode

    meta = fx_traceback.current_meta
    meta["ac_graph_id"] = ac_graph_id
    meta["recompute"] = _tuc.CheckpointPolicy.PREFER_RECOMPUTE
    proxy_mode = get_proxy_mode()
    graph = proxy_mode.tracer.graph if proxy_mode is not None else None
    before = len(graph.nodes) if graph is not None else 0
    out = run()
    policy = policy_of(out)
    if graph is not None:
        for node in itertools.islice(reversed(graph.nodes), len(graph.nodes) - before):
            node.meta["recompute"] = policy
    return out


_REGION = "sac2_region"


def annotate_region(name: str) -> ContextManager[None]:
    """While torch.compile traces, mark the FX nodes traced in the body as belonging to region ``name``.

    Removable: ``torch.fx.traceback.annotate`` is documented public.
    """
    return fx_traceback.annotate({_REGION: name})


def traced_region() -> str | None:
    """The region the op being traced belongs to (see ``annotate_region``), or None.

    Removable: ``torch.fx.traceback.annotate`` is documented public.
    """
    custom = fx_traceback.current_meta.get("custom")
    return custom.get(_REGION) if custom else None


#: ``mode_stack_len()``: the depth of this thread's Python dispatch-mode stack (torch's own function: every region
#: call and saved tensor asks, and a Python wrapper would add a frame). Removable: the stack gets a public API.
mode_stack_len: Callable[[], int] = torch._C._len_torch_dispatch_stack


#: ``function_mode_stack_len()``: the depth of this thread's torch-function-mode stack (``TorchFunctionMode``s,
#: ``with torch.device(...)``), torch's own function. Removable: the stack gets a public API.
function_mode_stack_len: Callable[[], int] = torch._C._len_torch_function_stack


def dispatch_mode_stack() -> list[TorchDispatchMode]:
    """This thread's dispatch-mode stack, innermost (the mode that dispatches first) last.

    Removable: the dispatch-mode stack gets a public API.
    """
    return _pd._get_current_dispatch_mode_stack()


_NO_CONTEXT = contextlib.nullcontext()
_len_stack = torch._C._len_torch_dispatch_stack


def no_modes() -> ContextManager[object]:
    """A context manager that takes every dispatch mode off this thread's stack for its body.

    Removable: the dispatch-mode stack gets a public API.
    """
    return _pd._disable_current_modes() if _len_stack() else _NO_CONTEXT


def pop_mode() -> TorchDispatchMode:
    """Pop the innermost mode off this thread's stack, leaving torch's "in a mode" flags alone.

    Removable: the dispatch-mode stack gets a public API.
    """
    mode: TorchDispatchMode = _pd._pop_mode()
    return mode


def push_mode(mode: TorchDispatchMode) -> None:
    """Push ``mode`` back onto this thread's stack, leaving torch's "in a mode" flags alone.

    Removable: the dispatch-mode stack gets a public API.
    """
    _pd._push_mode(mode)


def mode_classes() -> list[type[TorchDispatchMode]]:
    """The classes of the modes on this thread's dispatch-mode stack, outermost first.

    Removable: the dispatch-mode stack gets a public API.
    """
    modes: list[TorchDispatchMode] = [torch._C._get_dispatch_stack_at(i) for i in range(_len_stack())]
    return [type(m) for m in modes]


def set_dispatch_flags(in_mode: bool, non_infra: bool, not_ignoring: bool) -> None:
    """Set torch's three process-wide "inside a dispatch mode" flags (the last one mirrored into C++).

    Removable: torch keeps its 'inside a dispatch mode' flags per thread (pytorch: the overlap bug).
    """
    _pd._is_in_torch_dispatch_mode, _pd._is_in_non_infra_torch_dispatch_mode = in_mode, non_infra
    _pd._is_in_any_mode_without_ignore_compile_internals = not_ignoring
    _set_not_ignoring(not_ignoring)


def dispatch_flags() -> tuple[bool, bool, bool]:
    """torch's three "inside a dispatch mode" flags, as ``sac2.modes.dispatch_flags.sync`` sets them.

    Removable: torch keeps its 'inside a dispatch mode' flags per thread (pytorch: the overlap bug).
    """
    return (
        _pd._is_in_torch_dispatch_mode,
        _pd._is_in_non_infra_torch_dispatch_mode,
        _pd._is_in_any_mode_without_ignore_compile_internals,
    )


def skip_dynamo_in_mode(cls: type[TorchDispatchMode]) -> None:
    """Never let dynamo trace a mode's ``__torch_dispatch__`` or what it calls: what torch's default
    ``_should_skip_dynamo`` does with a ``torch._disable_dynamo(recursive=True)`` wrapper frame on every call
    (about a microsecond per op on sac2's hottest path), marked on the code object instead.

    Removable: a mode can opt out of dynamo without the per-call ``_disable_dynamo`` wrapper.
    """
    from torch._C._dynamo.eval_frame import _FrameAction, _FrameExecStrategy, set_code_exec_strategy

    # Replacing torch's classmethod on the class is the point; mypy reads the attribute as a bound method.
    cls._should_skip_dynamo = classmethod(lambda _cls: False)  # type: ignore[method-assign,assignment]
    set_code_exec_strategy(cls.__torch_dispatch__.__code__, _FrameExecStrategy(_FrameAction.SKIP, _FrameAction.SKIP))


class _Code(Protocol):
    """A Python function: what has a code object."""

    __code__: types.CodeType


def skip_dynamo_in_code(*functions: _Code) -> None:
    """Never let dynamo trace these functions, the functions they define (a hook made per call is a closure) or
    what any of them calls: marked on their code objects, no per-call cost. Autograd runs saved-tensor hooks from
    C++, so inside compiled code (a compiled submodule saving for backward) dynamo would otherwise trace them.

    Removable: ``torch.compiler.disable`` marks code objects instead of wrapping calls.
    """
    from torch._C._dynamo.eval_frame import _FrameAction, _FrameExecStrategy, set_code_exec_strategy

    skip = _FrameExecStrategy(_FrameAction.SKIP, _FrameAction.SKIP)
    codes = [fn.__code__ for fn in functions]
    while codes:
        code = codes.pop()
        set_code_exec_strategy(code, skip)
        codes.extend(c for c in code.co_consts if isinstance(c, types.CodeType))


#: Whether FX symbolic tracing (or a tracer built on it) is running: a module flag before torch 2.15, a
#: thread-local behind ``_get_is_fx_tracing`` from 2.15 on. Removable: ``is_fx_tracing`` stops warning (it now
#: warns on every call) or torch documents one of these.
def _fx_tracing_flag() -> bool:
    return bool(getattr(_fx_trace, "_is_fx_tracing_flag", False))


_fx_tracing: Callable[[], bool] = getattr(_fx_trace, "_get_is_fx_tracing", None) or _fx_tracing_flag


def traced_checkpoint() -> bool:
    """Whether a checkpoint now runs under torch.compile, export or FX tracing (not eager).

    Removable: torch offers one public 'tracing' query covering compile, export and FX.
    """
    return (
        torch.compiler.is_compiling()
        or torch.compiler._is_non_strict_tracing()
        or _fx_tracing()
        or tracing_for_compile()
    )
