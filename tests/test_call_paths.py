"""How far one saved call travels inside sac2 in forward: a Linear saved as a region (``apply_ac(mode="regions")``,
the path meant to cost nothing: no dispatch mode) crosses fewer sac2 modules than the same Linear's matmul saved by
the dispatch modes (``apply_ac(mode="selective")``, ``llm()``). Counted with a profiling hook that collects the
module of every sac2 function entered while the Linear runs, on a second step (caches warm, as in training)."""

from __future__ import annotations

import sys
from types import FrameType
from typing import Any, Callable

import torch
from torch import nn

import sac2


def modules_entered(call: Callable[[], Any]) -> list[str]:
    """The sac2 modules whose functions run during ``call()``, in the order first entered."""
    entered: list[str] = []

    def profile(frame: FrameType, event: str, _arg: object) -> None:
        name = frame.f_globals.get("__name__", "")
        if event == "call" and name.split(".")[0] == "sac2" and name not in entered:
            entered.append(name)

    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    return entered


class _Block(nn.Module):
    """sin, a Linear, cos; while ``measuring``, the first run of the Linear notes the sac2 modules it entered (later
    runs are recompute's)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.measuring, self.path = False, list[str]()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.sin()
        if not self.measuring:
            return self.proj(y).cos()
        self.measuring = False
        out: list[torch.Tensor] = []
        self.path = modules_entered(lambda: out.append(self.proj(y)))
        return out[0].cos()


def path_of_a_saved_linear(**apply_ac: Any) -> list[str]:
    block = _Block()
    model = nn.Module()
    model.layers = nn.ModuleList([block])
    sac2.apply_ac(model, **apply_ac)
    for step in range(2):
        block.measuring = step == 1
        model.layers[0](torch.randn(4, 8, requires_grad=True)).sum().backward()
    return block.path


def test_a_linear_saved_as_a_region_crosses_fewer_sac2_modules_than_its_matmul_saved_by_the_modes() -> None:
    region = path_of_a_saved_linear(mode="regions", save=["linear"])
    op = path_of_a_saved_linear(mode="selective")
    assert "sac2.modes.forward" in op and "sac2.record.regions" in region  # each path is the one meant
    assert len(region) < len(op), f"region call: {region}\nsaved op: {op}"


def test_the_path_count_sees_every_sac2_module_entered() -> None:
    a, b = sac2.Region("a"), sac2.Region("a")
    assert modules_entered(lambda: a == b) == ["sac2.core.keys"]  # Region.__eq__
