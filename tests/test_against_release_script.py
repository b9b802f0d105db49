"""``benchmarks/against_release.py`` runs end to end on the bench's tiny model: 0.3's regions and this checkout's
side by side in one process, every row exact, the release's package gone afterwards. Timings are never asserted."""

from __future__ import annotations

import contextlib
import copyreg
import importlib.util
import io
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import sac2

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "against_release.py"
ROWS = ["ref regions attention", "now regions attention", "now regions attention, inputs kept",
        "now regions attention, no in-place check", "ref regions matmuls", "now regions matmuls",
        "now regions matmuls, inputs kept", "now regions matmuls, no in-place check"]


def _has_commit(commit: str) -> bool:
    probe = subprocess.run(["git", "-C", str(ROOT), "cat-file", "-e", f"{commit}^{{commit}}"], capture_output=True)
    return probe.returncode == 0


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("against_release", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)


@pytest.fixture(scope="module")
def run(script):
    if not _has_commit(script.RELEASE):
        pytest.skip(f"this clone lacks {script.RELEASE} (0.3.0): a shallow clone")
    reducers = dict(copyreg.dispatch_table)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        script.main(["--models", "tiny", "--rounds", "1", "--steps", "1"])
    return out.getvalue(), reducers


def _rows(out: str) -> dict[str, tuple[float, str]]:
    """Row name -> (kept MiB, grads equal)."""
    found = re.findall(r"^  (.+?) +\d+\.\d\d +\d+\.\d{3}x +(\d+\.\d\d)  (yes|NO)$", out, re.M)
    return {name: (float(kept), equal) for name, kept, equal in found}


def test_prints_every_row_with_gradients_equal_to_no_checkpointing(run):
    rows = _rows(run[0])
    assert list(rows) == ROWS
    assert {equal for _, equal in rows.values()} == {"yes"}


def test_this_checkouts_default_regions_keep_less_than_the_releases(run):
    rows = _rows(run[0])
    assert rows["now regions matmuls"][0] < rows["ref regions matmuls"][0]


def test_the_unchecked_row_keeps_what_the_checked_one_keeps(run):
    rows = _rows(run[0])
    assert rows["now regions attention, no in-place check"] == rows["now regions attention"]


def _write_into_a_saved_tensor() -> None:
    def f(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = x * 2
        return torch.sin(h), h  # sin saves h

    out, h = sac2.checkpoint(f, torch.randn(3, requires_grad=True), use_reentrant=False)
    with torch.no_grad():
        h.add_(1)
    out.sum().backward()


def test_the_unchecked_row_runs_without_the_in_place_check_and_puts_it_back(script):
    with script._without_inplace_check(True):
        _write_into_a_saved_tensor()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        _write_into_a_saved_tensor()


def test_leaves_no_release_module_or_pickle_reducer_behind(run):
    _, reducers = run
    assert not [m for m in sys.modules if m.startswith("sac2_ref")]
    assert dict(copyreg.dispatch_table) == reducers


class GroupedExperts(nn.Module):
    pass


class RoutedExperts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.experts = GroupedExperts()


def test_experts_row_names_the_experts_classes_the_release_made_regions(script):
    # As 0.3's "experts": class names ending in Experts, the inner ones where experts hold experts.
    model = nn.Sequential(RoutedExperts(), nn.Linear(2, 2), nn.Sequential(GroupedExperts()))
    assert script._experts_classes(model) == [GroupedExperts]
    assert script._experts_classes(nn.Linear(2, 2)) == []
