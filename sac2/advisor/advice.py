"""What ``sac2.advise`` answers, chosen from the rows it measured: ``Advice`` (the rows, the Pareto front, the rows
another row dominates, the recommendation; shown as a report, a table, JSON or a plot) and ``recommend``, which makes
one. Measuring the rows is ``sac2.advisor.runs``'.

Step times compare within ``TIE`` (5%): a row is faster than another only when its median ratio to it, round by
round, is below ``1 - TIE``. A row another row dominates (keeps no more, peaks no higher, keeps no more in host
memory, and is faster beyond a tie) is marked and offered no code. The recommendation is, of the rows that fit the
targets, the one keeping least among those within ``TIE`` of the fastest of them (then the lowest peak, then the
least in host memory, then the first in the table): between setups whose step times tie, less memory decides, so
the same machine gives the same answer run after run. Kept and peak bytes, and so the targets, are the device's: an
offload row keeping less there by keeping bytes in host memory is an option like any other.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass, field
from typing import Sequence

import torch

from sac2 import messages
from sac2.measure.host_link import HostLink
from sac2.measure.step import Result

__all__ = ["Advice", "recommend", "unsettled", "TIE"]

#: Step times within this share of each other tie.
TIE = 0.05


@dataclass
class Advice:
    """What ``sac2.advise`` measured, and the setup it recommends.

    ``str(advice)`` is the report ``python -m sac2 advise`` prints; ``table()``, ``to_json()`` and ``plot()`` give
    the same figures in other forms. Built by ``sac2.advise``, not by hand.

    Args:
        rows: a row per setup that ran, no checkpointing first (``Result.policy`` holds the setup's line of code).
        skipped: setup name -> why it was skipped.
        front: the Pareto front: the recommendable rows no other dominates.
        target_bytes: the target on kept bytes; None for none (a peak target alone).
        recommended: the recommended row's name; None when no setup fits the targets.
        references: names of rows shown for comparison only, never recommended (stock SAC).
        device: where the setups ran.
        steps: the fewest timed steps per setup (more ran where rows were unsettled).
        peak_target_bytes: the target on the step's peak; None for none.
        dominated: row name -> the row that dominates it (keeps no more, peaks no higher, faster beyond a tie).
        ties: the rows that fit whose step times tie with the fastest that fits (the recommendation keeps least).
        notes: what the run has to say about some rows (a budget that runs full AC, one made smaller to fit).
        clock: what timed the steps (``sac2.measure.step.clock_name``).
        host_link: the host link's bandwidth, measured where offload rows ran (``sac2.measure.host_link``); None
            elsewhere.
    """

    rows: list[Result]
    skipped: dict[str, str]
    front: list[str]
    target_bytes: int | None
    recommended: str | None
    references: list[str] = field(default_factory=list)
    device: str = "cpu"
    steps: int = 1
    peak_target_bytes: int | None = None
    dominated: dict[str, str] = field(default_factory=dict)
    ties: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    clock: str = "wall clock"
    host_link: HostLink | None = None

    def row(self, name: str) -> Result:
        """The row named ``name``."""
        for r in self.rows:
            if r.name == name:
                return r
        raise KeyError(name)

    @property
    def code(self) -> str | None:
        """The line of code of the recommended setup."""
        return None if self.recommended is None else self.row(self.recommended).policy

    def fits(self, r: Result) -> bool:
        """Whether row ``r`` keeps and peaks within the targets."""
        return _fits(r, self.target_bytes, self.peak_target_bytes)

    def __str__(self) -> str:
        lines = [f"sac2 advise: {len(self.rows)} setups, {self.steps}+ timed steps each ({self.clock}), {self.device}; "
                 f"{self._targets()}", self.table(),
                 f"Pareto front (step time against kept memory; ties within {TIE:.0%}): {', '.join(self.front)}"]
        if self.host_link is not None:
            lines.append(_link_line(self.host_link))
        if self.references:
            lines.append(f"reference only (not recommended): {', '.join(self.references)}")
        if any(not r.equal for r in self.rows):
            lines.append("NOT bitwise equal to no checkpointing (never recommended): "
                         + ", ".join(r.name for r in self.rows if not r.equal))
        lines += [f"skipped {name}: {reason}" for name, reason in self.skipped.items()]
        lines += [f"note: {note}" for note in self.notes]
        if self.recommended is None:
            least = min((r for r in self.rows if r.equal), key=lambda r: r.kept_bytes)
            lines.append(messages.advise_nothing_fits(self._targets(), least.name, _mib(least.kept_bytes),
                                                      _mib(least.peak_bytes)))
            return "\n".join(lines)
        r = self.row(self.recommended)
        why = "the fastest that fits" if len(self.ties) < 2 else \
            f"of {', '.join(self.ties)} (within {TIE:.0%} of the fastest that fits), the one keeping least"
        host = f", {_mib(r.host_bytes)} in host memory" if r.host_bytes else ""
        lines.append(f"recommended: {r.name} ({why}: {_mib(r.kept_bytes)} kept, {_mib(r.peak_bytes)} peak{host}, "
                     f"{r.median_s / self.rows[0].median_s:.2f}x the step of none)")
        lines.append(f"    {r.policy}")
        return "\n".join(lines)

    def _targets(self) -> str:
        parts = []
        if self.target_bytes is not None:
            parts.append(f"at most {_mib(self.target_bytes)} kept for backward")
        if self.peak_target_bytes is not None:
            parts.append(f"a peak of at most {_mib(self.peak_target_bytes)}")
        return "memory target: " + " and ".join(parts)

    def table(self) -> str:
        """The rows as an aligned text table: time and memory against no checkpointing (the first row), whether each
        is on the Pareto front and fits the targets, and its code (none for a row another dominates). Where offload
        rows ran (``host_link``), a column after the peak gives what each row keeps in host memory."""
        none = self.rows[0]
        unit, scale = ("MiB", 2**20) if none.kept_bytes >= 2**20 else ("KiB", 2**10)
        host = self.host_link is not None
        header = ("setup", "step ms", "vs none", f"kept {unit}", "vs none", f"peak {unit}",
                  *((f"host {unit}",) if host else ()), "equal", "front", "fits", "code")
        rows = [
            (
                r.name,
                f"{r.median_s * 1e3:.1f}",
                f"{r.median_s / none.median_s:.2f}x",
                f"{r.kept_bytes / scale:.1f}",
                f"{r.kept_bytes / max(none.kept_bytes, 1):.2f}x",
                f"{r.peak_bytes / scale:.1f}",
                *((f"{r.host_bytes / scale:.1f}",) if host else ()),
                "yes" if r.equal else "NO",
                "*" if r.name in self.front else "",
                "yes" if self.fits(r) else "",
                f"(dominated by {self.dominated[r.name]})" if r.name in self.dominated else r.policy,
            )
            for r in self.rows
        ]
        widths = [max(len(row[c]) for row in (header, *rows)) for c in range(len(header))]
        return "\n".join(
            "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in (header, *rows)
        )

    def to_json(self) -> str:
        """The advice as a JSON document (rows with their step times, kept, peak and host bytes, equality, code; the
        host link's bandwidth where offload rows ran)."""
        base = self.rows[0].median_s
        rows = [{**asdict(r), "code": None if r.name in self.dominated else r.policy, "median_s": r.median_s,
                 "ratio_to_none": r.median_s / base, "dominated_by": self.dominated.get(r.name)} for r in self.rows]
        for r in rows:
            del r["policy"]
        payload = {"device": self.device, "steps": self.steps, "clock": self.clock, "torch": torch.__version__,
                   "target_bytes": self.target_bytes, "peak_target_bytes": self.peak_target_bytes, "rows": rows,
                   "skipped": self.skipped, "pareto_front": self.front, "references": self.references,
                   "ties": self.ties, "notes": self.notes, "recommended": self.recommended, "code": self.code,
                   "host_link": None if self.host_link is None else asdict(self.host_link)}
        return json.dumps(payload, indent=2)

    def plot(self, path: str) -> None:
        """Save a scatter of kept memory against step time to ``path``, the front marked (needs matplotlib)."""
        from sac2.bench.output import plot

        plot(self.rows, None, path, f"sac2 advise: {self.device}, {self.steps} steps")


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


def _link_line(link: HostLink) -> str:
    """The host link's bandwidth, and how it was measured."""
    return (f"host link ({link.link}): {link.to_host / 1e9:.2f} GB/s to the host, {link.to_device / 1e9:.2f} GB/s "
            f"back (the median of {link.repeats} timed copies of a {_mib(link.nbytes)} pinned buffer each way, on "
            f"offload's own streams)")


def _fits(r: Result, kept: int | None, peak: int | None) -> bool:
    return (kept is None or r.kept_bytes <= kept) and (peak is None or r.peak_bytes <= peak)


def ratio(a: Result, b: Result) -> float:
    """``a``'s step time over ``b``'s: the median of their ratios round by round (rounds are side by side)."""
    return statistics.median(x / y for x, y in zip(a.step_s, b.step_s, strict=False))


def _interval(a: Result, b: Result) -> tuple[float, float]:
    """A 95% interval of ``ratio(a, b)``: the order statistics around the median of the round-by-round ratios."""
    q = sorted(x / y for x, y in zip(a.step_s, b.step_s, strict=False))
    k = max(int(len(q) / 2 - 0.98 * len(q) ** 0.5), 0)
    return q[k], q[len(q) - 1 - k]


def _eligible(results: list[Result], reference: Sequence[bool]) -> list[Result]:
    return [r for r, ref in zip(results, reference, strict=True) if r.equal and not ref]


def _fastest(rows: list[Result]) -> Result:
    return min(rows, key=lambda r: r.median_s)


def unsettled(results: list[Result], reference: Sequence[bool], kept: int | None, peak: int | None) -> bool:
    """Whether some fitting row's ratio to the fastest fitting row is not yet clearly within or beyond a tie."""
    fitting = [r for r in _eligible(results, reference) if _fits(r, kept, peak)]
    if len(fitting) < 2:
        return False
    fastest = _fastest(fitting)
    return any(lo <= 1 + TIE <= hi for lo, hi in (_interval(r, fastest) for r in fitting if r is not fastest))


def _dominator(r: Result, rows: list[Result]) -> Result | None:
    """A row that keeps no more than ``r`` on the device or in host memory, peaks no higher and is faster beyond a
    tie, or None."""
    for o in rows:
        if (o is not r and o.kept_bytes <= r.kept_bytes and o.peak_bytes <= r.peak_bytes
                and o.host_bytes <= r.host_bytes and ratio(o, r) < 1 - TIE):
            return o
    return None


def recommend(
    results: list[Result], reference: Sequence[bool], skipped: dict[str, str], target: int | None, device: str,
    steps: int, peak_target_bytes: int | None = None, notes: Sequence[str] = (), clock: str = "wall clock",
    host_link: HostLink | None = None,
) -> Advice:
    """The ``Advice`` for measured rows (no checkpointing first; ``reference[i]``: row ``i`` is shown for comparison
    only), as the module doc says; ``host_link``: the bandwidth measured beside offload rows."""
    eligible = _eligible(results, reference)
    dominated = {r.name: d.name for r in results if (d := _dominator(r, eligible)) is not None}
    front = [r.name for r in eligible if r.name not in dominated]
    fitting = [r for r in eligible if _fits(r, target, peak_target_bytes)]
    best, ties = None, []
    if fitting:
        fastest = _fastest(fitting)
        tied = [r for r in fitting if r is fastest or ratio(r, fastest) <= 1 + TIE]
        best = min(tied, key=lambda r: (r.kept_bytes, r.peak_bytes, r.host_bytes, results.index(r)))
        while (d := _dominator(best, fitting)) is not None:  # not transitive, ties: never recommend a dominated row
            best = d
        ties = [r.name for r in tied]
    return Advice(
        rows=results, skipped=skipped, front=front, target_bytes=target,
        recommended=None if best is None else best.name,
        references=[r.name for r, ref in zip(results, reference, strict=True) if ref], device=device, steps=steps,
        peak_target_bytes=peak_target_bytes, dominated=dominated, ties=ties, notes=list(notes), clock=clock,
        host_link=host_link,
    )
