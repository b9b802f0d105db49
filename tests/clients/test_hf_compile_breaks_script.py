"""``benchmarks/hf_compile_breaks.py`` runs end to end: a row per route asked for, read from dynamo's counters."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "hf_compile_breaks.py"


def test_a_sac2_route_row_reads_no_graph_break_and_the_gradients_of_no_checkpointing(capsys) -> None:
    spec = importlib.util.spec_from_file_location("hf_compile_breaks", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    (row,) = module.main(["--routes", "sac2 apply_ac full"])
    assert (row["name"], row["breaks"], row["graphs"], row["fallbacks"], row["close"]) == (
        "sac2 apply_ac full", 0, 1, 0, True)
    assert "sac2 apply_ac full" in capsys.readouterr().out
