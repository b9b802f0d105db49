"""The tests' oracle (``helpers.assert_same_as_without_checkpointing``) sees what it must: a different output, a
different gradient of an input or of a parameter, a gradient that reaches only one run; and passes equal runs."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import sac2

from helpers import assert_same_as_without_checkpointing, outputs_and_grads

X = torch.randn(4, 8, generator=torch.Generator().manual_seed(0), requires_grad=True)


def test_a_checkpointed_run_passes() -> None:
    assert_same_as_without_checkpointing(lambda m, x: sac2.checkpoint(m, x), nn.Linear(8, 8), X)


@pytest.mark.parametrize("wrong", [
    lambda m, x: m(x) + 1e-6,  # the output
    lambda m, x: m(x + (x - x.detach())),  # the same output; the input's gradient doubled
    lambda m, x: m(x) + (m.weight - m.weight.detach()).sum(),  # the same output; the weight's gradient moved
    lambda m, x: torch.nn.functional.linear(x, m.weight.detach(), m.bias),  # the same output; no weight gradient
], ids=["output", "input", "parameter", "unreached"])
def test_a_wrong_run_fails(wrong) -> None:
    with pytest.raises(AssertionError):
        assert_same_as_without_checkpointing(wrong, nn.Linear(8, 8), X)


def test_each_run_starts_from_fresh_leaves_and_no_parameter_gradient() -> None:
    m = nn.Linear(8, 8)
    first = outputs_and_grads(lambda m, x: m(x), m, X)
    second = outputs_and_grads(lambda m, x: m(x), m, X)  # would accumulate onto the first's .grad otherwise
    assert X.grad is None
    assert all(torch.equal(a, b) for a, b in zip(first[1], second[1], strict=True))
