"""How sac2 treats each kind of op it sees: its replay key, what it writes, whether it draws random numbers.

Every op reaches sac2's modes the same way: aten and custom ops as ``OpOverload``s, higher-order operators (HOPs)
through the generic ``supports_higher_order_operators`` path, so a HOP sac2 has never heard of works too. The rules
here are the few places where an op needs more than "run it, or keep its output":

- ``inductor_compiled_code`` runs many different compiled callables: each gets its own replay key, so a policy
  can save one region and recompute another, and can match a region by the ``name=`` given to torch.compile.
- Mutating ops return an alias (in-place, ``out=``), None (``triton_kernel_wrapper_mutation``) or fresh outputs
  (custom ops with ``mutates_args``) and write into their arguments. Saving such an op means keeping what it
  wrote and writing it back into the replayed buffers.
- Random ops advance a generator. Serving a saved random op in recompute must advance it the same way, or every
  later recomputed random op draws different numbers than forward did.
"""

from __future__ import annotations

from typing import Any, Hashable

import torch

from sac2 import _compat
from sac2._compat import tree_leaves

__all__ = [
    "Region",
    "KEYED_OPS",
    "op_key",
    "replay_key",
    "region_of",
    "tensor_versions",
    "schema_writes",
    "writes_of",
    "unversioned_writes",
    "locate",
    "is_random",
]


class Region:
    """A named unit of work that a policy can match: a ``sac2.region`` call or a ``torch.compile(name=...)`` region.

    ``Region("attn")`` in a save list saves every region of that name. The policy receives the ``Region`` itself
    as ``op`` for ``sac2.region`` calls; for compiled code it receives torch's ``inductor_compiled_code`` HOP and
    ``sac2.region_of(op, args)`` names the region.
    """

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __eq__(self, other: object) -> bool:
        return type(other) is Region and other.name == self.name

    def __hash__(self) -> int:
        return hash(("sac2.Region", self.name))

    def __repr__(self) -> str:
        return f"Region({self.name!r})"


#: Ops whose replay key is not the op itself.
KEYED_OPS: frozenset = frozenset(op for op in (_compat.INDUCTOR_COMPILED_CODE,) if op is not None)

_keys: dict[tuple, tuple] = {}


def op_key(func: Any, args: tuple) -> Hashable:
    """The replay key of a KEYED_OPS call: one interned key per compiled callable, so keys compare by identity."""
    idx, name = _compat.compiled_callable_key(args)
    key = (func, idx, name)
    return _keys.setdefault(key, key)


def replay_key(func: Any, args: tuple) -> Hashable:
    """The key a call is recorded and matched under: the op itself, or ``op_key`` for KEYED_OPS."""
    return op_key(func, args) if func in KEYED_OPS else func


def region_of(op: Any, args: tuple = ()) -> Region | None:
    """The ``Region`` an op stands for (a sac2 region, or compiled code given a name), else None."""
    if type(op) is Region:
        return op
    if op is _compat.INDUCTOR_COMPILED_CODE and args:
        name = _compat.compiled_callable_key(args)[1]
        return Region(name) if name else None
    return None


Path = tuple  # ("a", index, *sub) or ("k", name, *sub): where a written tensor sits in (args, kwargs)


def locate(args: tuple, kwargs: dict, path: Path) -> Any:
    """The object at ``path`` in ``(args, kwargs)``."""
    obj = args if path[0] == "a" else kwargs
    for step in path[1:]:
        obj = obj[step]
    return obj


_schema_writes: dict[int, tuple[Any, tuple[Path, ...]]] = {}


def schema_writes(func: _compat.OpOverload) -> tuple[Path, ...]:
    """Where an OpOverload's schema says it writes (``Tensor(a!)`` arguments), cached per op by id()."""
    hit = _schema_writes.get(id(func))
    if hit is None:
        paths = tuple(
            ("k", a.name) if a.kwarg_only else ("a", i)
            for i, a in enumerate(func._schema.arguments)
            if a.alias_info is not None and a.alias_info.is_write
        )
        hit = _schema_writes[id(func)] = (func, paths)  # holding func keeps its id from being reused
    return hit[1]


def _expand(args: tuple, kwargs: dict, paths: tuple[Path, ...]) -> list[tuple[Path, torch.Tensor]]:
    out = []
    for path in paths:
        obj = locate(args, kwargs, path)
        if isinstance(obj, torch.Tensor):
            out.append((path, obj))
        elif isinstance(obj, (list, tuple)):
            out.extend((path + (j,), t) for j, t in enumerate(obj) if isinstance(t, torch.Tensor))
    return out


def _tensor_paths(args: tuple, kwargs: dict) -> list[tuple[Path, torch.Tensor]]:
    """Every tensor in ``(args, kwargs)``, nested lists, tuples and dicts included, with its ``locate`` path."""
    out: list[tuple[Path, torch.Tensor]] = []

    def walk(path: Path, obj: Any) -> None:
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


def tensor_versions(args: tuple, kwargs: dict) -> list[tuple[torch.Tensor, int]]:
    """Every tensor argument of a HOP call with its version, to see afterwards which ones the HOP wrote."""
    return [(t, t._version) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]


def writes_of(
    func: Any, args: tuple, kwargs: dict, out: Any, before: list[tuple[torch.Tensor, int]] | None
) -> list[tuple[Path, torch.Tensor]] | None:
    """The (path, tensor) pairs a finished call wrote into, [] for a functional op, None if sac2 cannot tell.

    ``before`` holds the HOP call's tensor arguments with their versions from before the call (None for
    OpOverloads, whose schema says what they write).
    """
    if isinstance(func, _compat.OpOverload):
        paths = schema_writes(func)
        return _expand(args, kwargs, paths) if paths else []
    if func is _compat.TRITON_MUTATION:
        return [(("k", "kwargs", name), kwargs["kwargs"][name]) for name in _compat.triton_written_args(kwargs)]
    if before is None:
        return []
    changed = {id(t) for t, v in before if t._version != v}
    if changed:
        written = [(p, t) for p, t in _tensor_paths(args, kwargs) if id(t) in changed]
        # A written tensor inside a container sac2 cannot index (a custom pytree node) cannot be written back.
        return written if {id(t) for _, t in written} == changed else None
    if out is None and before:
        return None  # returns nothing yet takes tensors: it can only have written somewhere we cannot see
    return []


def unversioned_writes(func: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """Tensors a HOP call wrote without bumping their version (a Triton kernel writes raw memory).

    Version counters cannot show such a write to a saved tensor, so the caller must compare storages.
    """
    if func is _compat.TRITON_MUTATION:
        return [kwargs["kwargs"][name] for name in _compat.triton_written_args(kwargs)]
    return []


_random: dict[int, tuple[Any, bool]] = {}


def is_random(func: Any) -> bool:
    """Whether an op draws from a random generator (torch tags such ops ``nondeterministic_seeded``)."""
    hit = _random.get(id(func))
    if hit is None:
        r = isinstance(func, _compat.OpOverload) and torch.Tag.nondeterministic_seeded in func.tags
        hit = _random[id(func)] = (func, r)  # holding func keeps its id from being reused
    return hit[1]
