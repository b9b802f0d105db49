"""Policies and ``context_fn``s pickle: ops pickle by their path under ``torch.ops``.

An OpOverload holds pybind11 function records and a HOP holds local functions: neither pickles, so neither does
a policy or a context_fn holding one (the HF Trainer pickles its TrainingArguments). Importing sac2 registers a
reducer with copyreg that rebuilds an op by its path under ``torch.ops``, for torch's own list policies too. The
loading process must have the op registered (import the module defining a custom op first).
"""

from __future__ import annotations

import copyreg
from typing import Callable, Iterable

from sac2._compat.ops import HigherOrderOperator, Op, OpOverload, op_at_path, op_path

__all__ = ["register_op_pickling"]


def _reduce_op(op: Op) -> tuple[Callable[[str], Op], tuple[str]]:
    return op_at_path, (op_path(op),)


def register_op_pickling(ops: Iterable[object]) -> None:
    """Register the reducer for the type of each op among ``ops`` (tuple keys are looked into). pickle finds a
    reducer by exact type, and each HOP has a class of its own: one defined after sac2's import needs this."""
    for item in ops:
        for op in item if type(item) is tuple else (item,):
            if isinstance(op, (OpOverload, HigherOrderOperator)) and type(op) not in copyreg.dispatch_table:
                copyreg.pickle(type(op), _reduce_op)


def _subclasses(cls: type) -> list[type]:
    found = [cls]
    subclasses: list[type] = cls.__subclasses__()
    for sub in subclasses:
        found += _subclasses(sub)
    return found


for _cls in _subclasses(OpOverload) + _subclasses(HigherOrderOperator):
    copyreg.pickle(_cls, _reduce_op)
