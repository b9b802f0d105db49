"""``sac2.measure.determinism``: the bench and ``sac2.advise`` switch torch's deterministic kernels on for CUDA runs
(without them attention's backward differs from run to run, so no bitwise check could hold) and leave every
setting as they found it. The switch reads only the device type, so it is checked here without a GPU."""

from __future__ import annotations

import os

import pytest
import torch

from sac2.measure.determinism import CUBLAS_WORKSPACE, deterministic_kernels

CUDA = torch.device("cuda")


@pytest.fixture(autouse=True)
def _restore_torch_settings(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    on, warn_only = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    yield
    torch.use_deterministic_algorithms(on, warn_only=warn_only)


def test_on_cuda_deterministic_algorithms_are_strict_inside_and_off_again_after():
    with deterministic_kernels(CUDA) as switched:
        inside = (switched, torch.are_deterministic_algorithms_enabled(),
                  torch.is_deterministic_algorithms_warn_only_enabled(), os.environ.get("CUBLAS_WORKSPACE_CONFIG"))
    assert inside == (True, True, False, CUBLAS_WORKSPACE)
    assert not torch.are_deterministic_algorithms_enabled()
    assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ


def test_a_users_own_settings_come_back_after_an_error():
    torch.use_deterministic_algorithms(True, warn_only=True)
    os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":16:8"
    seen = []

    def fail() -> None:
        seen.append(os.environ["CUBLAS_WORKSPACE_CONFIG"])
        raise RuntimeError("inside")

    with pytest.raises(RuntimeError, match="inside"), deterministic_kernels(CUDA):
        fail()
    assert seen == [":16:8"]  # the user's choice was kept, not overwritten
    assert torch.are_deterministic_algorithms_enabled()
    assert torch.is_deterministic_algorithms_warn_only_enabled()
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"


def test_on_cpu_nothing_changes():
    with deterministic_kernels(torch.device("cpu")) as switched:
        assert (switched, torch.are_deterministic_algorithms_enabled()) == (False, False)
    assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ
