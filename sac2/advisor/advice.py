"""What ``sac2.advise`` answers, chosen from the rows it measured: ``Advice`` (the rows, the Pareto front of step
time against kept bytes, the fastest setup that fits the memory target; shown as a report, a table, JSON or a
plot) and ``recommend``, which makes one. Measuring the rows is ``sac2.advisor``'s.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Sequence

import torch

from sac2 import messages
from sac2.measure.pareto import pareto_front
from sac2.measure.step import Result

__all__ = ["Advice", "recommend"]


@dataclass
class Advice:
    """What ``sac2.advise`` measured, and the setup it recommends.

    ``str(advice)`` is the report ``python -m sac2 advise`` prints; ``table()``, ``to_json()`` and ``plot()`` give
    the same figures in other forms. Built by ``sac2.advise``, not by hand.

    Args:
        rows: a row per setup that ran, no checkpointing first (``Result.policy`` holds the setup's line of code).
        skipped: setup name -> why it was skipped.
        front: the Pareto front: names of the recommendable rows that no other is both faster than and keeps
            less than.
        target_bytes: the memory target in bytes.
        recommended: the recommended row's name; None when no setup fits the target.
        references: names of rows shown for comparison only, never recommended (stock SAC).
        device: where the setups ran.
        steps: timed steps per setup.
    """

    rows: list[Result]
    skipped: dict[str, str]
    front: list[str]
    target_bytes: int
    recommended: str | None
    references: list[str] = field(default_factory=list)
    device: str = "cpu"
    steps: int = 1

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

    def __str__(self) -> str:
        lines = [
            f"sac2 advise: {len(self.rows)} setups, {self.steps} timed steps each, {self.device}; "
            f"memory target {_mib(self.target_bytes)} kept for backward",
            self.table(),
            f"Pareto front (step time against kept memory): {', '.join(self.front)}",
        ]
        if self.references:
            lines.append(f"reference only (not recommended): {', '.join(self.references)}")
        if any(not r.equal for r in self.rows):
            lines.append("NOT bitwise equal to no checkpointing (never recommended): "
                         + ", ".join(r.name for r in self.rows if not r.equal))
        for name, reason in self.skipped.items():
            lines.append(f"skipped {name}: {reason}")
        if self.recommended is None:
            least = min((r for r in self.rows if r.equal), key=lambda r: r.kept_bytes)
            lines.append(messages.advise_nothing_fits(_mib(self.target_bytes), least.name, _mib(least.kept_bytes)))
        else:
            r = self.row(self.recommended)
            lines.append(f"recommended: {r.name} (fastest setup keeping at most {_mib(self.target_bytes)}: "
                         f"{_mib(r.kept_bytes)} kept, {r.median_s / self.rows[0].median_s:.2f}x the step of none)")
            lines.append(f"    {r.policy}")
        return "\n".join(lines)

    def table(self) -> str:
        """The rows as an aligned text table: time and memory against no checkpointing (the first row), whether each
        is on the Pareto front and fits the target."""
        none = self.rows[0]
        unit, scale = ("MiB", 2**20) if none.kept_bytes >= 2**20 else ("KiB", 2**10)
        header = ("setup", "step ms", "vs none", f"kept {unit}", "vs none", f"peak {unit}", "equal", "front", "fits",
                  "code")
        rows = [
            (
                r.name,
                f"{r.median_s * 1e3:.1f}",
                f"{r.median_s / none.median_s:.2f}x",
                f"{r.kept_bytes / scale:.1f}",
                f"{r.kept_bytes / max(none.kept_bytes, 1):.2f}x",
                f"{r.peak_bytes / scale:.1f}",
                "yes" if r.equal else "NO",
                "*" if r.name in self.front else "",
                "yes" if r.kept_bytes <= self.target_bytes else "",
                r.policy,
            )
            for r in self.rows
        ]
        widths = [max(len(row[c]) for row in (header, *rows)) for c in range(len(header))]
        return "\n".join(
            "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in (header, *rows)
        )

    def to_json(self) -> str:
        """The advice as a JSON document (rows with their step times, kept and peak bytes, equality, code)."""
        base = self.rows[0].median_s
        rows = [{**asdict(r), "code": r.policy, "median_s": r.median_s, "ratio_to_none": r.median_s / base}
                for r in self.rows]
        for r in rows:
            del r["policy"]
        payload = {"device": self.device, "steps": self.steps, "torch": torch.__version__,
                   "target_bytes": self.target_bytes, "rows": rows, "skipped": self.skipped,
                   "pareto_front": self.front, "references": self.references, "recommended": self.recommended,
                   "code": self.code}
        return json.dumps(payload, indent=2)

    def plot(self, path: str) -> None:
        """Save a scatter of kept memory against step time to ``path``, the front marked (needs matplotlib)."""
        from sac2.bench.output import plot

        plot(self.rows, None, path, f"sac2 advise: {self.device}, {self.steps} steps")


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


def recommend(
    results: list[Result], reference: Sequence[bool], skipped: dict[str, str], target: int, device: str, steps: int
) -> Advice:
    """The ``Advice`` for measured rows (no checkpointing first; ``reference[i]``: row ``i`` is shown for
    comparison only): the Pareto front of the rows equal to no checkpointing, and the fastest of them that keeps
    at most ``target`` bytes."""
    eligible = [i for i, (r, ref) in enumerate(zip(results, reference, strict=True)) if r.equal and not ref]
    front = [eligible[j] for j in pareto_front([(results[i].median_s, results[i].kept_bytes) for i in eligible])]
    fits = [i for i in eligible if results[i].kept_bytes <= target]
    best = min(fits, key=lambda i: results[i].median_s) if fits else None
    return Advice(
        rows=results, skipped=skipped, front=[results[i].name for i in front], target_bytes=target,
        recommended=None if best is None else results[best].name,
        references=[r.name for r, ref in zip(results, reference, strict=True) if ref], device=device, steps=steps,
    )
