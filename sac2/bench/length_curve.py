"""Per-op cost against region length: a chain of N tiny pointwise ops (N = 16 ... 4,096) checkpointed as one
region under no checkpointing, full AC, stock SAC and sac2 SAC (the same save list), in microseconds per op.

It shows that sac2's per-op cost does not grow with the length of the region (its stale tracking is one dict
lookup per written tensor). ``sac2 bench`` prints and plots it; ``benchmarks/overhead.py`` compares 16 and 1,024.
"""

from __future__ import annotations

import functools
import statistics
import time
from typing import Any, Callable, Sequence

import torch
import torch.utils.checkpoint as tuc

import sac2
from sac2 import messages
from sac2.core.decisions import Policy
from sac2.measure.rotation import turns
from sac2.messages.internal import InternalError

__all__ = ["CURVE_LENGTHS", "CURVE_SAVE_LIST", "curve", "format_curve", "stock_sac", "sac2_sac"]

#: Region lengths (ops in forward) of the per-op curve.
CURVE_LENGTHS = (16, 64, 256, 1024, 4096)


#: ``run(fn, x)``: ``fn(x)`` under one checkpointing mode.
Run = Callable[[Callable[[torch.Tensor], torch.Tensor], torch.Tensor], torch.Tensor]


def stock_sac(policy: Policy) -> Run:
    """``run(fn, x)``: ``fn(x)`` under torch's non-reentrant checkpoint with torch's SAC contexts for ``policy``."""
    context_fn = functools.partial(tuc.create_selective_checkpoint_contexts, policy)
    return lambda fn, x: tuc.checkpoint(fn, x, use_reentrant=False, context_fn=context_fn)


def sac2_sac(policy: Policy) -> Run:
    """``run(fn, x)``: ``fn(x)`` under ``sac2.checkpoint`` with sac2's contexts for ``policy``."""
    context_fn = functools.partial(sac2.create_selective_checkpoint_contexts, policy)
    return lambda fn, x: sac2.checkpoint(fn, x, context_fn=context_fn)


def _chain(n: int) -> Callable[[torch.Tensor], torch.Tensor]:
    def chain(x: torch.Tensor) -> torch.Tensor:
        for i in range(n):
            x = x.sin() if i % 2 == 0 else x.cos()
        return x

    return chain


#: The curve's save list: every other op of the chain (its cos calls), for stock and sac2 alike.
CURVE_SAVE_LIST = [torch.ops.aten.cos.default]


def curve(lengths: Sequence[int] = CURVE_LENGTHS, repeat: int = 5) -> dict[str, Any]:
    """Per-op forward+backward microseconds of an N-op pointwise chain as one region, per mode and length.

    Single thread, this thread's CPU time, median of ``repeat`` samples taken in a rotating mode order; each
    sample runs the region enough times for about 2,048 ops. ``equal`` says whether each mode's gradient was
    bitwise the no-checkpointing one.
    """
    modes: dict[str, Run] = {
        "none": lambda fn, x: fn(x),
        "full": lambda fn, x: tuc.checkpoint(fn, x, use_reentrant=False),
        "stock SAC": stock_sac(CURVE_SAVE_LIST),
        "sac2 SAC": sac2_sac(CURVE_SAVE_LIST),
    }
    names = list(modes)
    us: dict[str, list[float]] = {name: [] for name in names}
    equal: dict[str, list[bool]] = {name: [] for name in names}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for n in lengths:
            chain, iters = _chain(n), max(1, 2048 // n)
            x = torch.randn(16, generator=torch.Generator().manual_seed(n), requires_grad=True)
            grads: dict[str, torch.Tensor] = {}
            for name in names:  # warm up every path once, and keep its gradient
                x.grad = None
                modes[name](chain, x).sum().backward()
                grads[name] = _grad_of(x).clone()  # later samples accumulate into x.grad in place
            samples: dict[str, list[float]] = {name: [] for name in names}
            for r in range(repeat):
                for name in (names[i] for i in turns(r, len(names))):
                    start = time.thread_time()
                    for _ in range(iters):
                        modes[name](chain, x).sum().backward()
                    samples[name].append((time.thread_time() - start) / iters / n * 1e6)
            for name in names:
                us[name].append(statistics.median(samples[name]))
                equal[name].append(torch.equal(grads[name], grads["none"]))
    finally:
        torch.set_num_threads(threads)
    return {"ops": "alternating sin/cos on 16 floats", "policy": "save list [aten.cos.default]",
            "lengths": list(lengths), "repeat": repeat, "us_per_op": us, "equal": equal}


def _grad_of(x: torch.Tensor) -> torch.Tensor:
    """``x.grad`` after a backward (read here: mypy would keep the caller's ``x.grad = None`` narrowing)."""
    grad = x.grad
    if grad is None:
        raise InternalError(messages.internal_error(messages.NO_GRADIENT))
    return grad


def format_curve(data: dict[str, Any]) -> str:
    """The per-op curve as a text table: one line per region length, us/op per mode."""
    names = list(data["us_per_op"])
    lines = [f"{'ops':>6}  " + "  ".join(f"{name:>10}" for name in names) + "  (us/op)"]
    for i, n in enumerate(data["lengths"]):
        cells = [f"{data['us_per_op'][name][i]:10.2f}" + ("" if data["equal"][name][i] else "!") for name in names]
        lines.append(f"{n:>6}  " + "  ".join(cells))
    return "\n".join(lines)
