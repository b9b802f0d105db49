"""``memory_budget``: the policy that keeps at most a share of what no checkpointing keeps and recomputes the least.

One forward profiled under sac2's own forward mode gives, per op call, the activation storages saving it keeps and its
recompute cost (``sac2.policies.profile``), and what autograd would keep without checkpointing: the 100% a fraction
refers to. Calls that share a storage (an op and the in-place ops that write into its output) are decided together,
since keeping the storage once serves them all; views and stale outputs are never saved; the forward's outputs cost
nothing (whoever runs it keeps them). What is left is a 0/1 knapsack, solved exactly where possible
(``sac2.policies.knapsack``), over what each call saves: its recompute less what keeping it costs on sac2's path
(``sac2.policies.path_costs``).

The answer is keyed by (op, call index among that op's calls in the forward), so the policy decides the same way in
every forward that runs the same ops, eager or traced by torch.compile. Views and ops that are not ops for SAC
(metadata queries) are answered PREFER_RECOMPUTE and not counted, so the views a compiled forward adds or drops
shift nothing. A call the profile did not see (another batch routed to other MoE experts, a longer sequence of
ops) is recomputed, so what the budget keeps stays within what it profiled, and sac2 warns once naming it (not
under torch.compile, whose tracing adds ops of its own);
``sac2.explain(fn, inputs, budget)`` then shows what that forward keeps next to the budget's prediction.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Iterable

import torch

from sac2 import _compat, messages
from sac2._compat import tree_leaves
from sac2.core import keys, pickling
from sac2.core.decisions import CheckpointPolicy, SelectiveCheckpointContext, forward_state, op_name
from sac2.core.opinfo import IGNORE, VIEW, info
from sac2.policies import path_costs
from sac2.policies.knapsack import Solution, solve
from sac2.policies.path_costs import PathCosts
from sac2.policies.profile import OpCall, Profile, as_inputs, profile

__all__ = [
    "MemoryBudget", "memory_budget", "check_budget", "fraction_of", "device_of", "solve_budget", "value", "weight",
    "op_groups",
]

SAVE = CheckpointPolicy.PREFER_SAVE
RECOMPUTE = CheckpointPolicy.PREFER_RECOMPUTE


class MemoryBudget:
    """A policy answering, per (op, call index) of the forward, what the budget solver chose.

    PREFER_* answers, so ``compose`` with a MUST_* piece overrides it. Call counts restart with each forward
    (each checkpointed call gets a fresh context from sac2's forward mode; torch's modes have none: it raises).
    It pickles; a compiled region's key holds its callable's index, which only the process that compiled it has.
    Build it with ``memory_budget``; ``kept_bytes`` and ``recompute_cost`` are what the profile predicts.

    Args:
        profiled: the profile of one forward (``sac2.policies.profile``): its op calls, their storages and costs.
        saved: the indices, into ``profiled.calls``, of the calls the solver chose to save.
        capacity: the budget in bytes.
        solution: the knapsack solver's answer (``sac2.policies.knapsack``), which names its method.
    """

    def __init__(self, profiled: Profile, saved: frozenset[int], capacity: int, solution: Solution) -> None:
        self.profile = profiled
        self.capacity = capacity
        self.solution = solution
        self.rule = f"memory_budget({capacity} B, {solution.method})"
        self.saved = saved
        self._decisions = {(c.key, c.index): SAVE if i in saved else RECOMPUTE for i, c in enumerate(profiled.calls)}
        self._warned = False  # about a call the profile did not see: once per budget

    @property
    def kept_bytes(self) -> int:
        """Activation bytes the chosen saves keep (per the profile)."""
        return self.profile.kept_bytes(self.saved)

    @property
    def recompute_cost(self) -> float:
        """Cost, in the profile's unit, of what backward re-runs."""
        return self.profile.recompute_cost(self.saved)

    def __call__(
        self, ctx: SelectiveCheckpointContext, op: keys.PolicyOp, *args: Any, **kwargs: Any
    ) -> CheckpointPolicy:
        if type(op) is not keys.Region and info(op).kind in (VIEW, IGNORE):
            return RECOMPUTE  # never saved, and not counted: views the compiled forward adds shift nothing
        counts = forward_state(ctx, self)  # per forward: nested checkpoints sharing this policy count apart
        key = keys.replay_key(op, args)
        n = counts.get(key, 0)
        counts[key] = n + 1
        decision = self._decisions.get((key, n))
        if decision is None:
            if _compat.tracing_for_compile():
                return RECOMPUTE  # compile's tracing adds ops of its own (input clones, size reads): no warning
            if self._warned:
                return RECOMPUTE
            self._warned = True
            seen = sum(1 for k, _ in self._decisions if k == key)
            warnings.warn(messages.budget_unprofiled_call(op_name(op), n, seen), stacklevel=2)
            return RECOMPUTE
        return decision

    def __getstate__(self) -> dict[str, Any]:
        # The keys' ops pickle by their path under torch.ops (sac2._compat), HOPs made after sac2's import too.
        pickling.register_op_pickling(c.key for c in self.profile.calls)
        return self.__dict__

    def why(self, key: keys.Key, index: int) -> str:  # noqa: ARG002 (the why(op_key, call_index) protocol)
        """Which rule decided call ``index`` of ``key``: how ``sac2.explain`` labels it."""
        return self.rule

    def __repr__(self) -> str:
        return f"MemoryBudget(saves {len(self.saved)} of {len(self.profile.calls)} op calls, {self.rule})"


def memory_budget(
    fn_or_module: Callable[..., Any], example_inputs: Any, budget: float | int, cost: str | None = None
) -> MemoryBudget:
    """A policy keeping at most ``budget`` of what no checkpointing keeps, and recomputing what costs least.

    ``fn_or_module(*example_inputs)`` runs once to profile (no backward); a 0/1 knapsack over the op calls then
    picks what to save. A fraction is of what autograd keeps for backward without checkpointing (its inputs,
    parameters and outputs aside): 1 keeps no more than training without checkpointing, 0 keeps only what full
    AC keeps (the inputs, and outputs, which cost nothing). Measured costs count sac2's own path
    (``sac2.policies.path_costs``): a call whose kernel costs less to run again than keeping it under sac2's
    dispatch modes is recomputed whatever the budget. A call the profile did not see is recomputed, with a
    warning once per budget. For a whole model, ``sac2.apply_ac(model, memory_budget=...)`` also chooses between
    this policy, regions with no dispatch mode and full AC.

    Args:
        fn_or_module: the function or module (usually one block) the policy is for.
        example_inputs: its positional arguments (a tuple or list); one tensor alone is one argument.
        budget: a number in [0, 1] is a fraction of what no checkpointing keeps; an int above 1 is bytes (at most
            what no checkpointing keeps is kept).
        cost: ``"time"`` (measured on the inputs' device, with sac2's path costs) or ``"flops"`` (estimated,
            deterministic); default (None) time, unless the inputs are fake or meta tensors.

    Returns:
        A ``MemoryBudget`` policy, for ``sac2.create_selective_checkpoint_contexts`` or ``sac2.apply_ac``.

    Raises:
        TypeError: ``budget`` is not an int or a float (a bool is neither).
        ValueError: a float ``budget`` outside [0, 1] or a negative int; ``cost`` is neither ``"time"`` nor
            ``"flops"``.
    """
    check_budget(budget)
    profiled = profile(fn_or_module, example_inputs, cost)
    costs = path_costs.measure(device_of(example_inputs)) if profiled.cost_unit == "s" else None
    return solve_budget(profiled, budget, costs)


def check_budget(budget: object) -> None:
    """Raise unless ``budget`` is a fraction in [0, 1] (an int 0 or 1 too) or bytes (an int)."""
    if isinstance(budget, bool) or not isinstance(budget, (int, float)):
        raise TypeError(messages.budget_bad_type(budget))
    if isinstance(budget, float) and not 0.0 <= budget <= 1.0:
        raise ValueError(messages.budget_fraction_out_of_range(budget))
    if isinstance(budget, int) and budget < 0:
        raise ValueError(messages.budget_negative_bytes(budget))


def fraction_of(budget: float | int, none_bytes: int) -> float:
    """``budget`` as a fraction of ``none_bytes``, what no checkpointing keeps: a number in [0, 1] is one already,
    bytes above it are capped at 1 (a budget never keeps more than no checkpointing)."""
    check_budget(budget)
    if budget <= 1:
        return float(budget)
    return min(budget / none_bytes, 1.0) if none_bytes else 1.0


def device_of(example_inputs: Any) -> torch.device:
    """Where the example inputs live (their first tensor's device; the CPU without one)."""
    for t in tree_leaves(as_inputs(example_inputs)):
        if isinstance(t, torch.Tensor):
            return t.device
    return torch.device("cpu")


def solve_budget(profiled: Profile, budget: float | int, costs: PathCosts | None = None) -> MemoryBudget:
    """The ``MemoryBudget`` for an existing profile (``sac2.explain`` sweeps budgets this way). ``costs``: sac2's
    path costs, with which a call is worth keeping only where recomputing it costs more than keeping it under
    sac2's modes (None: every call is, at its profiled cost)."""
    check_budget(budget)
    none = profiled.none_bytes
    capacity = int(budget * none) if budget <= 1 else min(int(budget), none)  # bytes: at most no checkpointing's
    groups = op_groups(profiled)
    weights = [weight(profiled, storages) for _, storages in groups]
    values = [max(sum(value(profiled.calls[i], costs, saved=costs.mode_saved if costs else 0.0) for i in calls), 0.0)
              for calls, _ in groups]
    solution = solve(weights, values, capacity)
    saved = frozenset(i for g in solution.chosen for i in groups[g][0])
    return MemoryBudget(profiled, saved, capacity, solution)


def value(call: OpCall, costs: PathCosts | None, saved: float) -> float:
    """What keeping ``call`` saves in backward: its recompute (``costs``: with its dispatch) less what keeping it
    costs (``saved``); nothing where recompute stops before it."""
    if not call.reached:
        return 0.0
    return call.cost if costs is None else costs.recompute(call.cost, call.ops) - saved


def weight(profiled: Profile, storages: Iterable[int]) -> int:
    """Bytes keeping ``storages`` costs: the forward's outputs are kept anyway (``Profile.free``)."""
    free = set(profiled.free)
    return sum(profiled.storage_bytes[s] for s in storages if s not in free)


def op_groups(profiled: Profile) -> list[tuple[list[int], set[int]]]:
    """Saveable calls joined when they share a storage: (calls, storages) per group."""
    groups: list[tuple[list[int], set[int]]] = []
    owner: dict[int, int] = {}  # storage -> group
    for i, call in enumerate(profiled.calls):
        if call.view or call.stale:
            continue
        hit = sorted({owner[s] for s in call.storages if s in owner})
        if hit:
            g = hit[0]
            for other in hit[1:]:  # this call bridges groups: merge them into the first
                calls, storages = groups[other]
                groups[g][0].extend(calls)
                groups[g][1].update(storages)
                groups[other] = ([], set())
        else:
            g = len(groups)
            groups.append(([], set()))
        groups[g][0].append(i)
        groups[g][1].update(call.storages)
        for s in groups[g][1]:
            owner[s] = g
    return [g for g in groups if g[0]]
