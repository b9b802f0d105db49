"""One measured training step, the way every side-by-side run takes it (``sac2 bench``, ``sac2.advise``): the
first step of a row measures the memory it keeps (``sac2.measure.memory``), later ones are timed; a row's loss and
gradients are compared with the reference row's, bit for bit in eager, ``allclose`` under compile."""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from sac2.measure.memory import measure_step

__all__ = ["Result", "Progress", "take_step", "clock", "clock_name", "grads_equal", "ATOL", "RTOL"]

#: Tolerances of the correctness check under compile (eager is bitwise).
ATOL, RTOL = 1e-5, 1e-4


@dataclass
class Result:
    """One row of the table: a mode's step times, memory and whether it matched no checkpointing (``check`` says
    how: "bitwise" or "allclose"). ``kept_bytes`` and ``peak_bytes`` are the device's; ``host_bytes`` what the row
    keeps for backward in offload's pinned host memory (``sac2.measure.memory.Memory``)."""

    name: str
    policy: str
    step_s: list[float] = field(default_factory=list)
    kept_bytes: int = 0
    peak_bytes: int = 0
    equal: bool = True
    check: str = "bitwise"
    host_bytes: int = 0

    @property
    def median_s(self) -> float:
        return statistics.median(self.step_s)


class Progress:
    """Progress on stderr: a one-line bar on a terminal; elsewhere (a log, a pipe) a line every ``EVERY`` seconds,
    so that a long run shows it is running. ``total`` may grow while it runs (more rounds)."""

    #: Seconds between two progress lines off a terminal.
    EVERY = 10.0

    def __init__(self, total: int, label: str = "sac2") -> None:
        self.total, self.done, self.label, self.tty = total, 0, label, sys.stderr.isatty()
        self.last = time.monotonic()

    def step(self) -> None:
        self.done += 1
        total = max(self.total, self.done)
        if self.tty:
            filled = 30 * self.done // total
            sys.stderr.write(f"\r[{'#' * filled}{'.' * (30 - filled)}] {self.done}/{total}")
            if self.done == total:
                sys.stderr.write("\n")
            sys.stderr.flush()
        elif time.monotonic() - self.last >= self.EVERY:
            self.last = time.monotonic()
            sys.stderr.write(f"{self.label}: {self.done}/{total} steps\n")
            sys.stderr.flush()



def _same(a: torch.Tensor | None, b: torch.Tensor | None, bitwise: bool) -> bool:
    if a is None or b is None:  # a parameter without a gradient: equal only if the reference has none either
        return a is None and b is None
    return torch.equal(a, b) if bitwise else torch.allclose(a, b, atol=ATOL, rtol=RTOL)


def grads_equal(
    model: nn.Module, loss: torch.Tensor, ref_model: nn.Module, ref_loss: torch.Tensor, bitwise: bool
) -> bool:
    if not _same(loss, ref_loss, bitwise):
        return False
    return all(_same(p.grad, q.grad, bitwise) for p, q in zip(model.parameters(), ref_model.parameters(), strict=True))


def clock(device: torch.device) -> Callable[[], float]:
    """What a step is timed by: on the CPU with one intra-op thread, the process's CPU time, which is the step's own
    work whatever else the machine runs (other jobs only make it wait, and on a shared machine swamp the differences
    measured); else the wall clock."""
    return time.process_time if device.type == "cpu" and torch.get_num_threads() == 1 else time.perf_counter


def clock_name(device: torch.device) -> str:
    """How ``clock(device)`` reads time, for a report: ``"cpu time"`` or ``"wall clock"``."""
    return "cpu time" if clock(device) is time.process_time else "wall clock"


def take_step(
    forward: Callable[[], torch.Tensor], result: Result, device: torch.device, first: bool,
    then: Callable[[], object] = lambda: None,
) -> torch.Tensor:
    """One training step of one row, its loss: the first measures the memory it keeps and its peak (untimed), each
    later one is timed by ``clock(device)``, ``then`` (the optimizer's step) included."""
    if first:
        memory, loss = measure_step(forward, device)
        result.kept_bytes, result.peak_bytes, result.host_bytes = memory.kept, memory.peak, memory.host
        return loss
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    now = clock(device)
    sync()
    start = now()
    loss = forward()
    loss.backward()
    then()
    sync()
    result.step_s.append(now() - start)
    return loss
