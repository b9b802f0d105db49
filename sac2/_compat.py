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
    "flop_formula",
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


_get_mode = torch._C._get_dispatch_mode
_PROXY = torch._C._TorchDispatchModeKey.PROXY
_FAKE = torch._C._TorchDispatchModeKey.FAKE
_FUNCTIONAL = torch._C._TorchDispatchModeKey.FUNCTIONAL


def tracing_for_compile() -> bool:
    """True while torch.compile traces (dynamo's fake propagation, AOTAutograd's metadata pass, joint tracing,
    partitioning): a proxy, fake or functional mode is active, and tensors have no real storage. Export's
    non-strict tracing runs eagerly and is not tracing here."""
    if _get_mode(_PROXY) is None and _get_mode(_FAKE) is None and _get_mode(_FUNCTIONAL) is None:
        return False
    return not torch.compiler._is_non_strict_tracing()


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


def flop_formula(packet: Any) -> Callable[..., int] | None:
    """torch's FLOP formula for an op packet (``torch.utils.flop_counter``'s registry), or None."""
    from torch.utils.flop_counter import flop_registry

    return flop_registry.get(packet)


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
    """Whether this thread runs inside the forward of a non-reentrant checkpoint (sac2's frame, torch's: HF's,
    torch's wrappers): the innermost saved-tensor hooks are that checkpoint's. Hooks pushed inside it
    (``save_on_cpu``) hide it; its recompute in backward pushes other hooks, so does not count."""
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    if hooks is None:
        return False
    if getattr(hooks[0], "_sac2_forward", False):
        return True
    return _CHECKPOINT_PACK is not None and getattr(hooks[0], "__code__", None) is _CHECKPOINT_PACK


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

    Checkpoint-internal hooks (sac2's frame's, torch 2.14+'s) keep the pair beneath them as ``_user_hooks`` while on
    the stack; torch 2.13's are recognised by the module that defines them, and the pair beneath is read by popping
    them for a moment. Either way nested checkpoints resolve to the hooks the user pushed.
    """
    autograd = torch._C._autograd
    hooks = autograd._top_saved_tensors_default_hooks(False)
    while hooks is not None and _checkpoint_internal(hooks):
        beneath = getattr(hooks[0], "_user_hooks", _NOT_KEPT)
        if beneath is _NOT_KEPT:
            return _beneath_torch_hooks()
        hooks = beneath
    return hooks


_NOT_KEPT = object()


def _beneath_torch_hooks() -> tuple[Callable, Callable] | None:
    """torch 2.13: the first hook pair beneath the checkpoint-internal ones on top of the stack, found by popping
    them and pushing them back."""
    autograd = torch._C._autograd
    if not autograd._saved_tensors_hooks_is_enabled():
        return None  # hooks can't be pushed back now; under disable_saved_tensors_hooks nothing may be saved
    popped = []
    hooks = autograd._top_saved_tensors_default_hooks(False)
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


# --- the checkpoint frame (sac2.frame) ---
__all__ += [
    "CheckpointError", "DEBUG_TIP", "unpacked_twice_message", "checkpoint_devices", "autocast_state",
    "autocast_contexts", "rng_states", "set_rng_states", "device_initialized_since", "device_context",
    "fresh_device_context", "make_saved_tensor", "unpack_saved_tensor", "graph_task", "graph_exec_group",
    "push_checkpoint_hooks", "pop_checkpoint_hooks", "set_grad_enabled", "skip_dynamo_in_code",
    "checkpoint_debug_override", "early_stop_override", "traced_checkpoint", "run_torch_frame", "torch_frame",
    "tell_torch_sac_modes", "TORCH_FRAME",
]

import torch.fx._symbolic_trace as _fx_trace  # noqa: E402
import torch.overrides as _overrides  # noqa: E402
import torch.utils._device as _device  # noqa: E402

CheckpointError = _tuc.CheckpointError
#: The tip torch's frame appends to its determinism errors.
DEBUG_TIP: str = getattr(_tuc, "_debug_tip_msg", "")
_SavedTensor = torch._C._autograd.SavedTensor
_make_saved_tensor = torch._C._autograd._make_saved_tensor
_push_hooks = torch._C._autograd._push_saved_tensors_default_hooks
_pop_hooks = torch._C._autograd._pop_saved_tensors_default_hooks
_top_hooks = torch._C._autograd._top_saved_tensors_default_hooks
_graph_task_id = torch._C._current_graph_task_id
_graph_exec_group = getattr(torch._C, "_get_graph_exec_group", lambda: None)
_grad_enabled = torch.is_grad_enabled
_set_grad = torch._C._set_grad_enabled


def unpacked_twice_message() -> str:
    """torch's error for a saved tensor unpacked a second time in one backward."""
    extra = ""
    if _graph_exec_group() is not None:
        extra = (
            "Performing two backward calls that overlap (i.e. require the same saved activation in order to compute "
            "gradients) is not allowed while under the torch.utils.checkpoint.GraphExecGroup context. "
        )
    return (
        "torch.utils.checkpoint: Unpack is being triggered for a tensor that was already unpacked once. "
        f"{extra}If you are calling ctx.saved_tensors in backward, make sure to do so only once. Otherwise please "
        "open an issue with details on your use case."
    )


def _tensor_leaves(args: tuple) -> list[torch.Tensor]:
    for a in args:
        if type(a) is not torch.Tensor and isinstance(a, (list, tuple, dict)):
            return [a for a in tree_leaves(args) if isinstance(a, torch.Tensor)]
    return [a for a in args if isinstance(a, torch.Tensor)]  # no containers: no tree walk


def checkpoint_devices(args: tuple) -> tuple[str, list[int]]:
    """The device type whose RNG and autocast state a checkpoint replays, and the indices of the non-CPU devices of
    the tensor arguments, as torch's frame infers them (``_infer_device_type``, ``get_device_states``): CUDA
    first, else the first non-CPU type, else the default device type."""
    types: list[str] = []
    ids: list[int] = []
    for t in _tensor_leaves(args):
        if not t.is_cpu:
            device = t.device
            types.append(device.type)
            if device.type != "meta":
                ids.append(t.get_device())
    if not types:
        return _tuc.DefaultDeviceType._default_device_type or _tuc.DefaultDeviceType.get_device_type(), ids
    return ("cuda" if "cuda" in types else types[0]), ids


def _device_module(device_type: str) -> Any:
    return None if device_type == "meta" else getattr(torch, device_type, None)


def _autocast_of(device_type: str) -> tuple[str, bool, torch.dtype, bool]:
    return (device_type, torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type),
            torch.is_autocast_cache_enabled())


_any_autocast = torch._C._is_any_autocast_enabled


def autocast_state(devices: tuple[str, list[int]]) -> tuple | None:
    """The autocast state of the checkpoint's device type (where autocast exists) and of the CPU; None when
    autocast is off everywhere (the common case, read with one call)."""
    if not _any_autocast():
        return None
    device_type = devices[0]
    states = [_autocast_of("cpu")]
    if device_type != "cpu" and torch.amp.is_autocast_available(device_type):
        states.insert(0, _autocast_of(device_type))
    return tuple(states)


def autocast_contexts(state: tuple | None) -> list:
    """The ``torch.autocast`` contexts that make the autocast state ``state`` again; none where it already is."""
    if state is None:
        if not _any_autocast():
            return []
        state = tuple((t, False, torch.get_autocast_dtype(t), torch.is_autocast_cache_enabled())
                      for t in ("cuda", "cpu", "xpu", "mps", "hpu") if torch.is_autocast_enabled(t))
    return [
        torch.amp.autocast(device_type, enabled=enabled, dtype=dtype, cache_enabled=cache)
        for device_type, enabled, dtype, cache in state
        if _autocast_of(device_type) != (device_type, enabled, dtype, cache)
    ]


_cpu_generator = torch.default_generator


def rng_states(devices: tuple[str, list[int]]) -> tuple[torch.Tensor, list | None]:
    """The CPU generator's state and, if the device type's module is initialised, each argument device's."""
    device_type, ids = devices
    module = _device_module(device_type)
    if not getattr(module, "_initialized", False):
        return _cpu_generator.get_state(), None
    return _cpu_generator.get_state(), [(module, i, module.get_rng_state(i)) for i in ids]


def set_rng_states(states: tuple[torch.Tensor, list | None]) -> tuple[torch.Tensor, list | None]:
    """Set the states ``rng_states`` took; return the ones they replace."""
    cpu, devices = states
    before = _cpu_generator.get_state(), None if devices is None else [
        (m, i, m.get_rng_state(i)) for m, i, _ in devices
    ]
    _cpu_generator.set_state(cpu)
    for module, i, state in devices or ():
        module.set_rng_state(state, i)
    return before


def device_initialized_since(devices: tuple[str, list[int]], rng: tuple[torch.Tensor, list | None]) -> bool:
    """Whether the device module was initialised after ``rng`` was taken without its states (torch's frame
    refuses that: the device's RNG state could not be replayed)."""
    return rng[1] is None and bool(getattr(_device_module(devices[0]), "_initialized", False))


def device_context() -> torch.device | None:
    """The device of the innermost ``with torch.device(...)`` context, which recompute must run under too."""
    if not torch._C._len_torch_function_stack():
        return None
    for mode in reversed(_overrides._get_current_function_mode_stack()):
        if isinstance(mode, _device.DeviceContext):
            return mode.device
    return None


def fresh_device_context(device: torch.device) -> Any:
    """A new ``torch.device`` context for recompute (re-entering the forward's own instance corrupts its state)."""
    return _device.DeviceContext(device)


def make_saved_tensor(t: torch.Tensor) -> Any:
    """Save ``t`` as autograd saves an input of a node: through the saved-tensor hooks in effect."""
    return _make_saved_tensor(t, is_output=False)


def unpack_saved_tensor(x: Any) -> Any:
    return x.unpack() if type(x) is _SavedTensor else x


def graph_exec_group() -> Any:
    return _graph_exec_group()


def graph_task() -> Any:
    """What a recompute is shared by: the ``GraphExecGroup`` in effect, else the running backward's graph task; None
    outside any backward."""
    group = _graph_exec_group()
    if group is not None:
        return group
    gid = _graph_task_id()
    return None if gid == -1 else gid


def push_checkpoint_hooks(pack: Callable, unpack: Callable, forward: bool = False) -> None:
    """Push a checkpoint's saved-tensor hooks, marked as checkpoint-internal the way torch 2.14+ marks its own
    (``_checkpoint_internal``, and ``_user_hooks``, the user's pair beneath, while on the stack), so that torch's
    SAC, sac2's and nested checkpoints find the user's hooks past them."""
    pack._checkpoint_internal = True  # type: ignore[attr-defined]
    pack._sac2_forward = forward  # type: ignore[attr-defined]
    pack._user_hooks = user_saved_tensors_hooks()  # type: ignore[attr-defined]
    _push_hooks(pack, unpack)


def pop_checkpoint_hooks(pack: Callable) -> None:
    _pop_hooks()
    del pack._user_hooks  # the graph keeps the hooks; it must not keep the user's through them


def set_grad_enabled(enabled: bool) -> bool:
    """Set grad mode; return the previous one."""
    was = _grad_enabled()
    _set_grad(enabled)
    return was


def skip_dynamo_in_code(*functions: Callable) -> None:
    """Never let dynamo trace these functions or what they call (marked on their code objects: no per-call cost)."""
    from torch._C._dynamo.eval_frame import _FrameAction, _FrameExecStrategy, set_code_exec_strategy

    for fn in functions:
        set_code_exec_strategy(fn.__code__, _FrameExecStrategy(_FrameAction.SKIP, _FrameAction.SKIP))


def checkpoint_debug_override() -> bool:
    """``torch.utils.checkpoint.set_checkpoint_debug_enabled(True)`` in effect."""
    return bool(getattr(_tuc, "_checkpoint_debug_enabled", None))


def early_stop_override() -> bool | None:
    """What ``torch.utils.checkpoint.set_checkpoint_early_stop`` set, or None outside it."""
    return getattr(_tuc, "_enable_checkpoint_early_stop", None)


def traced_checkpoint() -> bool:
    """Whether a checkpoint now runs under torch.compile, export or FX tracing (not eager)."""
    return (
        torch.compiler.is_compiling()
        or torch.compiler._is_non_strict_tracing()
        or _fx_trace._is_fx_tracing_flag
        or tracing_for_compile()
    )


#: torch's own non-reentrant frame generator, as torch's checkpoint calls it on this version.
TORCH_FRAME: Callable[..., Any] = getattr(
    _tuc, "_checkpoint_without_reentrant_generator_impl", _tuc._checkpoint_without_reentrant_generator
)
_FRAME_TAKES_TUPLES = TORCH_FRAME.__name__.endswith("_impl")  # 2.15: (fn, args, kwargs, *, options)
_FRAME_TAKES_HOOKS_FLAG = "respect_saved_tensors_hooks" in __import__("inspect").signature(TORCH_FRAME).parameters


def torch_frame(function: Callable, args: tuple, kwargs: dict, **options: Any) -> Any:
    """torch's frame generator for one call (``options``: the keyword options of ``sac2.frame.frames``)."""
    flag = options.pop("respect_saved_tensors_hooks", None)
    if _FRAME_TAKES_HOOKS_FLAG:
        options["respect_saved_tensors_hooks"] = flag
    if _FRAME_TAKES_TUPLES:
        return TORCH_FRAME(function, args, kwargs, **options)
    o = options
    return TORCH_FRAME(function, o["preserve_rng_state"], o["context_fn"], o["determinism_check"], o["debug"],
                       o["early_stop"], *args, **kwargs)


def run_torch_frame(function: Callable, args: tuple, kwargs: dict, **options: Any) -> Any:
    """``function(*args, **kwargs)`` under torch's frame, driven as torch's ``checkpoint`` drives it."""
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
    """torch 2.14+'s frame tells its own SAC caching mode whether to route saved tensors through the user's hooks."""
    if _FRAME_TAKES_HOOKS_FLAG and isinstance(forward_context, _TorchCachingMode):
        forward_context.respect_saved_tensors_hooks = respect_saved_tensors_hooks


# --- install(): what sac2 swaps under torch's checkpoint API (sac2.integrations.rebinding) ---
__all__ += ["as_torch_frame", "torch_frame_bindings", "torch_wrapper_function"]


def as_torch_frame(frames: Callable[..., Any]) -> Callable[..., Any]:
    """``sac2.frame.frames`` in the calling convention of torch's frame generator on this torch (2.13/2.14:
    positional options then ``*args, **kwargs``; 2.15: ``(fn, args, kwargs, *, options)``)."""
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
    ``checkpoint``'s, and the composable ``torch.distributed._composable.checkpoint``'s."""
    name = TORCH_FRAME.__name__
    found: list[tuple[Any, str]] = [(_tuc, name)]
    try:
        import torch.distributed._composable.checkpoint_activation as composable
    except ImportError:  # torch built without distributed
        return found
    if getattr(composable, name, None) is TORCH_FRAME:
        found.append((composable, name))
    return found


def torch_wrapper_function(name: str) -> Any:
    """torch's ``checkpoint_wrapper`` or ``apply_activation_checkpointing`` (None without torch.distributed)."""
    try:
        import torch.distributed.algorithms._checkpoint.checkpoint_wrapper as module
    except ImportError:
        return None
    return getattr(module, name)
