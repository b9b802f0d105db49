"""The package installs cleanly: torch is its only requirement, one version, typed, licensed, torch's names."""

import importlib.metadata
import pathlib
import re
import subprocess
import sys

import pytest
import torch.distributed.algorithms._checkpoint.checkpoint_wrapper as torch_cw

import sac2

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_sac2_and_every_policy_but_a_budget_run_without_numpy():
    code = """
import sys
sys.modules["numpy"] = None  # import numpy raises ImportError
import functools, torch, sac2
block = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 4))
p = sac2.policies
for policy in (p.llm(), p.torchtitan(block), p.every_other_matmul(), p.recompute_linears(block, ["0"]),
               p.compose(p.every_other_matmul(), p.llm()), [torch.ops.aten.addmm.default]):
    x = torch.randn(2, 4, requires_grad=True)
    context_fn = functools.partial(sac2.create_selective_checkpoint_contexts, policy)
    sac2.checkpoint(block, x, context_fn=context_fn).sum().backward()
print("ok")
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_version_has_one_source():
    project = _pyproject()["project"]
    assert "version" not in project and "version" in project["dynamic"]
    assert _pyproject()["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "sac2.__version__"}
    assert sac2.__version__ == importlib.metadata.version("sac2")


def test_newest_changelog_section_is_this_version():
    headings = [line for line in (ROOT / "CHANGELOG.md").read_text().splitlines() if line.startswith("## ")]
    assert headings, "CHANGELOG.md has no '## VERSION' section"
    assert headings[0].split()[1] == sac2.__version__, f"newest section {headings[0]!r}, sac2 {sac2.__version__}"


def test_ships_py_typed():
    assert (ROOT / "sac2" / "py.typed").is_file()
    assert "py.typed" in _pyproject()["tool"]["setuptools"]["package-data"]["sac2"]


def test_license_is_bsd_3_clause():
    text = (ROOT / "LICENSE").read_text()
    assert text.startswith("BSD 3-Clause License\n\nCopyright (c) 2026, the sac2 authors\n")
    assert _pyproject()["project"]["license"] == "BSD-3-Clause"


def test_requires_only_torch_and_pins_its_extras():
    project = _pyproject()["project"]
    assert project["dependencies"] == ["torch>=2.13,<2.16"]
    extras = project["optional-dependencies"]
    assert extras["remat"] == ["torch-remat==0.2.2"]
    assert extras["lint"] == ["ruff==0.17.5", "mypy==2.4.1"]
    assert {"plot", "test"} <= set(extras)


def test_the_lint_extra_pins_the_linters_ci_runs():
    path = ROOT / ".ci" / "lint.sh"
    if not path.is_file():
        pytest.skip("the sdist carries no .ci/")
    script = path.read_text()
    ruff, mypy = (re.search(rf"^{name}=(\S+)$", script, re.M).group(1) for name in ("RUFF_VERSION", "MYPY_VERSION"))
    assert _pyproject()["project"]["optional-dependencies"]["lint"] == [f"ruff=={ruff}", f"mypy=={mypy}"]


def test_every_public_name_of_torchs_checkpoint_wrapper_module_is_in_sac2():
    names = [
        name
        for name, value in vars(torch_cw).items()
        if not name.startswith("_") and getattr(value, "__module__", None) == torch_cw.__name__
    ]
    assert len(names) >= 7  # ActivationWrapper, CheckpointImpl, CheckpointWrapper, OffloadWrapper, three functions
    assert [name for name in names if name not in sac2.__all__] == []
