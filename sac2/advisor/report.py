"""``sac2.explain``: what a policy keeps and recomputes, per op, and what other budgets would trade.

One forward runs under sac2's own forward mode with the policy (``sac2.policies.profile``), so the report is what that
forward's record holds, not a separate reading of the ops. Rows
group calls by op (a ``sac2.region`` is one op): how many calls, the activation bytes its saved calls keep, the
bytes its recomputed calls free, the recompute cost, the decision and the rule that made it. A policy names
its rule with ``why(op_key, call_index) -> str`` (``MemoryBudget`` does); otherwise the policy's name stands
(a preset's repr, a function's ``module.qualname``).

Bytes the policy offloads (a CPU_OFFLOAD answer, a region ``apply_ac(offload=...)`` names) are kept in host memory,
not on the device: the report counts them apart (``host_bytes``), and its kept bytes, the curve's and a budget's
prediction are the device's. Where offload moves nothing (tensors on a machine without an accelerator) an offload
answer saves in place, so those bytes are the device's, and a line says so.
"""

from __future__ import annotations

import json
import types
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

from sac2.core.decisions import OFFLOADING, Policy, PolicyFn, SaveList, as_policy
from sac2.core.keys import Region
from sac2.policies.budget import solve_budget
from sac2.policies.profile import Profile, profile

__all__ = ["Row", "Report", "explain", "plot_budgets"]

#: Budgets the report's trade-off curve samples, as fractions of what no checkpointing keeps.
BUDGETS = tuple(i / 10 for i in range(11))


@dataclass
class Row:
    """One op of the report (all its calls in the forward): ``saved_bytes`` kept on the device, ``host_bytes`` in
    host memory (offloaded)."""

    op: str
    calls: int
    saved_bytes: int
    freed_bytes: int
    recompute_cost: float
    decision: str
    rule: str
    host_bytes: int = 0


@dataclass
class RegionRow:
    """One region of the report: what saving it keeps (its outputs and what its body saved for backward) next to
    what its outputs alone hold (what saving the same computation op by op keeps at least), and the bytes of its
    own inputs its body saved, which recompute rebuilds instead of keeping (``keep_inputs=True`` keeps them)."""

    region: str
    calls: int
    kept_bytes: int
    output_bytes: int
    rebuilt_bytes: int = 0


@dataclass
class Report:
    """Per-op rows, totals, and the memory/recompute trade-off across budgets (fraction, bytes, cost).

    What ``sac2.explain`` returns: ``str(report)`` is the per-op table, ``to_json()``/``from_json()`` round-trip
    it, ``plot(path)`` draws the trade-off curve with this policy marked.

    Args:
        rows: one ``Row`` per op, all its calls in the forward: calls, bytes saved (on the device and in host
            memory) and freed, recompute cost, the decision and the rule that made it.
        cost_unit: the unit of the costs: ``"s"`` (measured time) or ``"flop"``.
        kept_bytes: activation bytes the policy keeps for backward on the device.
        total_bytes: activation bytes saving every op would keep.
        recompute_cost: what backward re-runs, in ``cost_unit``.
        none_bytes: what the forward keeps for backward without checkpointing (its inputs, parameters and outputs
            aside): the 100% of the curve's budget fractions.
        curve: (budget fraction, kept bytes, recompute cost) for budgets 0, 0.1, ..., 1.
        predicted_bytes: what a memory budget predicted it keeps (from the forward it profiled), when the policy
            is one; else None.
        regions: one ``RegionRow`` per region: what saving it keeps next to what its outputs alone hold.
        host_bytes: activation bytes the policy keeps for backward in host memory (what it offloads; sent when the
            next checkpointed block starts, so the last block of a forward keeps its own on the device).
        offloads: whether the policy answered CPU_OFFLOAD for some call (the table then shows host bytes).
        offloaded_in_place: bytes the policy offloads that stay on the device, saved: offload moves nothing there.
    """

    rows: list[Row]
    cost_unit: str
    kept_bytes: int
    total_bytes: int
    recompute_cost: float
    curve: list[tuple[float, int, float]] = field(default_factory=list)
    #: What a memory budget predicted it keeps (from the forward it profiled), when the policy is one.
    predicted_bytes: int | None = None
    regions: list[RegionRow] = field(default_factory=list)
    none_bytes: int = 0
    host_bytes: int = 0
    offloads: bool = False
    offloaded_in_place: int = 0

    def __str__(self) -> str:
        host = self.offloads

        def line(op: str, calls: str, saved: int, on_host: int, freed: int, cost: float, decision: str,
                 rule: str) -> tuple[str, ...]:
            return (op, calls, str(saved), *((str(on_host),) if host else ()), str(freed), f"{cost:.4g}", decision,
                    rule)

        head = ("op", "calls", "saved B", *(("host B",) if host else ()), "freed B", f"recompute ({self.cost_unit})",
                "decision", "rule")
        body = [line(r.op, str(r.calls), r.saved_bytes, r.host_bytes, r.freed_bytes, r.recompute_cost, r.decision,
                     r.rule) for r in self.rows]
        total = line("total", str(sum(r.calls for r in self.rows)), self.kept_bytes, self.host_bytes,
                     sum(r.freed_bytes for r in self.rows), self.recompute_cost, "", "")
        lines = _table(head, [*body, total])
        if self.regions:
            lines.append("")
            lines.extend(_table(("region", "calls", "kept if saved B (outputs + backward state)", "outputs B",
                                 "inputs rebuilt B"),
                                [(r.region, str(r.calls), str(r.kept_bytes), str(r.output_bytes),
                                  str(r.rebuilt_bytes)) for r in self.regions]))
        if self.predicted_bytes is not None and self.predicted_bytes != self.kept_bytes:
            lines.append(f"this forward keeps {self.kept_bytes} B; the budget predicted {self.predicted_bytes} B "
                         f"from the forward it profiled")
        if self.offloaded_in_place:
            lines.append(f"offloaded but kept on the device: {self.offloaded_in_place} B (offload moves tensors off a "
                         f"CUDA device to host memory; these are not on one, so the offload answer saves them)")
        return "\n".join(lines)

    def to_json(self) -> str:
        """The report as a JSON document; ``Report.from_json`` reads it back."""
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> Report:
        """The report ``to_json`` wrote."""
        data = json.loads(text)
        data["rows"] = [Row(**r) for r in data["rows"]]
        data["regions"] = [RegionRow(**r) for r in data["regions"]]
        data["curve"] = [tuple(p) for p in data["curve"]]
        return cls(**data)

    def plot(self, path: str) -> None:
        """Write a PNG of kept memory against recompute cost across budgets, this policy marked."""
        _plot(self.curve, (self.kept_bytes, self.recompute_cost), self.cost_unit, path)


def explain(
    fn_or_module: Callable[..., Any], example_inputs: Any, policy: Policy, cost: str | None = None
) -> Report:
    """Run ``fn_or_module(*example_inputs)`` once under sac2's forward mode and report what ``policy`` keeps and
    recomputes per op: exactly what that forward's record holds, so the report cannot disagree with what a
    checkpoint with this policy keeps. Runs no backward. What the policy offloads (CPU_OFFLOAD answers) is counted
    in host memory, apart from what it keeps on the device, where offload moves tensors (a CUDA device); elsewhere
    an offload answer saves in place, and the report says so.

    Args:
        fn_or_module: the function or module to run.
        example_inputs: its positional arguments (a tuple or list); one tensor alone is one argument.
        policy: a policy callable or a list of ops to save, as ``sac2.create_selective_checkpoint_contexts``
            takes.
        cost: ``"time"`` (measured) or ``"flops"`` (estimated, deterministic); default (None) time, unless the
            inputs are fake or meta tensors, which cannot be timed.

    Returns:
        A ``Report``: a row per op (bytes kept on the device and in host memory), totals, and the trade-off curve
        across memory budgets (of device bytes).

    Raises:
        ValueError: ``cost`` is neither ``"time"`` nor ``"flops"``; ``policy`` is a list holding something that
            is not an op or a ``sac2.Region``.
        TypeError: ``policy`` is neither callable nor a list; the policy answered something other than a
            ``CheckpointPolicy`` or a bool.
    """
    policy = as_policy(policy)
    return _report(profile(fn_or_module, example_inputs, cost, policy), policy)


def plot_budgets(
    fn_or_module: Callable[..., Any], example_inputs: Any, path: str, cost: str | None = None
) -> list[tuple[float, int, float]]:
    """Profile one forward and plot, to ``path``, memory against recompute cost for budgets 0, 0.1, ..., 1.

    The curve ``sac2.policies.memory_budget`` moves along: where to set a budget before choosing one.

    Args:
        fn_or_module: the function or module to run.
        example_inputs: its positional arguments (a tuple or list); one tensor alone is one argument.
        path: where to write the image (matplotlib picks the format from the suffix, e.g. ``.png``).
        cost: ``"time"`` (measured) or ``"flops"`` (estimated, deterministic); default (None) time, unless the
            inputs are fake or meta tensors, which cannot be timed.

    Returns:
        The plotted points: (budget fraction, kept bytes, recompute cost) for each budget.

    Raises:
        ValueError: ``cost`` is neither ``"time"`` nor ``"flops"``.
        ImportError: matplotlib is not installed.
    """
    prof = profile(fn_or_module, example_inputs, cost)
    curve = _curve(prof)
    _plot(curve, None, prof.cost_unit, path)
    return curve


class _PerCall:
    """Per call, the bytes of the storages its saving first keeps on the device (``device``) and in host memory
    (``host``), and of those it allocated that nothing keeps (``freed``); the storages kept on the device and in host
    memory (``placed``: one storage may be in both, copied to the host while a device save holds it), and those
    the policy offloads that stay on the device (``in_place``: offload cannot move them)."""

    def __init__(self) -> None:
        self.device: dict[int, int] = {}
        self.host: dict[int, int] = {}
        self.freed: dict[int, int] = {}
        self.placed: tuple[set[int], set[int]] = (set(), set())
        self.in_place: set[int] = set()


def _bytes_per_call(prof: Profile) -> _PerCall:
    """Where each call's bytes go (``_PerCall``). One pass over the calls' storages each, so the report costs
    calls + storages, not calls x storages."""
    per = _PerCall()
    for i in prof.saved:
        off = prof.offloaded(i)
        for s, on_host in prof.where(i):
            if off and not on_host:
                per.in_place.add(s)
            where, by = (per.placed[1], per.host) if on_host else (per.placed[0], per.device)
            if s not in where:
                where.add(s)
                by[i] = by.get(i, 0) + prof.storage_bytes[s]
    kept = per.placed[0] | per.placed[1]
    allocated: set[int] = set()
    for i, c in enumerate(prof.calls):
        for s in c.storages:
            if s not in allocated:
                allocated.add(s)
                if s not in kept:
                    per.freed[i] = per.freed.get(i, 0) + prof.storage_bytes[s]
    return per


def _report(prof: Profile, policy: PolicyFn) -> Report:
    served = prof.saved
    per = _bytes_per_call(prof)
    why = getattr(policy, "why", None)
    name = _policy_name(policy)
    rows: dict[str, Row] = {}
    calls_of: dict[str, list[int]] = {}
    for i, c in enumerate(prof.calls):
        row = rows.get(c.name)
        if row is None:
            row = rows[c.name] = Row(c.name, 0, 0, 0, 0.0, "", "")
        calls_of.setdefault(c.name, []).append(i)
        row.calls += 1
        row.saved_bytes += per.device.get(i, 0)
        row.host_bytes += per.host.get(i, 0)
        row.freed_bytes += per.freed.get(i, 0)
        if not c.saved and c.reached:  # recompute stops before an unreached call
            row.recompute_cost += c.cost
        if c.stale:
            rule = "stale output: sac2 recomputes it"
        elif c.view:
            rule = "view: re-run, never saved"
        else:
            rule = why(c.key, c.index) if why is not None else name
        row.rule = rule if row.rule in ("", rule) else "several"
    for op, row in rows.items():
        row.decision = _decision(prof, calls_of[op])
    predicted = getattr(policy, "kept_bytes", None)
    device, host, in_place = (sum(prof.storage_bytes[s] for s in group) for group in (*per.placed, per.in_place))
    return Report(list(rows.values()), prof.cost_unit, device, prof.total_bytes, prof.recompute_cost(served),
                  _curve(prof), predicted if isinstance(predicted, int) else None, _regions(prof), prof.none_bytes,
                  host, any(prof.offloaded(i) for i in range(len(prof.calls))), in_place)


def _table(head: tuple[str, ...], body: list[tuple[str, ...]]) -> list[str]:
    """Aligned text lines: the header, a rule, the rows."""
    widths = [max(len(line[i]) for line in (head, *body)) for i in range(len(head))]

    def fmt(line: tuple[str, ...]) -> str:
        return "  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip()

    return [fmt(head), "  ".join("-" * w for w in widths), *map(fmt, body)]


def _regions(prof: Profile) -> list[RegionRow]:
    rows: dict[str, RegionRow] = {}
    for c in prof.calls:
        if type(c.key) is Region:
            row = rows.setdefault(c.key.name, RegionRow(c.key.name, 0, 0, 0))
            row.calls += 1
            row.kept_bytes += sum(prof.storage_bytes[s] for s in c.storages)
            row.output_bytes += sum(prof.storage_bytes[s] for s in c.outputs)
            row.rebuilt_bytes += sum(prof.storage_bytes[s] for s in c.rebuilt)
    return list(rows.values())


def _decision(prof: Profile, calls: list[int]) -> str:
    saved = [i for i in calls if prof.calls[i].saved]
    n = len(saved)
    offloaded = n and all(prof.calls[i].decision in OFFLOADING for i in saved)
    kind = "offload" if offloaded else "save"
    if n == len(calls):
        return kind
    return "recompute" if n == 0 else f"{kind} {n} of {len(calls)}"


def _policy_name(policy: object) -> str:
    if isinstance(policy, SaveList):
        return "save list"
    if isinstance(policy, (types.FunctionType, types.MethodType)):  # their repr holds an address
        return f"{policy.__module__}.{policy.__qualname__}"
    if type(policy).__repr__ is not object.__repr__:  # presets name themselves, e.g. sac2.policies.llm()
        return repr(policy)
    return getattr(policy, "__name__", None) or type(policy).__name__


def _curve(prof: Profile) -> list[tuple[float, int, float]]:
    points = []
    for b in BUDGETS:
        policy = solve_budget(prof, b)
        points.append((b, policy.kept_bytes, policy.recompute_cost))
    return points


def _plot(curve: list[tuple[float, int, float]], mark: tuple[int, float] | None, unit: str, path: str) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6, 4))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.plot([p[1] for p in curve], [p[2] for p in curve], "o-", label="memory_budget")
    for b, kept, cost in curve:
        ax.annotate(f"{b:g}", (kept, cost), textcoords="offset points", xytext=(4, 4), fontsize=7)
    if mark is not None:
        ax.plot([mark[0]], [mark[1]], "r*", markersize=12, label="this policy")
    ax.set_xlabel("activation memory kept for backward (bytes)")
    ax.set_ylabel(f"recompute cost ({unit})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
