"""A module whose matmul calls are region calls: what saving MoE experts as one-line regions means.

Saving a whole experts module as one region would keep everything its body saves for backward (the tokens each
expert gathers, the activation between its matmuls): more than saving its matmuls op by op, which lets recompute
make the rest again. So ``mode="regions"`` makes each matmul call inside an experts module (``F.linear``,
``torch.matmul``, ``torch._grouped_mm``, ...) a call of one region named for the module, through a
``TorchFunctionMode`` entered around the module's forward: saved, each call keeps its output (its inputs are
rebuilt in recompute, ``sac2.record.region_saves``), and the cheap ops between them run again in recompute, as op by op.
The mode is entered only where a region call is one (inside sac2 SAC, or traced by torch.compile).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch.compiler import is_compiling
from torch.overrides import TorchFunctionMode

from sac2.core.keys import Region
from sac2.regions.calls import call_region, in_region_context, plain_call

__all__ = ["MATMULS", "MatmulCalls", "matmuls_as_regions"]

Tensor = torch.Tensor
#: The Python-level matmul functions and methods whose calls become region calls (those the running torch has).
MATMULS: frozenset[Callable[..., Any]] = frozenset(
    f for f in (
        F.linear, torch.matmul, torch.mm, torch.bmm, torch.addmm, torch.baddbmm,
        getattr(torch, "_grouped_mm", None), getattr(torch, "_scaled_mm", None),
        getattr(torch, "_scaled_grouped_mm", None),
        Tensor.matmul, Tensor.__matmul__, Tensor.__rmatmul__, Tensor.mm, Tensor.bmm, Tensor.addmm, Tensor.baddbmm,
    ) if f is not None
)


class MatmulCalls(TorchFunctionMode):
    """While active, each call of a function in ``MATMULS`` is a call of the region ``key``."""

    def __init__(self, key: Region) -> None:
        super().__init__()
        self.key = key

    def __torch_function__(
        self, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if func in MATMULS:
            # torch has this mode off while it handles a call: a plain call is the matmul alone, which draws nothing
            # and, without out=, writes nothing
            pure = not is_compiling() and "out" not in kwargs and plain_call(args, kwargs)
            return call_region(self.key, func, args, kwargs, pure)
        return func(*args, **kwargs)


def matmuls_as_regions(key: Region, forward: Callable[..., Any], args: tuple[Any, ...],
                       kwargs: dict[str, Any]) -> Any:
    """``forward(*args, **kwargs)`` with its matmul calls as calls of region ``key`` where those are region calls."""
    if not in_region_context():
        return forward(*args, **kwargs)
    with MatmulCalls(key):
        return forward(*args, **kwargs)
