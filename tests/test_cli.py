"""Every misuse of the ``sac2`` command line ends in one line naming what is wrong, with exit code 2, before any
model is built; arguments that are right reach the bench unchanged."""

from __future__ import annotations

import contextlib
import io
import sys
import tempfile
from typing import Any

import pytest
import torch
from expecttest import TestCase

from sac2.__main__ import main
from sac2.bench import cli, models
from sac2.measure.step import Result

#: A bench command line that would run quickly, were the bench allowed to start.
BENCH = ["bench", "--config", "tiny", "--steps", "1", "--curve", ""]


def _no_model(*args: object, **kwargs: object) -> None:
    raise AssertionError("the bench built a model before its arguments were checked")


class CommandLineTestCase(TestCase):
    def setUp(self) -> None:
        self.mp = pytest.MonkeyPatch()
        self.addCleanup(self.mp.undo)
        self.mp.setattr(models.Transformer, "__init__", _no_model)

    def cuda(self, built: bool, available: bool, count: int) -> None:
        """Make this torch look built with or without CUDA, with ``count`` GPUs visible (whatever the machine)."""
        self.mp.setattr(torch.backends.cuda, "is_built", lambda: built)
        self.mp.setattr(torch.cuda, "is_available", lambda: available)
        self.mp.setattr(torch.cuda, "device_count", lambda: count)

    def misuse(self, argv: list[str]) -> str:
        """Run the command line, which must exit 2 after its usage line; return the last line it wrote."""
        err = io.StringIO()
        with contextlib.redirect_stderr(err), self.assertRaises(SystemExit) as exit:
            main(argv)
        self.assertEqual(exit.exception.code, 2, err.getvalue())
        lines = err.getvalue().splitlines()
        self.assertTrue(lines[0].startswith("usage: sac2"), err.getvalue())
        self.assertEqual([line for line in lines if "error:" in line], lines[-1:], err.getvalue())
        return lines[-1]


class TestCommand(CommandLineTestCase):
    def test_no_command(self):
        self.assertExpectedInline(self.misuse([]), """sac2: error: no command given; the commands are: bench, advise""")

    def test_unknown_command(self):
        self.assertExpectedInline(
            self.misuse(["benchmark"]), """sac2: error: unknown command 'benchmark'; the commands are: bench, advise"""
        )


class TestDevice(CommandLineTestCase):
    def test_cuda_on_a_torch_built_without_cuda(self):
        self.cuda(built=False, available=False, count=0)
        self.assertExpectedInline(
            self.misuse([*BENCH, "--device", "cuda"]),
            """sac2 bench: error: argument --device: 'cuda' needs a CUDA build of torch; this one was built without CUDA""",  # noqa: E501
        )

    def test_cuda_with_no_gpu_visible(self):
        self.cuda(built=True, available=False, count=0)
        self.assertExpectedInline(
            self.misuse([*BENCH, "--device", "cuda"]),
            """sac2 bench: error: argument --device: 'cuda' needs a GPU; torch sees none (torch.cuda.is_available() is False)""",  # noqa: E501
        )

    def test_cuda_index_that_does_not_exist(self):
        self.cuda(built=True, available=True, count=2)
        self.assertExpectedInline(
            self.misuse([*BENCH, "--device", "cuda:7"]),
            """sac2 bench: error: argument --device: no device 'cuda:7'; the visible CUDA devices are cuda:0, cuda:1""",  # noqa: E501
        )

    def test_unknown_device_string(self):
        self.assertExpectedInline(
            self.misuse([*BENCH, "--device", "gpu"]),
            """sac2 bench: error: argument --device: 'gpu' is not a torch device (e.g. cpu, cuda, cuda:1)""",
        )

    def test_device_the_bench_cannot_measure_memory_on(self):
        self.assertExpectedInline(
            self.misuse([*BENCH, "--device", "mps"]),
            """sac2 bench: error: argument --device: the bench measures memory on cpu and cuda only, not on 'mps'""",
        )


class TestCounts(CommandLineTestCase):
    def test_zero_steps(self):
        self.assertExpectedInline(
            self.misuse([*BENCH, "--steps", "0"]),
            """sac2 bench: error: argument --steps: must be a positive integer, got '0'""",
        )

    def test_curve_that_is_not_a_list_of_ints(self):
        self.assertExpectedInline(
            self.misuse([*BENCH, "--curve", "16,x"]),
            """sac2 bench: error: argument --curve: must be positive integers separated by commas (e.g. 16,256), got '16,x'""",  # noqa: E501
        )

    def test_curve_with_a_region_of_no_ops(self):
        self.assertExpectedInline(
            self.misuse([*BENCH, "--curve", "0,16"]),
            """sac2 bench: error: argument --curve: must be positive integers separated by commas (e.g. 16,256), got '0,16'""",  # noqa: E501
        )

    def test_zero_curve_repeat(self):
        self.assertExpectedInline(
            self.misuse([*BENCH, "--curve-repeat", "0"]),
            """sac2 bench: error: argument --curve-repeat: must be a positive integer, got '0'""",
        )


class TestOutputs(CommandLineTestCase):
    def setUp(self) -> None:
        super().setUp()
        tmp = tempfile.TemporaryDirectory()
        self.addCleanup(tmp.cleanup)
        self.tmp = tmp.name

    def test_plot_without_matplotlib(self):
        self.mp.setitem(sys.modules, "matplotlib", None)  # importlib.util.find_spec("matplotlib") is None
        self.assertExpectedInline(
            self.misuse([*BENCH, "--plot", f"{self.tmp}/out.png"]),
            """sac2 bench: error: --plot needs matplotlib: pip install 'sac2[plot]'""",
        )

    def test_json_into_a_directory_that_does_not_exist(self):
        line = self.misuse([*BENCH, "--json", f"{self.tmp}/missing/out.json"])
        self.assertExpectedInline(
            line.replace(self.tmp, "TMP"),
            """sac2 bench: error: argument --json: cannot write 'TMP/missing/out.json': directory 'TMP/missing' does not exist""",  # noqa: E501
        )

    def test_plot_into_a_directory_that_does_not_exist(self):
        line = self.misuse([*BENCH, "--plot", f"{self.tmp}/missing/out.png"])
        self.assertExpectedInline(
            line.replace(self.tmp, "TMP"),
            """sac2 bench: error: argument --plot: cannot write 'TMP/missing/out.png': directory 'TMP/missing' does not exist""",  # noqa: E501
        )

    def test_json_onto_a_directory(self):
        line = self.misuse([*BENCH, "--json", self.tmp])
        self.assertExpectedInline(
            line.replace(self.tmp, "TMP"),
            """sac2 bench: error: argument --json: cannot write 'TMP': it is a directory""",
        )


class TestBackend(CommandLineTestCase):
    def test_backend_that_torch_compile_does_not_have(self):
        self.assertExpectedInline(
            self.misuse([*BENCH, "--compile", "--backend", "inductr"]),
            """sac2 bench: error: argument --backend: 'inductr' is not a torch.compile backend (see torch.compiler.list_backends(exclude_tags=None))""",  # noqa: E501
        )

    def test_backend_without_compile(self):
        self.assertExpectedInline(
            self.misuse([*BENCH, "--backend", "aot_eager"]),
            """sac2 bench: error: argument --backend: applies only with --compile""",
        )


class TestArgumentsThatAreRight(CommandLineTestCase):
    def test_reach_the_job_unchanged(self):
        self.cuda(built=True, available=True, count=2)
        calls = []
        result = [Result("none", "-", [1.0])]
        def run(*args: Any, **kwargs: Any) -> tuple[list[Result], list[Any]]:
            calls.append((args, kwargs))
            return result, []

        self.mp.setattr(cli, "run", run)
        with contextlib.redirect_stdout(io.StringIO()):
            code = main([*BENCH, "--device", "cuda:1", "--compile", "--backend", "aot_eager", "--curve-repeat", "2"])
        self.assertEqual(code, 0)
        self.assertEqual(calls, [(("tiny", 1, "cuda:1"), {"compile": True, "backend": "aot_eager",
                                                         "dtype": torch.float32})])

    def test_dtype_reaches_the_job_as_a_torch_dtype(self):
        calls = []

        def run(*args: Any, **kwargs: Any) -> tuple[list[Result], list[Any]]:
            calls.append(kwargs["dtype"])
            return [Result("none", "-", [1.0])], []

        self.mp.setattr(cli, "run", run)
        with contextlib.redirect_stdout(io.StringIO()) as out:
            self.assertEqual(main([*BENCH, "--dtype", "bfloat16"]), 0)
        self.assertEqual(calls, [torch.bfloat16])
        self.assertIn("config tiny, bfloat16, cpu", out.getvalue().splitlines()[0])
