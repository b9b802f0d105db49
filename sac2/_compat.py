"""Every private torch API sac2 touches, in one place, so a torch upgrade changes one file.

Each name here says what sac2 needs, not how torch spells it today.
"""

from __future__ import annotations

import contextlib
import itertools
import sys
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
    "annotate_region",
    "traced_region",
    "mode_stack_len",
    "dispatch_mode_stack",
    "no_modes",
    "pop_mode",
    "push_mode",
    "mode_classes",
    "set_dispatch_flags",
    "dispatch_flags",
    "INDUCTOR_COMPILED_CODE",
    "TRITON_MUTATION",
    "compiled_regions_wrapped",
    "compiled_callable_key",
    "triton_written_args",
    "backward_keeps_graph",
    "skip_dynamo_in_mode",
    "direct_call",
    "schema",
    "has_ordered_effect",
    "storage_id",
    "has_internal_overlap",
    "op_packet",
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


_TRACING_MODES = (
    torch._C._TorchDispatchModeKey.PROXY,
    torch._C._TorchDispatchModeKey.FAKE,
    torch._C._TorchDispatchModeKey.FUNCTIONAL,
)


def tracing_for_compile() -> bool:
    """True while torch.compile traces (dynamo's fake propagation, AOTAutograd's metadata pass, joint tracing,
    partitioning): a proxy, fake or functional mode is active, and tensors have no real storage. Export's
    non-strict tracing runs eagerly and is not tracing here."""
    if torch.compiler._is_non_strict_tracing():
        return False
    return any(torch._C._get_dispatch_mode(k) is not None for k in _TRACING_MODES)


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


_REGION = "sac2_region"


def annotate_region(name: str) -> Any:
    """While torch.compile traces, mark the FX nodes traced in the body as belonging to region ``name``."""
    return fx_traceback.annotate({_REGION: name})


def traced_region() -> str | None:
    """The region the op being traced belongs to (see ``annotate_region``), or None."""
    custom = fx_traceback.current_meta.get("custom")
    return custom.get(_REGION) if custom else None


def mode_stack_len() -> int:
    """Depth of this thread's Python dispatch-mode stack."""
    return _pd._len_torch_dispatch_stack()


def dispatch_mode_stack() -> list:
    """This thread's dispatch-mode stack, innermost (the mode that dispatches first) last."""
    return _pd._get_current_dispatch_mode_stack()


_NO_CONTEXT = contextlib.nullcontext()


def no_modes() -> Any:
    """A context manager that takes every dispatch mode off this thread's stack for its body."""
    return _pd._disable_current_modes() if _pd._len_torch_dispatch_stack() else _NO_CONTEXT


def pop_mode() -> Any:
    """Pop the innermost mode off this thread's stack, leaving torch's "in a mode" flags alone."""
    return _pd._pop_mode()


def push_mode(mode: Any) -> None:
    """Push ``mode`` back onto this thread's stack, leaving torch's "in a mode" flags alone."""
    _pd._push_mode(mode)


def mode_classes() -> list[type]:
    """The classes of the modes on this thread's dispatch-mode stack, outermost first."""
    return [type(_pd._get_dispatch_stack_at(i)) for i in range(_pd._len_torch_dispatch_stack())]


def set_dispatch_flags(in_mode: bool, non_infra: bool, not_ignoring: bool) -> None:
    """Set torch's three process-wide "inside a dispatch mode" flags (the last one mirrored into C++)."""
    _pd._is_in_torch_dispatch_mode, _pd._is_in_non_infra_torch_dispatch_mode = in_mode, non_infra
    _pd._is_in_any_mode_without_ignore_compile_internals = not_ignoring
    _pd.set_is_in_mode_without_ignore_compile_internals(not_ignoring)


def dispatch_flags() -> tuple[bool, bool, bool]:
    """torch's three "inside a dispatch mode" flags, as ``sac2.dispatch_flags.sync`` sets them."""
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


def compiled_regions_wrapped() -> bool:
    """Whether compiled code runs as ``inductor_compiled_code`` under a dispatch mode
    (``torch._inductor.config.wrap_inductor_compiled_regions``), where a policy can match it by name."""
    config = sys.modules.get("torch._inductor.config")
    return bool(getattr(config, "wrap_inductor_compiled_regions", False))


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


def skip_dynamo_in_mode(cls: type) -> None:
    """Never let dynamo trace a mode's ``__torch_dispatch__`` or what it calls: what torch's default
    ``_should_skip_dynamo`` does with a ``torch._disable_dynamo(recursive=True)`` wrapper frame on every call
    (about a microsecond per op on sac2's hottest path), marked on the code object instead."""
    from torch._C._dynamo.eval_frame import _FrameAction, _FrameExecStrategy, set_code_exec_strategy

    cls._should_skip_dynamo = classmethod(lambda c: False)  # type: ignore[attr-defined]
    set_code_exec_strategy(cls.__torch_dispatch__.__code__, _FrameExecStrategy(_FrameAction.SKIP, _FrameAction.SKIP))


def direct_call(op: Any) -> Callable[..., Any]:
    """The fastest callable that runs ``op`` as calling it would: an OpOverload's C++ handle (what
    ``OpOverload.__call__`` calls, minus a Python frame) where that is what torch calls, else the op itself
    (HOPs; custom ops whose ``_op`` is a Python dispatcher on torch 2.14+, which ``__call__`` guards)."""
    if isinstance(op, OpOverload):
        handle = op._op
        if type(handle).__name__ == "builtin_function_or_method":
            return handle
    return op


def schema(op: Any) -> Any:
    """An OpOverload's ``torch.FunctionSchema``."""
    return op._schema


def has_ordered_effect(op: Any) -> bool:
    """Whether an op has an ORDERED side effect (``aten._print``, torchbind calls...): it must not run twice.
    c10d ops are excepted, as in torch 2.15's SAC (they return async work handles, no value to cache)."""
    try:
        from torch._higher_order_ops.effects import _EffectType, _get_effect, has_effects

        if getattr(op, "namespace", None) == "c10d" or not has_effects(op):
            return False
        return _get_effect(op) == _EffectType.ORDERED
    except Exception:  # not an op torch's effect registry knows
        return False


def storage_id(t: torch.Tensor) -> int | None:
    """An id of the storage ``t`` lives in, shared by every alias of it; None for wrapper subclasses (DTensor,
    nested jagged tensors), whose storage is not real."""
    if _pd.is_traceable_wrapper_subclass(t):
        return None
    return t.untyped_storage()._cdata


def has_internal_overlap(t: torch.Tensor) -> bool:
    """Whether some elements of ``t`` share memory (an expanded view): it cannot be written with ``copy_``."""
    return torch._debug_has_internal_overlap(t) == 1


def op_packet(op: Any) -> Any:
    """The OpOverloadPacket of an OpOverload (``aten.mm`` for ``aten.mm.default``); the op itself otherwise."""
    return getattr(op, "_overloadpacket", op)


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


# --- pickling ---
# An OpOverload holds pybind11 function records and a HOP holds local functions: neither pickles, so neither does
# a policy or a context_fn holding one (the HF Trainer pickles its TrainingArguments). sac2 registers a reducer
# with copyreg that rebuilds an op by its path under ``torch.ops``; importing sac2 is enough, for torch's own list
# policies too. The loading process must have the op registered (import the module defining a custom op first).
import copyreg  # noqa: E402

__all__ += ["op_path", "op_at_path", "register_op_pickling"]


def op_path(op: Any) -> str:
    """An op's path under ``torch.ops``: ``aten.mm.default``, ``higher_order.flex_attention``."""
    if isinstance(op, OpOverload):
        namespace, name = op._schema.name.split("::")
        return f"{namespace}.{name}.{op._overloadname}"
    return f"higher_order.{op.name()}"


def op_at_path(path: str) -> Any:
    """The op ``op_path`` named: the very object this process's ``torch.ops`` holds."""
    obj: Any = torch.ops
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def _reduce_op(op: Any) -> tuple:
    return op_at_path, (op_path(op),)


def register_op_pickling(ops: Any) -> None:
    """Register the reducer for the type of each op among ``ops`` (tuple keys are looked into). pickle finds a
    reducer by exact type, and each HOP has a class of its own: one defined after sac2's import needs this."""
    for item in ops:
        for op in item if type(item) is tuple else (item,):
            if isinstance(op, (OpOverload, HigherOrderOperator)) and type(op) not in copyreg.dispatch_table:
                copyreg.pickle(type(op), _reduce_op)


def _subclasses(cls: type) -> list[type]:
    return [cls, *(s for sub in cls.__subclasses__() for s in _subclasses(sub))]


for _cls in _subclasses(OpOverload) + _subclasses(HigherOrderOperator):
    copyreg.pickle(_cls, _reduce_op)


# --- nested checkpoints ---
__all__ += ["in_checkpoint_forward"]

#: The code of the pack hook torch's non-reentrant checkpoint pushes for its forward (``_checkpoint_hook``).
_CHECKPOINT_PACK = next(
    (c for c in _tuc._checkpoint_hook.__init__.__code__.co_consts if getattr(c, "co_name", None) == "pack_hook"), None
)


def in_checkpoint_forward() -> bool:
    """Whether this thread runs inside the forward of a non-reentrant ``torch.utils.checkpoint`` (sac2's, HF's,
    torch's wrappers): the innermost saved-tensor hooks are that checkpoint's. Hooks pushed inside it
    (``save_on_cpu``) hide it; its recompute in backward pushes other hooks, so does not count."""
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    if hooks is None or _CHECKPOINT_PACK is None:
        return False
    return getattr(hooks[0], "__code__", None) is _CHECKPOINT_PACK


# --- the partitioner's compute-intensive ops (sac2.policies.torchtitan) ---
__all__ += ["partitioner_compute_intensive_ops"]


def partitioner_compute_intensive_ops() -> list:
    """The default overloads of the ops AOTAutograd's min-cut partitioner counts as compute intensive
    (``get_default_op_list().compute_intensive_ops``): where torchtitan's default save list starts."""
    from torch._functorch.partitioners import get_default_op_list

    return [packet.default for packet in get_default_op_list().compute_intensive_ops]


# --- the user's saved-tensor hooks (sac2.checkpoint's respect_saved_tensors_hooks) ---
__all__ += ["user_saved_tensors_hooks"]


def user_saved_tensors_hooks() -> tuple[Callable, Callable] | None:
    """The (pack, unpack) pair a tensor saved for backward right now would go through, or None, looking past the
    hooks checkpoints push themselves (an outer checkpoint's placeholders, its recompute's capture) to the user's.

    torch 2.14+ marks its own hooks and keeps the pair beneath them (``_current_user_saved_tensors_hooks``); on
    2.13 they are recognised by the module that defines them, and the pair beneath is read by popping them for a
    moment. Either way nested checkpoints resolve to the hooks the user pushed.
    """
    lookup = getattr(_tuc, "_current_user_saved_tensors_hooks", None)
    if lookup is not None:
        return lookup()
    autograd = torch._C._autograd
    hooks = autograd._top_saved_tensors_default_hooks(False)
    if hooks is None or not _checkpoint_internal(hooks):
        return hooks
    if not autograd._saved_tensors_hooks_is_enabled():
        return None  # hooks can't be pushed back now; under disable_saved_tensors_hooks nothing may be saved
    popped = []
    try:
        while hooks is not None and _checkpoint_internal(hooks):
            popped.append(hooks)
            autograd._pop_saved_tensors_default_hooks()
            hooks = autograd._top_saved_tensors_default_hooks(False)
    finally:
        for pack, unpack in reversed(popped):
            autograd._push_saved_tensors_default_hooks(pack, unpack)
    return hooks


def _checkpoint_internal(hooks: tuple[Callable, Callable]) -> bool:
    """Whether a hook pair is one torch's non-reentrant checkpoint pushed (torch 2.13: its unpack hooks are local
    functions of ``torch.utils.checkpoint``; its pack hook may be wrapped by ``torch._dynamo.disable``)."""
    return getattr(hooks[0], "_checkpoint_internal", False) or getattr(hooks[1], "__module__", None) == _tuc.__name__
