"""``python -m sac2 bench``: every checkpointing mode trained side by side on a small llama-style model.

One module per idea: ``checkpoint_modes`` (the rows: which modes run, how), ``job`` (train them side by side),
``output`` (the table, the plot), ``cli`` (the command line, which checks every argument first); beside them
``models`` (the models, embedded configs) and ``length_curve`` (per-op cost against region length). How a step is
measured (time, memory, gradients against the reference) is ``sac2.measure``'s, which the advisor shares.
"""

from sac2.bench.checkpoint_modes import Row, rows
from sac2.bench.cli import main
from sac2.bench.job import COMPILE_BACKEND, run
from sac2.bench.output import format_table
from sac2.measure.step import Result

__all__ = ["Row", "Result", "rows", "run", "format_table", "main", "COMPILE_BACKEND"]
