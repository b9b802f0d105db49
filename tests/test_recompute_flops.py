"""What each policy recomputes, counted in FLOPs by torch's ``FlopCounterMode`` over the backward.

A block of three bias-free Linears on ``N`` rows: ``first`` and ``mid`` map 256 -> 256 (one unit of matmul FLOPs
each in forward), ``last`` maps 256 -> 512 (two units). Without checkpointing the backward costs 8 units (each
Linear's two gradient matmuls); every recomputed matmul adds its forward's units. Early stop is off, so full AC
recomputes all 4 units. The figures are the ones torchtitan's own AC test expects of its policies.
"""

from __future__ import annotations

from typing import Callable

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

import sac2

from helpers import contexts

N = 64
UNIT = 2 * N * 256 * 256  # the FLOPs of one 256 -> 256 matmul on N rows


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(256, 256, bias=False)
        self.mid = nn.Linear(256, 256, bias=False)
        self.last = nn.Linear(256, 512, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last(self.mid(self.first(x)))


def _backward_units(run: Callable[[_Block, torch.Tensor], torch.Tensor]) -> float:
    block = _Block()
    out = run(block, torch.randn(N, 256, requires_grad=True)).sum()
    with FlopCounterMode(display=False) as counter:
        out.backward()
    return counter.get_total_flops() / UNIT


def _selective(policy: Callable[[_Block], object]) -> Callable[[_Block, torch.Tensor], torch.Tensor]:
    def run(block: _Block, x: torch.Tensor) -> torch.Tensor:
        return sac2.checkpoint(block, x, use_reentrant=False, early_stop=False, context_fn=contexts(policy(block)))

    return run


def test_no_checkpointing_costs_eight_units_of_backward():
    assert _backward_units(lambda block, x: block(x)) == 8


def test_full_ac_recomputes_the_whole_forward():
    assert _backward_units(lambda block, x: sac2.checkpoint(block, x, use_reentrant=False, early_stop=False)) == 12


@pytest.mark.parametrize(
    ("policy", "units"),
    [
        pytest.param(lambda block: sac2.policies.torchtitan(block, ()), 9, id="torchtitan: every second mm"),
        pytest.param(lambda _block: sac2.policies.every_other_matmul(), 9, id="every_other_matmul"),
        # first's shape is mid's too: both are recomputed and not counted, so last is the first mm counted
        pytest.param(lambda block: sac2.policies.torchtitan(block, ["first"]), 10, id="torchtitan: force first"),
        pytest.param(lambda block: sac2.policies.torchtitan(block, ["last"]), 11, id="torchtitan: force last"),
        pytest.param(lambda block: sac2.policies.recompute_linears(block, ["last"]), 12, id="recompute_linears"),
        pytest.param(lambda _block: sac2.policies.llm(), 8, id="llm: every matmul saved"),
    ],
)
def test_a_policy_adds_the_flops_of_the_matmuls_it_recomputes(policy, units):
    assert _backward_units(_selective(policy)) == units
