"""What the bench shows of a run: the text table of its modes and the plot of memory against step time (its Pareto
front marked, with the per-op curve beside it when there is one)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

from sac2.measure.pareto import pareto_front
from sac2.measure.step import Result

if TYPE_CHECKING:
    from matplotlib.axes import Axes

__all__ = ["format_table", "plot"]


def format_table(results: Sequence[Result]) -> str:
    """The results as an aligned text table, ratios relative to the first row (no checkpointing)."""
    base = results[0].median_s
    header = ("mode", "step ms", "vs none", "kept MiB", "peak MiB", "equal", "policy")
    rows_ = [
        (
            r.name,
            f"{r.median_s * 1e3:.1f}",
            f"{r.median_s / base:.2f}x",
            f"{r.kept_bytes / 2**20:.1f}",
            f"{r.peak_bytes / 2**20:.1f}",
            "yes" if r.equal else "NO",
            r.policy,
        )
        for r in results
    ]
    widths = [max(len(row[c]) for row in (header, *rows_)) for c in range(len(header))]
    lines = ("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in (header, *rows_))
    return "\n".join(lines)


def plot(results: Sequence[Result], curve_data: dict[str, Any] | None, path: str, title: str) -> None:
    """Save to ``path`` a scatter of each mode's kept memory against its step time, and the per-op curve if given.

    Needs matplotlib (``pip install 'sac2[plot]'``)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(13 if curve_data else 7, 5))  # no pyplot: the caller's backend and figures stay untouched
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 2 if curve_data else 1, 1)
    markers = "os^vD<>pP*Xh"
    points = [(r.median_s * 1e3, r.kept_bytes / 2**20) for r in results]
    front = pareto_front(points)
    for i, r in enumerate(results):  # a legend, not labels next to points: modes often land on top of each other
        name = f"{r.name} (Pareto front)" if i in front else r.name
        ax.scatter(*points[i], label=name, marker=markers[i % len(markers)], zorder=3)
    _mark_front(ax, [points[i] for i in front])
    ax.legend(fontsize="small", loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=2)  # below: off the points
    ax.set_xlabel("median step time (ms)")
    ax.set_ylabel("activation memory kept for backward (MiB)")
    ax.set_title(title)
    if curve_data:
        cx = fig.add_subplot(1, 2, 2)
        for i, (name, us) in enumerate(curve_data["us_per_op"].items()):
            cx.plot(curve_data["lengths"], us, marker=markers[i % len(markers)], label=name)
        cx.set_xscale("log", base=2)
        cx.set_xlabel("ops in the checkpointed region")
        cx.set_ylabel("us per op, forward+backward, 1 thread")
        cx.set_title(f"per-op cost vs region length ({curve_data['policy']})")
        cx.legend(fontsize="small")
    fig.savefig(path, bbox_inches="tight")


def _mark_front(ax: Axes, front: Sequence[tuple[float, float]]) -> None:
    """Ring the Pareto-optimal points and join them with a dashed staircase (what no other row beats on both)."""
    if not front:
        return
    xs, ys = zip(*sorted(front), strict=True)
    ax.scatter(xs, ys, s=220, facecolors="none", edgecolors="black", linewidths=1.2, zorder=2,
               label="Pareto front: no row is both faster and keeps less")
    ax.step(xs, ys, where="post", linestyle="--", color="black", linewidth=0.8, zorder=1)
