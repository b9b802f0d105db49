"""benchmarks/overhead.py runs end to end and reports sac2's share of stock SAC's overhead, the do-nothing-mode
floor beside it, and the per-op cost of a short and a long region."""

import contextlib
import importlib.util
import io
import re
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "overhead.py"


def _run(*argv: str) -> str:
    spec = importlib.util.spec_from_file_location("overhead", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        module.main(list(argv))
    return out.getvalue()


@pytest.fixture(scope="module")
def out() -> str:
    """The script's output, printed once for the module."""
    return _run("--repeat", "1", "--lengths", "4,16")


def test_prints_the_ratio_and_the_floor_for_each_workload_and_policy(out):
    pattern = (r"ratio \(sac2 - full\)/\(stock - full\), (.+): -?\d+\.\d\d   "
               r"floor \(do-nothing - full\)/\(stock - full\): -?\d+\.\d\d$")
    assert re.findall(pattern, out, re.M) == ["save nothing", "save list"] * 2


def test_times_the_do_nothing_pair(out):
    assert len(re.findall(r"^  floor \(2 do-nothing modes\) +\d+\.\d\d us/op$", out, re.M)) == 2


def test_prints_short_and_long_region_side_by_side_and_the_length_ratio(out):
    row = r"^ +(\d+)" + r" +\d+\.\d\d" * 4 + "$"
    assert re.findall(row, out, re.M) == ["4", "16"]
    ratio = r"length ratio sac2\(16\)/sac2\(4\): \d+\.\d\d \(target <= 1\.15; stock: \d+\.\d\d\)"
    assert re.search(ratio, out)
