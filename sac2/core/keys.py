"""Replay keys: what a call is recorded and matched under, and the named regions a policy can match.

Most ops are their own key. ``inductor_compiled_code`` runs many different compiled callables: each gets its own
replay key, so a policy can save one region and recompute another, and can match a region by the ``name=`` given
to torch.compile. ``sac2.region`` calls are keyed by a ``Region``.
"""

from __future__ import annotations

from typing import Any, TypeAlias, Union, final

from sac2 import _compat

__all__ = ["Region", "PolicyOp", "CompiledKey", "Key", "KEYED_OPS", "op_key", "replay_key", "region_of"]


@final  # ``type(op) is Region`` tells a region from an op both ways
class Region:
    """A named unit of work that a policy can match: a ``sac2.region`` call or a ``torch.compile(name=...)`` region.

    ``Region("attn")`` in a save list saves every region of that name. The policy receives the ``Region`` itself
    as ``op`` for ``sac2.region`` calls; for compiled code it receives torch's ``inductor_compiled_code`` HOP and
    ``sac2.region_of(op, args)`` names the region. Regions compare equal by name.

    Args:
        name: the region's name: a ``sac2.region``'s ``name`` (default its function's ``__qualname__``), or the
            ``name=`` given to ``torch.compile``.
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


#: What a policy receives as ``op``: the op the dispatcher runs, or the ``Region`` of a ``sac2.region`` call.
PolicyOp: TypeAlias = Union[_compat.Op, Region]
#: A compiled callable's replay key: (``inductor_compiled_code``, the callable's index, its torch.compile name).
CompiledKey: TypeAlias = tuple[_compat.Op, int, Union[str, None]]
#: What a call is recorded and matched under (``replay_key``): the op, a compiled callable's key, or a ``Region``.
Key: TypeAlias = Union[_compat.Op, CompiledKey, Region]

#: Ops whose replay key is not the op itself.
KEYED_OPS: frozenset[_compat.Op] = frozenset(op for op in (_compat.INDUCTOR_COMPILED_CODE,) if op is not None)

_keys: dict[CompiledKey, CompiledKey] = {}


def op_key(func: _compat.Op, args: tuple[Any, ...]) -> CompiledKey:
    """The replay key of a KEYED_OPS call: one interned key per compiled callable, so keys compare by identity."""
    idx, name = _compat.compiled_callable_key(args)
    key = (func, idx, name)
    return _keys.setdefault(key, key)


def replay_key(func: PolicyOp, args: tuple[Any, ...]) -> Key:
    """The key a call is recorded and matched under: the op itself (a region: its ``Region``), or ``op_key`` for
    KEYED_OPS."""
    return op_key(func, args) if type(func) is not Region and func in KEYED_OPS else func


def region_of(op: object, args: tuple[Any, ...] = ()) -> Region | None:
    """The ``Region`` an op stands for (a sac2 region, or compiled code given a name), else None.

    A policy sees compiled code as torch's ``inductor_compiled_code`` HOP; this names which compiled region the call
    runs, so a policy can decide per region as a save list does.

    Args:
        op: the ``op`` a policy received.
        args: the positional arguments the policy received with it (needed for compiled code; the default ``()``
            suffices for a ``Region``).

    Returns:
        ``op`` itself if it is a ``Region``; ``Region(name)`` for compiled code given ``name`` by torch.compile;
        None for any other op, and for compiled code without a name or without ``args``.
    """
    if type(op) is Region:
        return op
    if op is _compat.INDUCTOR_COMPILED_CODE and args:
        name = _compat.compiled_callable_key(args)[1]
        return Region(name) if name else None
    return None
