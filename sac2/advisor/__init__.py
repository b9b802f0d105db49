"""The advisor: ``sac2.advise`` (every checkpointing setup measured side by side on the user's model, and the one
that fits a memory target), its answer ``Advice``, ``python -m sac2 advise`` (``sac2.advisor.cli``), and the explain
report of one policy (``sac2.explain``). A tool: the library never imports it; ``import sac2`` loads it on first use
of one of its names."""

from sac2.advisor.advice import Advice
from sac2.advisor.candidates import Candidate, block_memory_budget, candidates_for
from sac2.advisor.report import Report, explain, plot_budgets
from sac2.advisor.runs import advise

__all__ = [
    "Advice", "Candidate", "advise", "block_memory_budget", "candidates_for", "Report", "explain", "plot_budgets",
]
