"""``sac2.advise``: what should I save for *my* model at *my* memory? Measure every checkpointing setup on it.

Each candidate setup (``sac2.advisor.candidates``) gets its own deep copy of the user's model; they run on the same
inputs side by side in one process, taking turns step by step (``sac2.measure.rotation.turns``), as ``sac2 bench``
does. Step 0 of each measures memory (``sac2.measure.memory.measure_step``: kept = allocated by forward and alive when
backward starts; peak = the most allocated at any time of the step) and is not timed; every step's loss and gradients
are compared with no checkpointing's, bit for bit. Once no checkpointing and full AC are measured, the memory budget
row is solved for the target (``budget_candidate``) and measured the same way, made smaller while it does not fit.
Timed rounds go on after ``steps`` while a row's ratio to the fastest fitting row is not yet clearly within or
outside ``sac2.advisor.advice.TIE`` of it, up to ``MORE`` times ``steps``. The answer is ``sac2.advisor.advice.Advice``.

The offload rows run only where offload moves tensors off the device (``sac2.offload.link.offloads``: CUDA, or the
CPU stand-in for a device that the tests use); elsewhere one note says why there are none. Where they run, the host
link's bandwidth is measured once (``sac2.measure.host_link``) and shown beside them.
"""

from __future__ import annotations

import copy
import math
import warnings
from typing import Any, Callable, Sequence

import torch
from torch import nn

from sac2 import messages
from sac2._compat import tree_map
from sac2.advisor.advice import Advice, recommend, unsettled
from sac2.advisor.candidates import Candidate, as_inputs, budget_candidate, call, candidates_for
from sac2.measure.determinism import deterministic_kernels
from sac2.measure.host_link import measure_host_link
from sac2.measure.rotation import turns
from sac2.measure.step import Progress, Result, clock_name, take_step
from sac2.offload import link as links

__all__ = ["advise", "BUDGET", "DEFAULT_TARGET", "MORE", "RETRIES"]

#: The name that asks ``candidates=`` for the memory budget row, solved for the target.
BUDGET = "budget"
#: The memory target when neither target is given: half of what no checkpointing keeps.
DEFAULT_TARGET = 0.5
#: Timed rounds go on, while rows are unsettled, up to this many times ``steps``.
MORE = 4
#: Smaller budgets tried when the budget row does not fit its target.
RETRIES = 2

#: ``loss_fn(output)``: the scalar loss of the model's output.
LossFn = Callable[[Any], torch.Tensor]


def advise(
    model: nn.Module,
    example_inputs: Any,
    *,
    loss_fn: LossFn | None = None,
    memory_target: float | int | None = None,
    peak_target: float | int | None = None,
    steps: int = 3,
    device: torch.device | str | None = None,
    candidates: Sequence[str | Candidate] | None = None,
    progress: bool = True,
) -> Advice:
    """Measure every candidate setup on ``model`` and recommend the one to use for a memory target.

    ``model`` itself is left untouched: each setup trains a deep copy, with no optimizer step, on the same inputs.
    One untimed step measures the memory each setup keeps for backward and its peak, then at least ``steps`` timed
    steps run the setups interleaved. The recommendation is, of the setups that fit every target, match no
    checkpointing bitwise and are no reference, the one keeping least among those within ``TIE`` (5%) of the
    fastest: a faster setup is recommended only when it is faster beyond the noise of a tie. On CUDA every setup runs
    under ``torch.use_deterministic_algorithms(True)`` (``sac2.measure.determinism``). A setup that does not apply
    (e.g. a regions choice matching nothing: ``ValueError``) is skipped with the reason.

    Kept and peak bytes are the device's, and the targets are judged against them. Where offload moves tensors off
    the device (CUDA), offload rows run too (``apply_ac(model, mode="full", offload=[...])``): each keeps less on the
    device by keeping bytes in pinned host memory (a row's ``host_bytes``, not held against the targets), and the
    host link's bandwidth is measured once (``Advice.host_link``). Elsewhere there are none, and a note says why.

    Args:
        model: the model to measure (not changed).
        example_inputs: what ``model`` is called with (a tuple/list: positional, a dict: keyword, a tensor alone).
        loss_fn: ``loss_fn(output)`` gives the scalar loss; default (None) ``output.loss`` if present, else the
            sum of the output's first tensor.
        memory_target: what a setup may keep for backward in device memory: a number in [0, 1] is a fraction of
            what no checkpointing keeps (``1`` is all of it), an int above 1 is bytes; default (None) 0.5 when
            ``peak_target`` is None too, else no target on kept bytes.
        peak_target: the most a setup's step may allocate at once (what decides an out-of-memory error): a fraction
            of no checkpointing's peak or bytes, as ``memory_target``; default (None) none.
        steps: timed steps per setup after the untimed step that measures memory (default 3); more follow, up to
            ``MORE`` times as many, while a row's place is unsettled.
        device: where to run; default (None) the device of the model's first parameter.
        candidates: names of built-in setups (``sac2.advisor.candidates_for``, and ``"budget"`` for the memory
            budget solved for the target) or ``Candidate``s; default (None) every built-in setup and the budget.
            No checkpointing runs first whether named or not; offload rows run only where offload moves tensors.
        progress: True (the default) shows progress on stderr: a bar on a terminal, a line every few seconds
            elsewhere.

    Returns:
        An ``Advice``: a row per setup that ran, the skipped setups, the Pareto front, the rows another row
        dominates, and the recommendation (``advice.code`` is its line of code).

    Raises:
        ValueError: ``steps`` is not a positive int; a name in ``candidates`` is not a built-in setup;
            ``memory_target`` or ``peak_target`` is a float outside [0, 1] or a negative int.
        TypeError: ``memory_target`` or ``peak_target`` is not a number; without ``loss_fn``, the output has no
            ``loss`` and no tensor.
    """
    if type(steps) is not int or steps < 1:
        raise ValueError(messages.advise_bad_steps(steps))
    for target in (memory_target, peak_target):
        _check_target(target)
    dev = torch.device(device) if device is not None else next(model.parameters()).device
    inputs = tree_map(lambda x: x.to(dev) if isinstance(x, torch.Tensor) else x, as_inputs(example_inputs))
    base = copy.deepcopy(model).to(dev)
    chosen, budget = _select(candidates, candidates_for(base, inputs))
    runs = _Runs(base, inputs, _default_loss if loss_fn is None else loss_fn, dev, progress)
    if any(c.offload for c in chosen) and not links.offloads(dev):
        chosen = [c for c in chosen if not c.offload]
        runs.notes.append(messages.advise_no_offload(str(dev)))
    for c in chosen:
        runs.add(c)
    with deterministic_kernels(dev):  # on CUDA, so that the bitwise check can hold at all
        runs.measure_memory(range(len(runs.setups)))
        none = runs.results[0]
        kept = _target_bytes(memory_target if memory_target is not None or peak_target is not None else
                             DEFAULT_TARGET, none.kept_bytes)
        peak = _target_bytes(peak_target, none.peak_bytes)
        if budget:
            runs.add_budget(kept, peak)
        link = measure_host_link(dev) if any(c.offload for c in runs.setups) else None
        runs.time(steps, kept, peak)
    return recommend(runs.results, [c.reference for c in runs.setups], runs.skipped, kept, str(dev), steps,
                     peak_target_bytes=peak, notes=runs.notes, clock=clock_name(dev), host_link=link)


class _Runs:
    """The setups' models, their rows and what they were measured against: no checkpointing's loss and gradients."""

    def __init__(self, base: nn.Module, inputs: Any, loss_fn: LossFn, device: torch.device, progress: bool) -> None:
        self.base, self.inputs, self.loss_fn, self.device = base, inputs, loss_fn, device
        self.models: list[nn.Module] = []
        self.setups: list[Candidate] = []
        self.results: list[Result] = []
        self.skipped: dict[str, str] = {}
        self.notes: list[str] = []
        self.reference: list[torch.Tensor | None] = []
        self.bar = Progress(0, "sac2 advise") if progress else None

    def add(self, c: Candidate) -> bool:
        """Prepare ``c`` on a copy of the model; False (and the reason in ``skipped``) when it does not apply."""
        m = copy.deepcopy(self.base)
        with warnings.catch_warnings(record=True) as told:
            warnings.simplefilter("always")
            try:
                c.prepare(m)
            except (ValueError, TypeError) as e:
                self.skipped[c.name] = str(e).splitlines()[0]
                return False
        self.notes += [f"{c.name}: {w.message}" for w in told if "memory_budget" in str(w.message)]
        self.models.append(m)
        self.setups.append(c)
        self.results.append(Result(c.name, c.code))
        return True

    def step(self, i: int, first: bool) -> None:
        """One step of setup ``i`` (the first measures memory), checked against no checkpointing's."""
        m = self.models[i]
        m.zero_grad(set_to_none=True)
        loss = take_step(lambda: self.loss_fn(call(m, self.inputs)), self.results[i], self.device, first)
        got = [loss.detach(), *(p.grad for p in m.parameters())]
        if i == 0 and not self.reference:
            self.reference = got
        else:
            self.results[i].equal &= _same(got, self.reference)
        if self.bar is not None:
            self.bar.step()

    def measure_memory(self, rows: Sequence[int]) -> None:
        if self.bar is not None:
            self.bar.total += len(rows)
        for i in rows:
            self.step(i, True)

    def add_budget(self, kept: int | None, peak: int | None) -> None:
        """The budget row, solved for the targets from no checkpointing's and full AC's rows; made smaller (up to
        ``RETRIES`` times) while its measured memory does not fit."""
        ends = [self.results[0], next((r for r in self.results if r.name == "full AC"), None)]
        fraction = _fraction(ends, kept, peak, 1.0)
        for _ in range(RETRIES + 1):
            if fraction is None or not self.add(budget_candidate(fraction, self.inputs)):
                return
            self.measure_memory([len(self.setups) - 1])
            row = self.results[-1]
            if (kept is None or row.kept_bytes <= kept) and (peak is None or row.peak_bytes <= peak):
                return
            shrink = _fraction(ends, kept, peak, fraction, row)
            if shrink is None or shrink >= fraction:
                return
            self.notes.append(f"{row.name} did not fit its target: tried a smaller budget")
            self.models.pop(), self.setups.pop(), self.results.pop()
            fraction = shrink

    def time(self, steps: int, kept: int | None, peak: int | None) -> None:
        """At least ``steps`` timed rounds, then more while a row's place is unsettled (up to ``MORE`` times)."""
        n = len(self.setups)
        for r in range(MORE * steps):
            if r >= steps and not unsettled(self.results, [c.reference for c in self.setups], kept, peak):
                return
            if self.bar is not None:
                self.bar.total += n
            for i in turns(r, n):
                self.step(i, False)


def _same(got: list[torch.Tensor | None], want: list[torch.Tensor | None]) -> bool:
    if len(got) != len(want):
        return False
    return all((a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))
               for a, b in zip(got, want, strict=True))


def _fraction(ends: list[Result | None], kept: int | None, peak: int | None, most: float,
              row: Result | None = None) -> float | None:
    """The budget fraction whose row should fit the targets: each target's place between full AC's and no
    checkpointing's memory (a row that did not fit scales it by how far it overshot), rounded down to 0.01, at
    most ``most``; None where no budget fits (a target below full AC's)."""
    none, full = ends
    fractions = [most]
    for target, read in ((kept, lambda r: r.kept_bytes), (peak, lambda r: r.peak_bytes)):
        if target is None:
            continue
        low = read(full) if full is not None else 0
        high = read(row) if row is not None else read(none)
        if target < low:
            return None
        span = high - low
        fractions.append(1.0 if span <= 0 else (target - low) / span * (most if row is not None else 1.0))
    fraction = math.floor(min(fractions) * 100) / 100
    return fraction if fraction > 0 else None


def _check_target(target: object) -> None:
    if target is None:
        return
    if isinstance(target, bool) or not isinstance(target, (int, float)):
        raise TypeError(messages.advise_bad_target(target))
    if target < 0 or (isinstance(target, float) and target > 1):
        raise ValueError(messages.advise_bad_target(target))


def _target_bytes(target: float | int | None, none: int) -> int | None:
    """A target in bytes: a number in [0, 1] is a fraction of no checkpointing's ``none``; an int above 1 bytes."""
    if target is None:
        return None
    return int(target * none) if target <= 1 else int(target)


def _default_loss(output: Any) -> torch.Tensor:
    """The output's ``.loss`` when it has one (transformers with labels), else the sum of its first tensor."""
    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    if isinstance(output, torch.Tensor):
        return output.float().sum()
    values = output.values() if isinstance(output, dict) else output  # transformers' outputs are dicts
    for v in values if isinstance(values, (tuple, list, type({}.values()))) else ():
        if isinstance(v, torch.Tensor):
            return v.float().sum()
    raise TypeError(messages.advise_no_loss(output))


def _select(candidates: Sequence[str | Candidate] | None, builtin: list[Candidate]) -> tuple[list[Candidate], bool]:
    """The candidates to run, no checkpointing first (added when missing: every row is checked against it), and
    whether the budget row is asked for."""
    if candidates is None:
        return builtin, True
    by_name = {c.name: c for c in builtin}
    chosen: list[Candidate] = []
    budget = False
    for c in candidates:
        if isinstance(c, Candidate):
            chosen.append(c)
        elif c == BUDGET:
            budget = True
        elif c in by_name:
            chosen.append(by_name[c])
        else:
            raise ValueError(messages.advise_unknown_candidate(c, [*by_name, BUDGET]))
    if not chosen or chosen[0].name != "none":
        chosen = [by_name["none"], *(c for c in chosen if c.name != "none")]
    return chosen, budget
