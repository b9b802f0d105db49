"""Where an op writes: the arguments a finished call wrote into, and how to find them again at replay.

Mutating ops return an alias (in-place, ``out=``), None (``triton_kernel_wrapper_mutation``) or fresh outputs
(custom ops with ``mutates_args``) and write into their arguments. Saving such an op means keeping what it wrote
and writing it back into the replayed buffers; an OpOverload's schema says where it writes, a HOP's version
counters show it, and a Triton kernel's writes come from torch's kernel analysis.
"""

from __future__ import annotations

from typing import Any, Hashable, TypeAlias

import torch

from sac2 import _compat
from sac2.core.keys import Region

_version = _compat.version

__all__ = [
    "Path", "UNDECLARED_WRITES", "locate", "schema_writes", "expand", "tensor_args", "tensor_versions",
    "writes_of", "unversioned_writes",
]


#: ("a", index, *sub) or ("k", name, *sub): where a written tensor sits in (args, kwargs); sub: list positions
#: and dict keys.
Path: TypeAlias = tuple[Hashable, ...]


def locate(args: tuple[Any, ...], kwargs: dict[str, Any], path: Path) -> Any:
    """The object at ``path`` in ``(args, kwargs)``."""
    obj: Any = args if path[0] == "a" else kwargs
    for step in path[1:]:
        obj = obj[step]
    return obj


#: Ops that write arguments their schema does not mark ``(a!)`` (and without bumping their versions): batch
#: norm updates its running mean and variance in training. Positions of those arguments, by schema name.
UNDECLARED_WRITES: dict[str, tuple[int, ...]] = {
    "aten::native_batch_norm": (3, 4),
    "aten::cudnn_batch_norm": (3, 4),
    "aten::miopen_batch_norm": (3, 4),
}


def schema_writes(func: _compat.OpOverload) -> tuple[Path, ...]:
    """Where an OpOverload writes: its ``Tensor(a!)`` arguments and the writes its schema leaves out
    (``UNDECLARED_WRITES``); ``sac2.core.opinfo`` caches it."""
    schema = _compat.schema(func)
    undeclared = UNDECLARED_WRITES.get(schema.name, ())
    return tuple(
        ("k", a.name) if a.kwarg_only else ("a", i)
        for i, a in enumerate(schema.arguments)
        if (a.alias_info is not None and a.alias_info.is_write) or i in undeclared
    )


def expand(args: tuple[Any, ...], kwargs: dict[str, Any], paths: tuple[Path, ...]) -> list[tuple[Path, torch.Tensor]]:
    out: list[tuple[Path, torch.Tensor]] = []
    for path in paths:
        obj = locate(args, kwargs, path)
        if isinstance(obj, torch.Tensor):
            out.append((path, obj))
        elif isinstance(obj, (list, tuple)):
            out.extend((path + (j,), t) for j, t in enumerate(obj) if isinstance(t, torch.Tensor))
    return out


def _tensor_paths(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[tuple[Path, torch.Tensor]]:
    """Every tensor in ``(args, kwargs)``, nested lists, tuples and dicts included, with its ``locate`` path."""
    out: list[tuple[Path, torch.Tensor]] = []

    def walk(path: Path, obj: object) -> None:
        if isinstance(obj, torch.Tensor):
            out.append((path, obj))
        elif isinstance(obj, (list, tuple)):
            for i, x in enumerate(obj):
                walk(path + (i,), x)
        elif isinstance(obj, dict):
            for k, x in obj.items():
                walk(path + (k,), x)

    for i, a in enumerate(args):
        walk(("a", i), a)
    for k, v in kwargs.items():
        walk(("k", k), v)
    return out


def tensor_args(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """Every tensor argument of a call, in one order: ``tensor_versions``', which a saved region's rebuilt saves
    count their input positions in (``sac2.record.region_saves.Spec``)."""
    return [t for t in _compat.call_leaves(args, kwargs) if isinstance(t, torch.Tensor)]


def tensor_versions(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[tuple[torch.Tensor, int]]:
    """Every tensor argument of a HOP call with its version, to see afterwards which ones the HOP wrote."""
    return [(t, _version(t)) for t in tensor_args(args, kwargs)]


def writes_of(
    func: _compat.Op | Region,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    out: object,
    before: list[tuple[torch.Tensor, int]] | None,
    paths: tuple[Path, ...] | None = None,
) -> list[tuple[Path, torch.Tensor]] | None:
    """The (path, tensor) pairs a finished call wrote into, [] for a functional op, None if sac2 cannot tell.

    ``before`` holds the HOP call's tensor arguments with their versions from before the call (None for
    OpOverloads, whose schema says what they write: ``paths``, the op's ``OpInfo.writes``, if known).
    """
    if isinstance(func, _compat.OpOverload):
        paths = schema_writes(func) if paths is None else paths
        return expand(args, kwargs, paths) if paths else []
    if func is _compat.TRITON_MUTATION:
        return [(("k", "kwargs", name), kwargs["kwargs"][name]) for name in _compat.triton_written_args(kwargs)]
    if before is None:
        return []
    changed = {id(t) for t, v in before if _version(t) != v}
    if changed:
        written = [(p, t) for p, t in _tensor_paths(args, kwargs) if id(t) in changed]
        # A written tensor inside a container sac2 cannot index (a custom pytree node) cannot be written back.
        return written if {id(t) for _, t in written} == changed else None
    if out is None and before:
        return None  # returns nothing yet takes tensors: it can only have written somewhere we cannot see
    return []


def unversioned_writes(func: _compat.Op, kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """Tensors a HOP call wrote without bumping their version (a Triton kernel writes raw memory).

    Version counters cannot show such a write to a saved tensor, so the caller must compare storages.
    """
    if func is _compat.TRITON_MUTATION:
        return [kwargs["kwargs"][name] for name in _compat.triton_written_args(kwargs)]
    return []
