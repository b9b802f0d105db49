"""What a profiled forward's ops cost, counted below sac2's forward mode: estimated FLOPs or measured kernel time,
and how many ops ran (a region's body runs several).

``sac2.policies.profile`` reads ``total`` and ``ops`` before and after each recorded call, so a call's cost is what
the ops below it cost. Both counters sit below sac2's modes on the stack, so they also see what a region's body
runs (``compiled_region()`` takes only sac2's modes off the stack).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from sac2 import _compat
from sac2._compat import TorchDispatchMode, tree_leaves
from sac2.core.opinfo import IGNORE, info

__all__ = ["FlopCount", "TimeCount", "Counter"]

Tensor = torch.Tensor


class _Counting(TorchDispatchMode):
    """What both cost counters share: compiled code called below them compiles (dynamo skips a frame under a mode
    that does not say so, and then never compiles that code again in the process: a compiled submodule of a
    profiled block would run eagerly for good), and its ops are counted as they dispatch."""

    supports_higher_order_operators = True

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True


class FlopCount(_Counting):
    """Adds up estimated FLOPs of every op below the profile: torch's formula where it has one, else one per
    output element. A HOP counts as one op (its body runs below this mode, unseen)."""

    def __init__(self) -> None:
        super().__init__()
        self.total = 0.0
        self.ops = 0

    def __torch_dispatch__(
        self,
        func: _compat.Op,
        types: tuple[type, ...],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not (isinstance(func, _compat.OpOverload) and (func.is_view or info(func).kind == IGNORE)):
            packet = _compat.op_packet(func)
            formula = _compat.flop_formula(_SAME_FLOPS_AS.get(packet, packet))
            self.total += formula(*args, **kwargs, out_val=out) if formula is not None else _numel(out)
        self.ops += info(func).kind != IGNORE
        return out


class TimeCount(_Counting):
    """Adds up the wall time of every op below the profile, synchronising the inputs' accelerators around each."""

    def __init__(self, inputs: tuple[Any, ...]) -> None:
        super().__init__()
        self.total = 0.0
        self.ops = 0
        self.devices = {t.device for t in tree_leaves(inputs) if isinstance(t, Tensor) and t.device.type != "cpu"}

    def __torch_dispatch__(
        self,
        func: _compat.Op,
        types: tuple[type, ...],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        for d in self.devices:
            torch.accelerator.synchronize(d)
        start = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        for d in self.devices:
            torch.accelerator.synchronize(d)
        self.total += time.perf_counter() - start
        self.ops += info(func).kind != IGNORE  # sac2's own detach of what it keeps is no op of the forward
        return out


#: Either counter: what the profile reads.
Counter = FlopCount | TimeCount

#: torch's FLOP counter knows flash attention on CUDA but not the CPU kernel, which takes the same q, k, v first.
_SAME_FLOPS_AS: dict[_compat.OpOverloadPacket | _compat.HigherOrderOperator, _compat.OpOverloadPacket] = {
    _compat.SDPA_FLASH_CPU: _compat.SDPA_FLASH,
}


def _numel(out: object) -> int:
    return sum(t.numel() for t in tree_leaves(out) if isinstance(t, Tensor))
