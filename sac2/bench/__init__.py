"""``python -m sac2 bench``: every checkpointing mode trained side by side on a small llama-style model.

One module per idea: ``checkpoint_modes`` (the rows: which modes run, how), ``job`` (train them, time each step,
measure memory, check gradients), ``output`` (the table, the plot), ``cli`` (the command line, which checks every
argument first); beside them ``models`` (the models, embedded configs), ``memory`` (measured memory of a step) and
``length_curve`` (per-op cost against region length).
"""

from sac2.bench.checkpoint_modes import Row, rows
from sac2.bench.cli import main
from sac2.bench.job import COMPILE_BACKEND, Result, run
from sac2.bench.output import format_table

__all__ = ["Row", "Result", "rows", "run", "format_table", "main", "COMPILE_BACKEND"]
