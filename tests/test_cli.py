"""Every misuse of the ``sac2`` command line ends in one line naming what is wrong, with exit code 2, before any
model is built; arguments that are right reach the bench unchanged."""

from __future__ import annotations

import contextlib
import io
import sys
from typing import Any

import pytest
import torch
from expecttest import assert_expected_inline

from sac2.__main__ import main
from sac2.bench import cli, models
from sac2.measure.step import Result

from helpers import cli_error

#: A bench command line that would run quickly, were the bench allowed to start.
BENCH = ["bench", "--config", "tiny", "--steps", "1", "--curve", ""]


def _no_model(*args: object, **kwargs: object) -> None:
    raise AssertionError("the bench built a model before its arguments were checked")


@pytest.fixture(autouse=True)
def _no_model_built(monkeypatch) -> None:
    """Every test here: building the bench's model fails the test (a misuse must end before one is built)."""
    monkeypatch.setattr(models.Transformer, "__init__", _no_model)


def _cuda(monkeypatch, built: bool, available: bool, count: int) -> None:
    """Make this torch look built with or without CUDA, with ``count`` GPUs visible (whatever the machine)."""
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: built)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: available)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


def test_no_command():
    assert_expected_inline(cli_error([]), """sac2: error: no command given; the commands are: bench, advise""")


def test_unknown_command():
    assert_expected_inline(
        cli_error(["benchmark"]), """sac2: error: unknown command 'benchmark'; the commands are: bench, advise"""
    )


def test_cuda_on_a_torch_built_without_cuda(monkeypatch):
    _cuda(monkeypatch, built=False, available=False, count=0)
    assert_expected_inline(
        cli_error([*BENCH, "--device", "cuda"]),
        """sac2 bench: error: argument --device: 'cuda' needs a CUDA build of torch; this one was built without CUDA""",
    )


def test_cuda_with_no_gpu_visible(monkeypatch):
    _cuda(monkeypatch, built=True, available=False, count=0)
    assert_expected_inline(
        cli_error([*BENCH, "--device", "cuda"]),
        """sac2 bench: error: argument --device: 'cuda' needs a GPU; torch sees none (torch.cuda.is_available() is False)""",  # noqa: E501
    )


def test_cuda_index_that_does_not_exist(monkeypatch):
    _cuda(monkeypatch, built=True, available=True, count=2)
    assert_expected_inline(
        cli_error([*BENCH, "--device", "cuda:7"]),
        """sac2 bench: error: argument --device: no device 'cuda:7'; the visible CUDA devices are cuda:0, cuda:1""",  # noqa: E501
    )


def test_unknown_device_string():
    assert_expected_inline(
        cli_error([*BENCH, "--device", "gpu"]),
        """sac2 bench: error: argument --device: 'gpu' is not a torch device (e.g. cpu, cuda, cuda:1)""",
    )


def test_device_the_bench_cannot_measure_memory_on():
    assert_expected_inline(
        cli_error([*BENCH, "--device", "mps"]),
        """sac2 bench: error: argument --device: the bench measures memory on cpu and cuda only, not on 'mps'""",
    )


def test_zero_steps():
    assert_expected_inline(
        cli_error([*BENCH, "--steps", "0"]),
        """sac2 bench: error: argument --steps: must be a positive integer, got '0'""",
    )


def test_curve_that_is_not_a_list_of_ints():
    assert_expected_inline(
        cli_error([*BENCH, "--curve", "16,x"]),
        """sac2 bench: error: argument --curve: must be positive integers separated by commas (e.g. 16,256), got '16,x'""",  # noqa: E501
    )


def test_curve_with_a_region_of_no_ops():
    assert_expected_inline(
        cli_error([*BENCH, "--curve", "0,16"]),
        """sac2 bench: error: argument --curve: must be positive integers separated by commas (e.g. 16,256), got '0,16'""",  # noqa: E501
    )


def test_zero_curve_repeat():
    assert_expected_inline(
        cli_error([*BENCH, "--curve-repeat", "0"]),
        """sac2 bench: error: argument --curve-repeat: must be a positive integer, got '0'""",
    )


def test_plot_without_matplotlib(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # importlib.util.find_spec("matplotlib") is None
    assert_expected_inline(
        cli_error([*BENCH, "--plot", f"{tmp_path}/out.png"]),
        """sac2 bench: error: --plot needs matplotlib: pip install 'sac2[plot]'""",
    )


def test_json_into_a_directory_that_does_not_exist(tmp_path):
    line = cli_error([*BENCH, "--json", f"{tmp_path}/missing/out.json"])
    assert_expected_inline(
        line.replace(str(tmp_path), "TMP"),
        """sac2 bench: error: argument --json: cannot write 'TMP/missing/out.json': directory 'TMP/missing' does not exist""",  # noqa: E501
    )


def test_plot_into_a_directory_that_does_not_exist(tmp_path):
    line = cli_error([*BENCH, "--plot", f"{tmp_path}/missing/out.png"])
    assert_expected_inline(
        line.replace(str(tmp_path), "TMP"),
        """sac2 bench: error: argument --plot: cannot write 'TMP/missing/out.png': directory 'TMP/missing' does not exist""",  # noqa: E501
    )


def test_json_onto_a_directory(tmp_path):
    line = cli_error([*BENCH, "--json", str(tmp_path)])
    assert_expected_inline(
        line.replace(str(tmp_path), "TMP"),
        """sac2 bench: error: argument --json: cannot write 'TMP': it is a directory""",
    )


def test_backend_that_torch_compile_does_not_have():
    assert_expected_inline(
        cli_error([*BENCH, "--compile", "--backend", "inductr"]),
        """sac2 bench: error: argument --backend: 'inductr' is not a torch.compile backend (see torch.compiler.list_backends(exclude_tags=None))""",  # noqa: E501
    )


def test_backend_without_compile():
    assert_expected_inline(
        cli_error([*BENCH, "--backend", "aot_eager"]),
        """sac2 bench: error: argument --backend: applies only with --compile""",
    )


def test_reach_the_job_unchanged(monkeypatch):
    _cuda(monkeypatch, built=True, available=True, count=2)
    calls = []
    result = [Result("none", "-", [1.0])]
    def run(*args: Any, **kwargs: Any) -> tuple[list[Result], list[Any]]:
        calls.append((args, kwargs))
        return result, []

    monkeypatch.setattr(cli, "run", run)
    with contextlib.redirect_stdout(io.StringIO()):
        code = main([*BENCH, "--device", "cuda:1", "--compile", "--backend", "aot_eager", "--curve-repeat", "2"])
    assert code == 0
    assert calls == [(("tiny", 1, "cuda:1"), {"compile": True, "backend": "aot_eager", "dtype": torch.float32})]


def test_dtype_reaches_the_job_as_a_torch_dtype(monkeypatch):
    calls = []

    def run(*args: Any, **kwargs: Any) -> tuple[list[Result], list[Any]]:
        calls.append(kwargs["dtype"])
        return [Result("none", "-", [1.0])], []

    monkeypatch.setattr(cli, "run", run)
    with contextlib.redirect_stdout(io.StringIO()) as out:
        assert main([*BENCH, "--dtype", "bfloat16"]) == 0
    assert calls == [torch.bfloat16]
    assert "config tiny, bfloat16, cpu" in out.getvalue().splitlines()[0]
