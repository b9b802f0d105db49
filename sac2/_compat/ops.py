"""torch's op objects and what sac2 reads of them: types, schemas, effects, storages, the HOPs sac2 knows.

Each shim names, in a ``Removable:`` line, the torch change that would let it go. They all hold on torch 2.13-2.15.
"""

from __future__ import annotations

import importlib
import operator
import sys
from typing import Any, Callable, Iterable, Sequence, TypeAlias, Union

import torch
import torch.utils.checkpoint as _tuc
from torch.utils import _python_dispatch as _pd
from torch.utils import _pytree

from sac2 import messages

__all__ = [
    "import_op_modules",
    "OpOverload", "OpOverloadPacket", "HigherOrderOperator", "Op", "FakeTensor", "tree_map", "tree_leaves",
    "call_leaves", "IGNORED_OPS",
    "INDUCTOR_COMPILED_CODE", "FLEX_ATTENTION", "TRITON_MUTATION", "compiled_regions_wrapped",
    "compiled_callable_key", "triton_written_args", "direct_call", "schema", "has_ordered_effect", "storage_id",
    "has_internal_overlap", "op_packet", "flop_formula", "default_generator", "partitioner_compute_intensive_ops",
    "op_path", "op_at_path", "UNSAFE_VIEW", "TO_COPY", "SDPA_FLASH_CPU", "SDPA_FLASH", "version", "versions",
    "set_versions",
]


#: The op types the dispatcher hands to a mode, and the fake tensors torch.compile traces with.
#: Removable: torch exports these classes publicly.
OpOverload = torch._ops.OpOverload
OpOverloadPacket = torch._ops.OpOverloadPacket
HigherOrderOperator = torch._ops.HigherOrderOperator
FakeTensor = torch._subclasses.FakeTensor
#: What the dispatcher hands a mode as ``func``, and what a save list holds: an op overload or a higher-order op.
Op: TypeAlias = Union[OpOverload, HigherOrderOperator]

#: pytree helpers. Removable: ``torch.utils.pytree`` is the public spelling on every supported torch.
tree_map = _pytree.tree_map
tree_leaves = _pytree.tree_leaves


def call_leaves(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Sequence[Any]:
    """``tree_leaves((args, kwargs))``, without the walk when no argument is a pytree node (a module's or an
    attention function's call on tensors and scalars, once per region call): the arguments themselves.

    Removable: ``torch.utils.pytree`` is the public spelling on every supported torch.
    """
    values = (*args, *kwargs.values()) if kwargs else args
    for v in values:
        cls = type(v)
        if cls is not torch.Tensor and (cls in _pytree.SUPPORTED_NODES or issubclass(cls, tuple)):  # namedtuples
            return _pytree.tree_leaves((args, kwargs))
    return values


#: Ops that forward and recompute legitimately run a different number of times (detach, metadata queries
#: issued by the determinism check); torch's own SAC skips exactly these. Removable: never (torch's public list,
#: kept beside the other op facts).
IGNORED_OPS: frozenset[OpOverload] = frozenset(_tuc.SAC_IGNORED_OPS)


#: aten ops whose names start with an underscore (internal to torch, free to change): sac2 names them here only.
#: Removable: never (they are torch's); kept here so that a renamed op is one edit.
UNSAFE_VIEW = torch.ops.aten._unsafe_view.default
TO_COPY = torch.ops.aten._to_copy.default
SDPA_FLASH_CPU = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
SDPA_FLASH = torch.ops.aten._scaled_dot_product_flash_attention


#: ``version(t)``: ``t``'s version counter, how many in-place writes its storage has seen through any alias sharing
#: it. An attribute getter, not a function: every saved tensor reads it, and a getter runs no Python frame.
#: Removable: tensors expose their version counter publicly.
version: Callable[[torch.Tensor], int] = operator.attrgetter("_version")


def versions(tensors: Iterable[torch.Tensor]) -> tuple[int, ...]:
    """The version counters of ``tensors`` (``version`` for many, one call)."""
    return tuple([t._version for t in tensors])


def set_versions(pairs: list[tuple[torch.Tensor, int]]) -> None:
    """Set each tensor's version counter (shared with its aliases) back to the value given.

    Removable: a replayed in-place view op can run without bumping the counter (no public way today).
    """
    tensors, values = zip(*pairs, strict=True)
    torch._C._autograd._unsafe_set_version_counter(tensors, values)


def _hop(module: str, name: str) -> HigherOrderOperator | None:
    """A HOP by module and name, None where this torch lacks it.

    Removable: torch exposes its higher-order ops under a public path.
    """
    try:
        mod = __import__(f"torch._higher_order_ops.{module}", fromlist=[name])
        hop = getattr(mod, name)
    except (ImportError, AttributeError):
        return None
    return hop if isinstance(hop, HigherOrderOperator) else None


#: The HOP a compiled region runs as under a dispatch mode (``wrap_inductor_compiled_regions``).
INDUCTOR_COMPILED_CODE = _hop("wrap", "inductor_compiled_code")

#: flex attention, eager or compiled.
FLEX_ATTENTION = _hop("flex_attention", "flex_attention")

#: The HOP a user Triton kernel runs as; it returns None and writes into its tensor kwargs.
TRITON_MUTATION = _hop("triton_kernel_wrap", "triton_kernel_wrapper_mutation")


def compiled_regions_wrapped() -> bool:
    """Whether compiled code runs as ``inductor_compiled_code`` under a dispatch mode
    (``torch._inductor.config.wrap_inductor_compiled_regions``), where a policy can match it by name.

    Removable: torch reads ``wrap_inductor_compiled_regions`` through a public config API.
    """
    config = sys.modules.get("torch._inductor.config")
    return bool(getattr(config, "wrap_inductor_compiled_regions", False))


def compiled_callable_key(args: tuple[Any, ...]) -> tuple[int, str | None]:
    """(unique index, name given to torch.compile) of the compiled callable an inductor_compiled_code call runs.

    Removable: ``inductor_compiled_code`` exposes its callable's index and name publicly.
    """
    from torch._higher_order_ops.wrap import _resolve_inductor_callable

    fn = _resolve_inductor_callable(args[0])
    return fn.idx, fn.compile_region_name


_triton_writes: dict[tuple[object, ...], list[str]] = {}


def triton_written_args(kwargs: dict[str, Any]) -> list[str]:
    """Names of the tensor kwargs a ``triton_kernel_wrapper_mutation`` call writes into.

    Uses torch's own kernel analysis; if that analysis fails, every tensor kwarg counts as written.

    Removable: torch's kernel side table and mutation analysis become public.
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


def direct_call(op: Op) -> Callable[..., Any]:
    """The fastest callable that runs ``op`` as calling it would: an OpOverload's C++ handle (what
    ``OpOverload.__call__`` calls, minus a Python frame) where that is what torch calls, else the op itself
    (HOPs; custom ops whose ``_op`` is a Python dispatcher on torch 2.14+, which ``__call__`` guards).

    Removable: ``OpOverload.__call__`` costs no extra Python frame (or the handle becomes public).
    """
    if isinstance(op, OpOverload):
        handle = op._op
        if type(handle).__name__ == "builtin_function_or_method":
            return handle
    return op


def schema(op: OpOverload) -> torch.FunctionSchema:
    """An OpOverload's ``torch.FunctionSchema``.

    Removable: ``OpOverload`` exposes its schema publicly.
    """
    return op._schema


def has_ordered_effect(op: Op) -> bool:
    """Whether an op has an ORDERED side effect (``aten._print``, torchbind calls...): it must not run twice.
    c10d ops are excepted, as in torch 2.15's SAC (they return async work handles, no value to cache).

    Removable: ``torch._higher_order_ops.effects`` becomes public.
    """
    try:
        from torch._higher_order_ops.effects import _EffectType, _get_effect, has_effects

        if getattr(op, "namespace", None) == "c10d" or not has_effects(op):
            return False
        return _get_effect(op) == _EffectType.ORDERED
    except Exception:  # not an op torch's effect registry knows
        return False


def storage_id(t: torch.Tensor) -> int | None:
    """An id of the storage ``t`` lives in, shared by every alias of it; None for wrapper subclasses (DTensor,
    nested jagged tensors), whose storage is not real.

    Removable: untyped storages expose a public identity.
    """
    if _pd.is_traceable_wrapper_subclass_type(type(t)):
        return None
    cdata: int = t.untyped_storage()._cdata
    return cdata


def has_internal_overlap(t: torch.Tensor) -> bool:
    """Whether some elements of ``t`` share memory (an expanded view): it cannot be written with ``copy_``.

    Removable: torch exposes an overlap query publicly.
    """
    return torch._debug_has_internal_overlap(t) == 1


def op_packet(op: Op) -> OpOverloadPacket | HigherOrderOperator:
    """The OpOverloadPacket of an OpOverload (``aten.mm`` for ``aten.mm.default``); the op itself otherwise.

    Removable: ``OpOverload`` exposes its packet publicly.
    """
    return op._overloadpacket if isinstance(op, OpOverload) else op


def flop_formula(packet: OpOverloadPacket | HigherOrderOperator) -> Callable[..., int] | None:
    """torch's FLOP formula for an op packet (``torch.utils.flop_counter``'s registry), or None.

    Removable: ``torch.utils.flop_counter`` documents its registry as public.
    """
    from torch.utils.flop_counter import flop_registry

    return flop_registry.get(packet)


def default_generator(device: torch.device) -> torch.Generator:
    """The default RNG generator that random ops on ``device`` draw from.

    Removable: ``torch.get_device_module`` gives default generators for every device uniformly.
    """
    if device.type == "cpu":
        return torch.default_generator
    module = torch.get_device_module(device.type)
    # torch's stubs type device.index as int; it is None for a device given without one ("cuda").
    index = device.index if device.index is not None else module.current_device()  # type: ignore[redundant-expr]
    generator: torch.Generator = module.default_generators[index]
    return generator


def partitioner_compute_intensive_ops() -> list[OpOverload]:
    """The default overloads of the ops AOTAutograd's min-cut partitioner counts as compute intensive
    (``get_default_op_list().compute_intensive_ops``): where torchtitan's default save list starts.

    Removable: the partitioner's op list becomes public.
    """
    from torch._functorch.partitioners import get_default_op_list

    # torch types the list as Callables; it holds OpOverloadPackets.
    return [packet.default for packet in get_default_op_list().compute_intensive_ops
            if isinstance(packet, OpOverloadPacket)]


def op_path(op: Op) -> str:
    """An op's path under ``torch.ops``: ``aten.mm.default``, ``higher_order.flex_attention``.

    Removable: ops pickle by themselves (pybind function records and local HOP functions).
    """
    if isinstance(op, OpOverload):
        namespace, name = op._schema.name.split("::")
        return f"{namespace}.{name}.{op._overloadname}"
    return f"higher_order.{op.name()}"


#: torch modules that register ops when imported, not when torch is (``torch_attn._varlen_attn``).
_MODULES_THAT_REGISTER_OPS = ("torch.nn.attention.varlen",)


def import_op_modules() -> None:
    """Import the torch modules that register ops on import, so that ``torch.ops`` has every op of torch's.

    Removable: torch registers these ops when it is imported.
    """
    for name in _MODULES_THAT_REGISTER_OPS:
        try:
            importlib.import_module(name)
        except ImportError:
            pass


def op_at_path(path: str) -> Op:
    """The op ``op_path`` named: the very object this process's ``torch.ops`` holds (in a new process too, where a
    torch module that registers it on import may not be imported yet: a policy pickled in another one).

    Removable: ops pickle by themselves (pybind function records and local HOP functions).
    """
    obj: object = torch.ops
    for i, part in enumerate(path.split(".")):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            if i == 0:
                raise
            import_op_modules()
            obj = getattr(obj, part)
    if not isinstance(obj, (OpOverload, HigherOrderOperator)):
        raise TypeError(messages.not_an_op_path(path, obj))
    return obj
