"""What sac2's own path costs per decision on one device: the cost model a memory budget solves with.

A profile times each op's kernel (``sac2.policies.counters``); what a step really pays around it depends on how it
is checkpointed. Recomputing an op costs its kernel plus its dispatch (autograd's graph, the frame's holder for
what it saves). Keeping it under sac2's dispatch modes costs recording, keeping and serving it, and the modes
cost every op of the block, saved or not; keeping a region needs no mode at all, only the region's own record.
On a dispatch-bound model these decide: an op-level policy can be slower than full AC however much it saves.

``measure(device)`` times a chain of small ops, checkpointed each way, side by side (turns interleaved, medians),
once per device and process; ``PathCosts`` holds what it found, in seconds. ``time_block`` times one block each way.
On the CPU both read the process's CPU time, not the wall clock: on a shared machine the time spent waiting for a
core is no cost of a way, and would swamp the differences measured.
"""

from __future__ import annotations

import functools
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from sac2 import _compat
from sac2.core.decisions import CheckpointPolicy, SaveList, SelectiveCheckpointContext
from sac2.core.keys import PolicyOp, Region
from sac2.frame import entry
from sac2.modes.forward import CachingMode
from sac2.modes.replay import ReplayMode
from sac2.policies.counters import TimeCount
from sac2.record.record import Record
from sac2.record.regions import RegionForward, RegionReplay
from sac2.regions.calls import call_region, region_key

__all__ = ["PathCosts", "measure", "time_block", "clock", "CHAIN", "ROUNDS"]

#: Ops in the measured chain, and rounds of it per way (after as many again to warm up, not counted).
CHAIN, ROUNDS = 32, 40


@dataclass(frozen=True)
class PathCosts:
    """Seconds sac2's path costs per decision on one device (``measure``).

    Args:
        dispatch: what recomputing one op costs besides its kernel: eager dispatch, autograd's graph, the frame's
            holder for what the op saves.
        mode_op: what sac2's dispatch modes cost per op call of a checkpointed forward (forward and replay mode
            together), saved or not: an op-level policy's price over full AC.
        mode_saved: keeping one op's outputs under the modes (record, keep, serve) in place of recomputing it.
        region: what one region call costs under the dispatch-free contexts (record, replay), saved or not.
        region_saved: keeping one region's outputs and its body's backward state, with no dispatch mode.
    """

    dispatch: float
    mode_op: float
    mode_saved: float
    region: float
    region_saved: float

    def recompute(self, kernel: float, ops: int) -> float:
        """What recomputing a call costs: its kernels' time and each of its ``ops``' dispatch."""
        return kernel + ops * self.dispatch


_measured: dict[str, PathCosts] = {}
_PROBE, _OTHER = "sac2.path_costs.probe", "sac2.path_costs.other"


def measure(device: torch.device) -> PathCosts:
    """The path costs on ``device``, measured the first time this process asks for that device."""
    found = _measured.get(str(device))
    if found is None:
        found = _measured[str(device)] = _measure(device)
    return found


def _chain(x: torch.Tensor) -> torch.Tensor:
    for _ in range(CHAIN):
        x = x.sin()  # saves its input: recompute must run every op of the chain
    return x


def _region_chain(x: torch.Tensor) -> torch.Tensor:
    key = region_key(_PROBE)
    for _ in range(CHAIN):
        x = call_region(key, torch.sin, (x,), {}, True)
    return x


def _answer(answer: CheckpointPolicy) -> Callable[..., CheckpointPolicy]:
    def policy(_ctx: SelectiveCheckpointContext, _op: PolicyOp, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        return answer

    return policy


def _modes(policy: Callable[..., CheckpointPolicy]) -> tuple[CachingMode, ReplayMode]:
    record = Record()
    return CachingMode(policy, record), ReplayMode(record)


def _regions(saved: Region) -> tuple[RegionForward, RegionReplay]:
    record = Record()
    return RegionForward(SaveList([saved]), record), RegionReplay(record)


def _checkpointed(fn: Callable[..., Any], context_fn: _compat.ContextFn) -> Callable[..., Any]:
    """``fn`` checkpointed by sac2's frame with ``context_fn`` (what ``sac2.checkpoint`` runs in eager)."""

    def run(*args: Any) -> Any:
        return entry.run(fn, args, {}, preserve_rng_state=False, context_fn=context_fn, determinism_check="none",
                         debug=False, early_stop=True, respect_saved_tensors_hooks=False)

    return run


def _ways() -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """The chain run each way the costs are told apart by: no checkpoint, full AC, the modes recomputing or saving
    every op, and a chain of regions under full AC and the dispatch-free contexts, unsaved or saved."""
    full = _compat.noop_context_fn
    return {
        "eager": _chain,
        "full": _checkpointed(_chain, full),
        "mode_recompute": _checkpointed(_chain, functools.partial(_modes, _answer(CheckpointPolicy.PREFER_RECOMPUTE))),
        "mode_save": _checkpointed(_chain, functools.partial(_modes, _answer(CheckpointPolicy.PREFER_SAVE))),
        "region_full": _checkpointed(_region_chain, full),
        "region_unsaved": _checkpointed(_region_chain, functools.partial(_regions, region_key(_OTHER))),
        "region_saved": _checkpointed(_region_chain, functools.partial(_regions, region_key(_PROBE))),
    }


def _kernel(x: torch.Tensor) -> float:
    """Seconds per op of the chain's kernels, timed as a profile times them."""
    counter = TimeCount((x,))
    with torch.no_grad(), counter:
        _chain(x)
    return counter.total / max(counter.ops, 1)


def clock(device: torch.device) -> Callable[[], float]:
    """Seconds, to tell durations on ``device`` by: the process's CPU time on the CPU, else the wall clock read
    after the device finished its work."""
    if device.type == "cpu":
        return time.process_time

    def synced() -> float:
        torch.accelerator.synchronize(device)
        return time.perf_counter()

    return synced


def _measure(device: torch.device) -> PathCosts:
    x = torch.randn(16, device=device, requires_grad=True)
    now = clock(device)
    ways = _ways()
    times: dict[str, list[float]] = {name: [] for name in ways}
    for r in range(2 * ROUNDS):
        for name, way in ways.items():
            start = now()
            way(x).sum().backward()
            if r >= ROUNDS:
                times[name].append(now() - start)
    t = {name: statistics.median(ts) / CHAIN for name, ts in times.items()}
    kernel = min(_kernel(x) for _ in range(3))  # the first pass pays for the counting mode's own warm-up
    dispatch = max(t["full"] - t["eager"] - kernel, 0.0)
    return PathCosts(
        dispatch=dispatch,
        mode_op=max(t["mode_recompute"] - t["full"], 0.0),
        mode_saved=max(t["mode_save"] - t["mode_recompute"] + kernel + dispatch, 0.0),
        region=max(t["region_unsaved"] - t["region_full"], 0.0),
        region_saved=max(t["region_saved"] - t["region_unsaved"] + kernel + dispatch, 0.0),
    )


def time_block(
    fn: Callable[..., Any], args: tuple[Any, ...], leaves: list[torch.Tensor], ways: dict[str, _compat.ContextFn],
    budget_s: float = 1.0,
) -> dict[str, float]:
    """Median seconds of one forward and backward of ``fn(*args)`` checkpointed with each of ``ways`` (a
    ``context_fn`` each), side by side in rotating turns: at least 5 rounds, more while they fit in ``budget_s``
    (at most 25). Gradients go to ``torch.autograd.grad`` for ``leaves``, never into ``.grad``."""
    names = list(ways)
    runs = {n: _checkpointed(fn, ways[n]) for n in names}
    times: dict[str, list[float]] = {n: [] for n in names}
    now = clock(next((t.device for t in leaves), torch.device("cpu")))
    start = now()
    rounds = 1
    r = 0
    while r < rounds + 1:
        for k in range(len(names)):
            name = names[(r + k) % len(names)]
            t = now()
            _backward(runs[name](*args), leaves)
            if r:  # the first round warms up
                times[name].append(now() - t)
        if r == 0:
            per_round = now() - start
            rounds = min(max(5, int(budget_s / max(per_round, 1e-9))), 25)
        r += 1
    return {n: statistics.median(ts) for n, ts in times.items()}


def _backward(out: object, leaves: list[torch.Tensor]) -> None:
    outs = [t for t in _compat.tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
    if outs:
        loss = outs[0].float().sum()
        for t in outs[1:]:
            loss = loss + t.float().sum()
        torch.autograd.grad(loss, leaves, allow_unused=True)
