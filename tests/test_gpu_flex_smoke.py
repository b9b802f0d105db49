"""The flex-attention SAC benchmark's CPU smoke mode: every mode runs forward with flex compiled, and the table
lands in the JSON file (the GPU run itself is benchmarks/gpu_flex_sac.py without --smoke)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_flex_sac.py"


def test_smoke_runs_every_mode_with_compiled_flex_and_writes_the_table(tmp_path):
    spec = importlib.util.spec_from_file_location("gpu_flex_sac", BENCH)
    bench = sys.modules.setdefault("gpu_flex_sac", importlib.util.module_from_spec(spec))  # dataclasses need it
    spec.loader.exec_module(bench)
    out = tmp_path / "flex.json"
    bench.main(["--device", "cpu", "--smoke", "--json", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [(r["mode"], r["flex_compiled"], r["flex_reruns_per_step"]) for r in rows] == [
        (mode, True, None) for mode in bench.MODES
    ]
