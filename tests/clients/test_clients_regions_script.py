"""``benchmarks/clients_regions.py --smoke`` runs end to end: a table per client model with every row, exact
gradients from sac2's rows, the rows that dominate stock SAC, the JSON and the plot. Timings are never asserted."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import re
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("torchtitan")

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "clients_regions.py"
ROWS = ["none", "full AC", "stock SAC", "sac2 op list", "sac2 regions attention", "sac2 regions matmuls",
        "sac2 regions matmuls, inputs kept"]


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    spec = importlib.util.spec_from_file_location("clients_regions", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    out = tmp_path_factory.mktemp("clients_regions")
    argv = ["--smoke", "--json", str(out / "out.json")]
    if importlib.util.find_spec("matplotlib") is not None:
        argv += ["--plot", str(out / "out.png")]
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        module.main(argv)
    return module, stdout.getvalue(), json.loads((out / "out.json").read_text()), out / "out.png"


def test_prints_a_table_per_model_with_every_row(smoke):
    module, text, _, _ = smoke
    rows = ROWS + (["torch_remat attention", "torch_remat matmuls"] if module.remat_available() else [])
    for model in module.MODELS:
        assert re.search(rf"^{model} \(.*median of 1 rounds$", text, re.M), model
    names = re.findall(r"^  (\S.*?) +\d+\.\d\d +\d+\.\d\dx +\d+\.\d\d  (?:yes|NO)$", text, re.M)
    assert names == rows * len(module.MODELS)
    assert len(re.findall(r"^  Pareto-dominate stock SAC \(step <= \d+\.\d\d ms and kept <= stock's\): .+$",
                          text, re.M)) == len(module.MODELS)


def test_sac2_rows_have_exact_gradients(smoke):
    data = smoke[2]
    for model in data["models"].values():
        assert {r["name"]: r["grads_equal"] for r in model["rows"] if r["name"].startswith("sac2")} == {
            name: True for name in ROWS if name.startswith("sac2")}


def test_json_holds_times_and_memory(smoke):
    data = smoke[2]
    assert list(data["models"]) == list(smoke[0].MODELS)
    for model in data["models"].values():
        for row in model["rows"]:
            assert len(row["times_s"]) == 1 and row["median_ms"] > 0 and row["kept_bytes"] > 0


def test_the_inputs_kept_row_keeps_what_the_default_rebuilds(smoke):
    for model in smoke[2]["models"].values():
        kept = {r["name"]: r["kept_bytes"] for r in model["rows"]}
        assert kept["sac2 regions matmuls, inputs kept"] > kept["sac2 regions matmuls"]


def test_writes_the_plot(smoke):
    pytest.importorskip("matplotlib")
    assert smoke[3].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
