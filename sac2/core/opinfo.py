"""What sac2 needs to know about each op, worked out once per op from its schema and tags and cached.

The per-op paths look an op up by ``id()`` (``OpOverload.__hash__`` is Python code) and read one ``OpInfo``:
its kind, where it writes, whether it draws random numbers, whether it has an ordered side effect, and the
fastest way to call it. Ops in the table are kept alive by their entry, so their ids stay theirs.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from sac2 import _compat
from sac2.core.keys import KEYED_OPS
from sac2.core.writes import Path, schema_writes

__all__ = ["PLAIN", "VIEW", "IGNORE", "HOP", "KEYED", "OpInfo", "info", "TABLE"]

_UNSAFE_VIEW = _compat.UNSAFE_VIEW
#: Ops that only re-present their input's values (``reshape``'s copy path): see ``OpInfo.free``.
_COPIES = (_UNSAFE_VIEW, torch.ops.aten.clone.default)
#: A view by its schema, but its input is Python data made fresh (``torch.tensor(...)``): where forward ran it and
#: recompute did not, the function set up state on its first call (a KV cache), which must stay a divergence.
_LIFT_FRESH = torch.ops.aten.lift_fresh.default

#: An aten or custom op; a view (or in-place view) op, always re-run; an op that is not an op for SAC (detach,
#: metadata queries), run and never recorded; a higher-order op; an op whose replay key depends on its arguments.
PLAIN, VIEW, IGNORE, HOP, KEYED = 0, 1, 2, 3, 4


class OpInfo:
    """One op's entry in the table."""

    __slots__ = ("op", "kind", "writes", "random", "ordered", "call", "hidden_alias", "plain", "free")

    def __init__(self, op: _compat.Op) -> None:
        self.op = op
        self.writes: tuple[Path, ...] = schema_writes(op) if isinstance(op, _compat.OpOverload) else ()
        self.random = isinstance(op, _compat.OpOverload) and torch.Tag.nondeterministic_seeded in op.tags
        self.ordered = _compat.has_ordered_effect(op)
        self.kind = _kind(op, self)
        self.call: Callable[..., Any] = _compat.direct_call(op)
        #: Its output shares its input's storage but not its version counter (matmul's ``_unsafe_view``): a
        #: saved entry holding that storage must watch the output too.
        self.hidden_alias = op is _UNSAFE_VIEW
        #: A functional aten or custom op that draws nothing, has no side effect and aliases nothing: the
        #: forward's short path.
        self.plain = self.kind == PLAIN and not (self.writes or self.random or self.ordered or self.hidden_alias)
        #: Its output is its input's values, viewed or copied: a view op that writes nothing, ``_unsafe_view``,
        #: ``clone``. Composites choose among these by strides and by what modes are active (``reshape`` copies a
        #: non-contiguous tensor; ``linear`` runs ``t`` and ``view`` in another order under ``FlopCounterMode``),
        #: so recompute may run them where, in another order, or not at all (replay rule 3, ``sac2.modes.forward``).
        self.free = (self.kind == VIEW and not self.writes and op is not _LIFT_FRESH) or op in _COPIES


def _kind(op: _compat.Op, entry: OpInfo) -> int:
    if op in _compat.IGNORED_OPS:
        return IGNORE
    if op in KEYED_OPS:
        return KEYED
    if not isinstance(op, _compat.OpOverload):
        return HOP
    if op.is_view or torch.Tag.inplace_view in op.tags:
        # A view's output aliases its input, and an in-place view op (t_, squeeze_, as_strided_) changes only
        # its argument's metadata: re-running either on its replayed input is free and always right.
        return VIEW
    if _metadata_only(op, entry):
        return IGNORE
    return PLAIN


def _metadata_only(op: _compat.OpOverload, entry: OpInfo) -> bool:
    """No tensor out, nothing written, no data read into the result, no randomness and no side effect.

    Such ops (``prim.layout``, ``sym_size``, ``is_same_size``...) run a different number of times in forward and
    recompute when tensor subclasses query metadata, so they are never ops for SAC. Decided from the schema and
    tags, so it holds on every torch version and for ops torch has not listed.
    """
    schema = _compat.schema(op)
    if entry.writes or entry.random or entry.ordered or torch.Tag.data_dependent_output in op.tags:
        return False
    if any(a.alias_info is not None for a in schema.arguments):
        return False
    return bool(schema.returns) and not any("Tensor" in str(r.type) for r in schema.returns)


#: id(op) -> OpInfo for every op seen so far.
TABLE: dict[int, OpInfo] = {}


def info(op: _compat.Op) -> OpInfo:
    """The table entry of ``op``, built on first sight."""
    hit = TABLE.get(id(op))
    if hit is None:
        hit = TABLE[id(op)] = OpInfo(op)
    return hit
