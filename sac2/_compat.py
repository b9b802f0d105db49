"""Every private torch API sac2 touches, in one place, so a torch upgrade changes one file.

Each name here says what sac2 needs, not how torch spells it today.
"""

from __future__ import annotations

import itertools
import threading
from typing import Any, Callable

import torch
import torch.fx.traceback as fx_traceback
import torch.utils.checkpoint as _tuc
from torch.utils import _python_dispatch as _pd
from torch.utils import _pytree

__all__ = [
    "OpOverload",
    "OpOverloadPacket",
    "HigherOrderOperator",
    "TorchDispatchMode",
    "FakeTensor",
    "tree_map",
    "tree_leaves",
    "FLEX_ATTENTION",
    "IGNORED_OPS",
    "noop_context_fn",
    "detach_keeping_version",
    "tracing_for_compile",
    "tag_traced_nodes",
    "mode_stack_len",
    "dispatch_mode_stack",
    "pop_mode",
    "push_mode",
    "sync_dispatch_flags",
    "dispatch_flags",
    "INDUCTOR_COMPILED_CODE",
    "TRITON_MUTATION",
    "compiled_callable_key",
    "triton_written_args",
    "backward_keeps_graph",
    "skip_dynamo",
    "default_generator",
    "allocation_sizes",
    "CheckpointImpl",
    "register_activation_wrapper",
    "wrap_policy_targets",
]

#: The op types the dispatcher hands to a mode, the mode base class, and pytree helpers: all live in torch
#: modules whose names start with an underscore.
OpOverload = torch._ops.OpOverload
OpOverloadPacket = torch._ops.OpOverloadPacket
HigherOrderOperator = torch._ops.HigherOrderOperator
TorchDispatchMode = _pd.TorchDispatchMode
FakeTensor = torch._subclasses.FakeTensor
tree_map = _pytree.tree_map
tree_leaves = _pytree.tree_leaves

#: Ops that forward and recompute legitimately run a different number of times (detach, metadata queries
#: issued by the determinism check); torch's own SAC skips exactly these.
IGNORED_OPS: frozenset = frozenset(_tuc.SAC_IGNORED_OPS)

#: torch's "no context" sentinel: dynamo recognises exactly this object as "no selective policy".
noop_context_fn = _tuc.noop_context_fn

_ADInplaceOrView = torch._C.DispatchKey.ADInplaceOrView
_ExcludeGuard = torch._C._SetExcludeDispatchKeyGuard


def detach_keeping_version(t: torch.Tensor) -> torch.Tensor:
    """Detach below autograd so the alias shares the version counter and carries no autograd metadata.

    The version counter lets sac2 see later in-place writes; no autograd metadata lets autograd treat the
    tensor as a fresh output (view ops call ``as_view`` on it) when it is served in recompute.
    """
    with _ExcludeGuard(_ADInplaceOrView, False):
        return t.detach()


def tracing_for_compile() -> bool:
    """True while AOTAutograd traces a checkpointed region (a proxy mode is active, not export tracing)."""
    if torch.compiler._is_non_strict_tracing():
        return False
    return torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.PROXY) is not None


def tag_traced_nodes(run: Callable[[], Any], ac_graph_id: int, policy_of: Callable[[Any], Any]) -> Any:
    """Run ``run()`` under compile tracing and tag the FX nodes it adds with torch's recompute metadata.

    ``policy_of(out)`` returns the torch ``CheckpointPolicy`` for the op's output; the partitioner reads
    ``node.meta["recompute"]`` and ``node.meta["ac_graph_id"]``.
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


def mode_stack_len() -> int:
    """Depth of this thread's Python dispatch-mode stack."""
    return _pd._len_torch_dispatch_stack()


def dispatch_mode_stack() -> list:
    """This thread's dispatch-mode stack, innermost (the mode that dispatches first) last."""
    return _pd._get_current_dispatch_mode_stack()


def pop_mode() -> Any:
    """Pop the innermost mode off this thread's stack, leaving torch's "in a mode" flags alone."""
    return _pd._pop_mode()


def push_mode(mode: Any) -> None:
    """Push ``mode`` back onto this thread's stack, leaving torch's "in a mode" flags alone."""
    _pd._push_mode(mode)


_flags_lock = threading.Lock()
_flags_of_thread: dict[int, tuple[bool, bool, bool]] = {}  # threads inside sac2 -> what their own stack needs
_sac2_depth: dict[int, int] = {}  # threads inside sac2 -> how many sac2 modes they are in


_class_flags: dict[type, tuple[bool, bool]] = {}


def _own_dispatch_flags() -> tuple[bool, bool, bool]:
    """What this thread's own mode stack needs the three flags to be (runs at every sac2 mode enter and exit)."""
    n = _pd._len_torch_dispatch_stack()
    non_infra = not_ignoring = False
    for i in range(n):
        cls = type(_pd._get_dispatch_stack_at(i))
        flags = _class_flags.get(cls)
        if flags is None:  # both are classmethods: ask once per mode class
            flags = _class_flags[cls] = (not cls.is_infra_mode(), not cls.ignore_compile_internals())
        non_infra |= flags[0]
        not_ignoring |= flags[1]
    return n > 0, non_infra, not_ignoring


def sync_dispatch_flags(depth_change: int = 0) -> None:
    """Set torch's process-wide "inside a dispatch mode" flags to what every thread inside sac2 needs.

    torch keeps ``_is_in_torch_dispatch_mode``, ``_is_in_non_infra_torch_dispatch_mode`` and
    ``_is_in_any_mode_without_ignore_compile_internals`` (mirrored in C++) as globals that each mode saves on enter
    and restores on exit, so threads whose modes overlap leave them stuck True. sac2 sets each flag to the OR, over
    the threads inside sac2 and the calling thread, of what that thread's own mode stack says. A thread never reads
    False while it has a mode that needs True (compiled-region wrapping keys off it), and the flags drop back once
    the last thread leaves. ``depth_change`` is +1 when the caller enters a sac2 mode, -1 when it leaves one.
    """
    in_mode, non_infra, not_ignoring = own = _own_dispatch_flags()
    tid = threading.get_ident()
    with _flags_lock:
        depth = _sac2_depth.get(tid, 0) + depth_change
        if depth > 0:
            _sac2_depth[tid] = depth
            _flags_of_thread[tid] = own
        else:
            _sac2_depth.pop(tid, None)
            _flags_of_thread.pop(tid, None)
        for a, b, c in _flags_of_thread.values():
            in_mode, non_infra, not_ignoring = in_mode or a, non_infra or b, not_ignoring or c
        _pd._is_in_torch_dispatch_mode, _pd._is_in_non_infra_torch_dispatch_mode = in_mode, non_infra
        _pd._is_in_any_mode_without_ignore_compile_internals = not_ignoring
        _pd.set_is_in_mode_without_ignore_compile_internals(not_ignoring)


def dispatch_flags() -> tuple[bool, bool, bool]:
    """torch's three "inside a dispatch mode" flags, as ``sync_dispatch_flags`` sets them."""
    return (
        _pd._is_in_torch_dispatch_mode,
        _pd._is_in_non_infra_torch_dispatch_mode,
        _pd._is_in_any_mode_without_ignore_compile_internals,
    )


def _hop(module: str, name: str) -> Any:
    try:
        mod = __import__(f"torch._higher_order_ops.{module}", fromlist=[name])
        return getattr(mod, name)
    except (ImportError, AttributeError):
        return None


#: The HOP a compiled region runs as under a dispatch mode (``wrap_inductor_compiled_regions``).
INDUCTOR_COMPILED_CODE = _hop("wrap", "inductor_compiled_code")
#: flex attention, eager or compiled.
FLEX_ATTENTION = _hop("flex_attention", "flex_attention")
#: The HOP a user Triton kernel runs as; it returns None and writes into its tensor kwargs.
TRITON_MUTATION = _hop("triton_kernel_wrap", "triton_kernel_wrapper_mutation")


def compiled_callable_key(args: tuple) -> tuple[int, str | None]:
    """(unique index, name given to torch.compile) of the compiled callable an inductor_compiled_code call runs."""
    from torch._higher_order_ops.wrap import _resolve_inductor_callable

    fn = _resolve_inductor_callable(args[0])
    return fn.idx, fn.compile_region_name


_triton_writes: dict[tuple, list[str]] = {}


def triton_written_args(kwargs: dict) -> list[str]:
    """Names of the tensor kwargs a ``triton_kernel_wrapper_mutation`` call writes into.

    Uses torch's own kernel analysis; if that analysis fails, every tensor kwarg counts as written.
    """
    from torch._higher_order_ops.triton_kernel_wrap import get_mutated_tensors, kernel_side_table

    inner = kwargs["kwargs"]
    tma = kwargs.get("tma_descriptor_metadata", {})
    # The analysis compiles the kernel to TTIR: cache it per kernel, constants, scalar values and tensor names
    # (by value: torch reuses side-table indices after resetting the table).
    key = (
        kernel_side_table.get_kernel(kwargs["kernel_idx"]),
        repr(kernel_side_table.get_constant_args(kwargs["constant_args_idx"])),
        tuple((k, None if isinstance(v, torch.Tensor) else repr(v)) for k, v in inner.items()),
        repr(tma),
    )
    names = _triton_writes.get(key)
    if names is None:
        try:
            names = get_mutated_tensors(kwargs["kernel_idx"], kwargs["constant_args_idx"], inner, tma)
        except Exception:  # the analysis is best effort upstream too; fall back to the safe superset
            names = [k for k, v in inner.items() if isinstance(v, torch.Tensor)]
        _triton_writes[key] = names
    return names


def backward_keeps_graph() -> bool:
    """Whether the running backward was asked to keep its graph (``retain_graph=True``): then a later backward
    can recompute the same region again, so what recompute serves must stay in the record."""
    return torch._C._autograd._get_current_graph_task_keep_graph()


def skip_dynamo(fn: Callable) -> Callable:
    """Never let dynamo trace ``fn`` or what it calls: what ``torch._disable_dynamo(recursive=True)`` does for a
    dispatch mode's ``__torch_dispatch__``, marked on the code object instead of a wrapper frame on every call
    (that wrapper costs about a microsecond per op on sac2's hottest path)."""
    from torch._C._dynamo.eval_frame import _FrameAction, _FrameExecStrategy, set_code_exec_strategy

    set_code_exec_strategy(fn.__code__, _FrameExecStrategy(_FrameAction.SKIP, _FrameAction.SKIP))
    return fn


def default_generator(device: torch.device) -> torch.Generator:
    """The default RNG generator that random ops on ``device`` draw from."""
    if device.type == "cpu":
        return torch.default_generator
    module = torch.get_device_module(device.type)
    index = device.index if device.index is not None else module.current_device()
    return module.default_generators[index]


def allocation_sizes(prof: torch.profiler.profile) -> list[int]:
    """Signed sizes of the allocations (+) and frees (-) a finished ``profile_memory=True`` profiler recorded,
    in time order."""
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    events.sort(key=lambda e: e.start_ns())
    return [e.nbytes() for e in events]


# --- module wrappers (sac2.wrappers) ---
try:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import ActivationWrapper as _ActivationWrapper
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl
except ImportError:  # torch built without distributed: same members, so user code reads the same
    import enum as _enum

    _ActivationWrapper = None
    CheckpointImpl = _enum.Enum("CheckpointImpl", ["REENTRANT", "NO_REENTRANT"])  # type: ignore[misc]


def register_activation_wrapper(cls: type) -> None:
    """Make ``isinstance(m, torch's ActivationWrapper)`` hold for sac2's wrappers, so torch code that looks through
    activation wrappers (FSDP1's ``.module``) looks through ours."""
    if _ActivationWrapper is not None:
        _ActivationWrapper.register(cls)


def wrap_policy_targets(policy: Any, root: torch.nn.Module) -> dict:
    """The modules an FSDP ``_Policy`` object (``CustomPolicy``) selects under ``root``, each with its kwargs."""
    run = getattr(policy, "_run_policy", None)
    if run is None:
        raise ValueError(f"sac2: auto_wrap_policy {policy!r} is neither callable nor an FSDP wrap policy.")
    return run(root, ignored_modules=set(), root_kwargs={})
