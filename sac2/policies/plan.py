"""A memory budget for a whole model's blocks: per distinct block, the fastest way to keep at most its share.

Every block is profiled on the inputs it gets (``sac2.policies.profile``; its attention, Linears and experts made
regions beforehand, so a region is one item). Blocks that run the same calls on the same storages are one kind of
block: their kernel times are pooled (the least of several profiles, as interference only adds time). A budget
fraction ``f`` lets each block keep ``f`` of what it keeps without checkpointing; bytes are shared out the same way.
What a kind of block was measured to cost is kept for the process: every later budget for it decides on the same
figures (and costs no more measuring).

Per kind of block, three ways are priced on sac2's path and the fastest is chosen:

- ``"full"``: full AC, nothing kept but the inputs; the reference every other way must beat.
- ``"regions"``: a save list of regions, with no dispatch mode: the regions the knapsack picks, each worth its
  recompute less what keeping a region costs, less what every kept region's calls cost;
- ``"ops"``: an op-level ``MemoryBudget`` under sac2's dispatch modes: any call may be kept, but the modes cost
  every op of the block.

The prices start from ``sac2.policies.path_costs.measure`` (a chain of small ops) and are then calibrated on the
block itself: full AC and every region worth keeping kept are timed side by side, and what keeping one more call
costs is set so that the model predicts what was measured (on a dispatch-bound block, a kept region can cost more
than its kernel). A way other than full AC is chosen only where it is predicted to save more than ``MARGIN`` of the
block's forward time, and the op-level way only where it beats the region way by that much too (its gain rests on
more, smaller decisions, priced from the chain), so an uncertain gain never makes a step slower.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import nn

from sac2 import _compat
from sac2.core.decisions import SaveList
from sac2.core.keys import Region
from sac2.policies.budget import MemoryBudget, fraction_of, op_groups, value, weight
from sac2.policies.knapsack import solve
from sac2.policies.path_costs import PathCosts, time_block
from sac2.policies.profile import Profile, profile
from sac2.record.record import Record
from sac2.record.regions import RegionForward, RegionReplay

__all__ = ["BlockCall", "BlockPlan", "Prices", "plan_blocks", "MARGIN", "SAMPLES"]

#: The least predicted saving, as a share of the block's forward time, for which a block leaves full AC.
MARGIN = 0.1
#: Profiles per kind of block: the kernel times are the least of this many.
SAMPLES = 3


@dataclass(frozen=True)
class BlockCall:
    """One block and what the model calls it with."""

    module: nn.Module
    args: tuple[Any, ...]
    kwargs: dict[str, Any]

    @property
    def fn(self) -> functools.partial[Any]:
        return functools.partial(self.module, **self.kwargs)


@dataclass(frozen=True)
class Prices:
    """Seconds each way costs on one kind of block: per kept region, per call of a kept region, per kept op call
    (under the modes), and the modes' own cost for the whole block."""

    region_saved: float
    region_call: float
    op_saved: float
    modes: float


@dataclass(frozen=True)
class BlockPlan:
    """What a budget chose for one block.

    Args:
        kind: ``"full"``, ``"regions"`` or ``"ops"`` (the module doc).
        policy: the block's policy: a save list of regions, a ``MemoryBudget``, or None for full AC.
        regions: the names of the regions it keeps (the other regions of the block need not stay regions).
        kept_bytes: what it predicts the block keeps beyond full AC (its outputs aside).
        none_bytes: what the block keeps without checkpointing (its inputs, parameters and outputs aside).
        saving_s: the step time it predicts to save against full AC, in seconds.
    """

    kind: str
    policy: SaveList | MemoryBudget | None
    regions: tuple[str, ...]
    kept_bytes: int
    none_bytes: int
    saving_s: float


def plan_blocks(blocks: Sequence[BlockCall], budget: float | int, costs: PathCosts) -> list[BlockPlan]:
    """A plan per block for a budget: a fraction in [0, 1] of what the blocks keep without checkpointing, or bytes
    for all of them together."""
    profiles = [profile(b.fn, b.args, cost="time") for b in blocks]
    kinds: dict[tuple[Any, ...], list[int]] = {}
    for i, p in enumerate(profiles):
        kinds.setdefault(_signature(p), []).append(i)
    fraction = fraction_of(budget, sum(p.none_bytes for p in profiles))
    plans: list[BlockPlan | None] = [None] * len(blocks)
    for signature, members in kinds.items():
        found = _priced.get((signature, costs))
        if found is None:
            first = blocks[members[0]]
            samples = [profiles[i] for i in members]
            while len(samples) < SAMPLES:
                samples.append(profile(first.fn, first.args, cost="time"))
            p = _least_costs(samples)
            found = _priced[(signature, costs)] = (p, _calibrated(p, first, costs))
            while len(_priced) > _KEPT:
                del _priced[next(iter(_priced))]
        p, prices = found
        plan = _solve(p, int(fraction * p.none_bytes), prices, costs)
        for i in members:
            plans[i] = plan
    return [p for p in plans if p is not None]


#: Each kind of block's pooled profile and calibrated prices, by (signature, device's path costs), so that every
#: budget of this process decides on the same measurements: a larger budget never keeps less (the newest kept).
_priced: dict[tuple[tuple[Any, ...], PathCosts], tuple[Profile, Prices]] = {}
_KEPT = 16


def _signature(p: Profile) -> tuple[Any, ...]:
    """What makes two blocks one kind: the same calls, keeping the same storages of the same sizes."""
    return (tuple((c.key, c.storages, c.view, c.stale, c.ops) for c in p.calls), tuple(p.storage_bytes), p.free,
            p.none_bytes)


def _least_costs(samples: list[Profile]) -> Profile:
    """The first profile with each call's cost the least any sample measured for it."""
    calls = [dataclasses.replace(c, cost=min(s.calls[i].cost for s in samples)) for i, c in enumerate(samples[0].calls)]
    return dataclasses.replace(samples[0], calls=calls)


def _solve(p: Profile, capacity: int, prices: Prices, costs: PathCosts) -> BlockPlan:
    margin = MARGIN * sum(costs.recompute(c.cost, c.ops) for c in p.calls)
    best = BlockPlan("full", None, (), 0, p.none_bytes, 0.0)
    regions, ops = _regions(p, capacity, prices, costs), _ops(p, capacity, prices, costs)
    if regions.saving_s > margin:
        best = regions
    if ops.saving_s > max(margin, regions.saving_s + margin):
        best = ops
    return best


def _calibrated(p: Profile, block: BlockCall, costs: PathCosts) -> Prices:
    """The chain's prices, with what a kept region costs corrected so that the predicted saving of keeping every
    region worth keeping is what timing it against full AC on the block measured. A kept op call under the modes
    costs the chain's difference more than a kept region, and the modes their per-op price."""
    prices = Prices(costs.region_saved, costs.region, costs.mode_saved, costs.mode_op * len(p.calls))
    regions = _regions(p, max(p.none_bytes, p.total_bytes), prices, costs)
    if not isinstance(regions.policy, SaveList):
        return prices
    leaves = [t for t in (*block.module.parameters(), *_compat.tree_leaves((block.args, block.kwargs)))
              if isinstance(t, torch.Tensor) and t.requires_grad]
    t = time_block(block.fn, block.args, leaves, {"full": _compat.noop_context_fn,
                                                  "regions": functools.partial(_regions_contexts, regions.policy)})
    calls = sum(1 for c in p.calls if type(c.key) is Region and c.key.name in regions.regions)
    more = max(regions.saving_s - (t["full"] - t["regions"]), 0.0) / calls  # never above the chain's figures
    return Prices(prices.region_saved + more, prices.region_call, prices.op_saved + more, prices.modes)


def _regions_contexts(policy: SaveList) -> tuple[RegionForward, RegionReplay]:
    record = Record()
    return RegionForward(policy, record), RegionReplay(record)


def _regions(p: Profile, capacity: int, prices: Prices, costs: PathCosts) -> BlockPlan:
    """The regions to keep: an item per region (a save list keeps all its calls)."""
    items: dict[Region, tuple[list[int], set[int]]] = {}
    for calls, storages in op_groups(p):
        keys = {p.calls[i].key for i in calls}
        key = next(iter(keys))
        if len(keys) != 1 or type(key) is not Region:
            continue  # a region sharing storage with other calls: only an op-level policy keeps them together
        found = items.setdefault(key, ([], set()))
        found[0].extend(calls)
        found[1].update(storages)
    regions = list(items)
    weights = [weight(p, items[k][1]) for k in regions]
    per_call = prices.region_saved + prices.region_call
    values = [max(sum(value(p.calls[i], costs, per_call) for i in items[k][0]), 0.0) for k in regions]
    chosen = sorted(solve(weights, values, capacity).chosen, key=lambda j: regions[j].name)
    saving = sum(values[j] for j in chosen)
    policy = SaveList([regions[j] for j in chosen]) if chosen else None
    return BlockPlan("regions", policy, tuple(regions[j].name for j in chosen), sum(weights[j] for j in chosen),
                     p.none_bytes, saving)


def _ops(p: Profile, capacity: int, prices: Prices, costs: PathCosts) -> BlockPlan:
    """The op calls to keep under sac2's modes."""
    groups = op_groups(p)
    weights = [weight(p, storages) for _, storages in groups]
    values = [max(sum(value(p.calls[i], costs, prices.op_saved) for i in calls), 0.0) for calls, _ in groups]
    solution = solve(weights, values, capacity)
    saved = frozenset(i for g in solution.chosen for i in groups[g][0])
    kept = sum(weights[g] for g in solution.chosen)
    regions = tuple(sorted({key.name for i in saved if isinstance(key := p.calls[i].key, Region)}))
    return BlockPlan("ops", MemoryBudget(p, saved, capacity, solution), regions, kept, p.none_bytes,
                     solution.value - prices.modes)
