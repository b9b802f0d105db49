"""benchmarks/frame.py runs end to end (``--smoke``): every row on both workloads, gradients bitwise those of no
checkpointing, the sac2/torch ratio of each pair, and the same numbers in ``--json``."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import re
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "frame.py"
ROWS = [
    "none", "forward alone", "torch full AC", "torch reentrant full AC", "sac2 full AC", "stock SAC",
    "sac2 op-list SAC", "sac2 op-list SAC, torch frame", "sac2 regions SAC",
]
PAIRS = [
    "full AC: sac2 frame / torch non-reentrant", "full AC: sac2 frame / torch reentrant", "op list: sac2 / stock SAC",
    "op list: sac2 on torch's frame / stock SAC", "op list: sac2 frame / torch frame (same modes)",
    "regions: sac2 regions / torch full AC",
]


def _load():
    spec = importlib.util.spec_from_file_location("frame_benchmark", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict, bool]:
    module = _load()
    path = tmp_path_factory.mktemp("frame") / "frame.json"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        module.main(["--smoke", "--json", str(path)])
    return out.getvalue(), json.loads(path.read_text()), module.remat_available()


def _rows(text: str) -> list[tuple[str, str]]:
    """(mode, same-grads column) of each table row."""
    row = r"^  (\S.*?) +\d+\.\d\d +\d+% +\d+\.\d\d +(?:-?\d+\.\d\d|-)  (yes|NO|-)(?:  \(target <= \d\.\d\d\))?$"
    return re.findall(row, text, re.M)


def test_prints_every_row_for_both_workloads(run):
    text, _, remat = run
    expected = ROWS + (["torch_remat"] if remat else [])
    assert [mode for mode, _ in _rows(text)] == expected * 2
    assert re.findall(r"^(cpu-bound|small): ", text, re.M) == ["cpu-bound", "small"]


def test_every_mode_gets_the_gradients_of_no_checkpointing(run):
    assert {same for mode, same in _rows(run[0]) if mode != "forward alone"} == {"yes"}


def test_prints_each_pairs_ratio(run):
    text, _, remat = run
    expected = PAIRS + (["regions: sac2 regions / torch_remat"] if remat else [])
    pairs = re.findall(r"^  ratio (.+): \d+\.\d\d(?:  \(target <= \d\.\d\d\))?$", text, re.M)
    assert pairs == expected * 2


def test_json_holds_the_printed_medians(run):
    text, data, _ = run
    for workload in data["workloads"].values():
        assert set(workload["ms"]) == {mode for mode, _ in _rows(text)}
        assert workload["rows"]["none"]["ratio_to_none"] == 1.0
        assert workload["rounds"] == 1
