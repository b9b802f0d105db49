"""benchmarks/overhead.py runs end to end and reports sac2's share of stock SAC's overhead."""

import contextlib
import importlib.util
import io
import re
from pathlib import Path

from expecttest import TestCase

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "overhead.py"


def _run(*argv: str) -> str:
    spec = importlib.util.spec_from_file_location("overhead", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        module.main(list(argv))
    return out.getvalue()


class TestOverheadScript(TestCase):
    def test_prints_the_ratio_for_each_workload_and_policy(self):
        ratios = re.findall(r"ratio \(sac2 - full\)/\(stock - full\), (.+): -?\d+\.\d\d$", _run("--repeat", "1"), re.M)
        self.assertEqual(ratios, ["save nothing", "save list", "save nothing", "save list"])
