"""``sac2 bench``: a very short run writes the table, the JSON and the plot; optional policies are discovered."""

import contextlib
import io
import json

import pytest
import torch
from expecttest import TestCase

from sac2 import bench
from sac2.__main__ import main as cli_main
from sac2.models import CONFIGS, Transformer


@pytest.fixture(scope="module")
def short_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        code = bench.main(["--config", "tiny", "--steps", "2", "--json", str(out / "out.json"),
                           "--plot", str(out / "out.png")])
    return code, stdout.getvalue(), json.loads((out / "out.json").read_text()), out / "out.png"


@pytest.fixture
def _attach(request, short_run):
    request.instance.result = short_run


@pytest.mark.usefixtures("_attach")
class TestShortRun(TestCase):
    def test_exits_zero(self):
        self.assertEqual(self.result[0], 0)

    def test_table_has_a_row_per_mode_under_its_header(self):
        lines = self.result[1].splitlines()
        self.assertEqual(lines[1].split()[:8], ["mode", "step", "ms", "vs", "none", "kept", "MiB", "peak"])
        names = [m["name"] for m in self.result[2]["modes"]]
        for name, line in zip(names, lines[2:]):
            self.assertTrue(line.startswith(name), line)

    def test_runs_the_four_required_modes_first(self):
        names = [m["name"] for m in self.result[2]["modes"]]
        self.assertEqual(names[:4], ["none", "full", "stock SAC", "sac2 SAC"])

    def test_json_describes_the_run(self):
        data = self.result[2]
        self.assertEqual(data["config"]["name"], "tiny")
        self.assertEqual(data["config"]["dim"], CONFIGS["tiny"].dim)
        self.assertEqual((data["device"], data["steps"], data["torch"]), ("cpu", 2, torch.__version__))

    def test_json_rows_hold_times_memory_and_equality(self):
        for row in self.result[2]["modes"]:
            self.assertEqual(len(row["step_s"]), 2)
            self.assertAlmostEqual(row["median_s"], sum(row["step_s"]) / 2)
            self.assertGreater(row["kept_bytes"], 0)
            self.assertGreaterEqual(row["peak_bytes"], row["kept_bytes"])
            self.assertIsInstance(row["ratio_to_none"], float)

    def test_every_mode_matches_no_checkpointing_bit_for_bit(self):
        self.assertEqual({m["name"]: m["equal"] for m in self.result[2]["modes"] if not m["equal"]}, {})

    def test_full_checkpointing_keeps_less_than_none(self):
        rows = {m["name"]: m for m in self.result[2]["modes"]}
        self.assertLess(rows["full"]["kept_bytes"], rows["none"]["kept_bytes"])

    def test_writes_the_plot(self):
        self.assertEqual(self.result[3].read_bytes()[:8], b"\x89PNG\r\n\x1a\n")


class TestPolicyDiscovery(TestCase):
    def test_a_policy_whose_module_is_missing_is_skipped_with_a_note(self):
        registry = {"sac2 missing": ("sac2.policies.not_there", "policy", lambda make, model, x: make())}
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(bench, "SAC2_POLICIES", registry)
            notes = []
            modes = bench._modes(Transformer(CONFIGS["tiny"]), torch.zeros(1), notes)
        self.assertEqual([name for name, _, _ in modes], ["none", "full", "stock SAC", "sac2 SAC"])
        self.assertExpectedInline(
            "\n".join(notes), """skipped 'sac2 missing': No module named 'sac2.policies.not_there'"""
        )


class TestCommandLine(TestCase):
    def test_bench_subcommand_reaches_the_bench_parser(self):
        stdout = io.StringIO()
        with contextlib.redirect_stdout(stdout), self.assertRaises(SystemExit) as exit:
            cli_main(["bench", "--help"])
        self.assertEqual(exit.exception.code, 0)
        self.assertIn("usage: sac2 bench", stdout.getvalue())


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


class TestProgressBar(TestCase):
    def test_draws_on_a_terminal(self):
        err = _Terminal()
        with contextlib.redirect_stderr(err):
            progress = bench._Progress(2)
            progress.step()
            progress.step()
        self.assertExpectedInline(
            err.getvalue().replace("\r", "|"),
            """\
|[###############...............] 1/2|[##############################] 2/2
""",
        )

    def test_stays_silent_when_stderr_is_not_a_terminal(self):
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            bench._Progress(1).step()
        self.assertEqual(err.getvalue(), "")
