"""The ```python blocks of docs/distributed.md run as written on 2 gloo ranks (one namespace, in order); the
blocks' own asserts check that sac2 ran (``sac2.forward_count()``) and that the DCP round trip kept every weight."""

from __future__ import annotations

from .launch import run_ranks
from helpers import python_blocks


def test_every_python_block_runs_on_two_ranks(tmp_path):
    n = len(python_blocks("docs/distributed.md"))
    assert n >= 6, "docs/distributed.md lost a runnable example"
    ranks = run_ranks("docs_worker.py", timeout_s=180, cwd=str(tmp_path))
    assert ranks == [{"rank": 0, "blocks": n}, {"rank": 1, "blocks": n}]
