"""Policies, ``context_fn``s and wrapped models pickled by sac2 0.4 load in this version and behave the same.

``tests/data/sac2-0.4-pickles.pt`` was written by 0.4's code (commit 8c87067, the module layout before 0.5's
folders) with ``torch.save``: six policies (``llm()``, ``every_other_matmul()``, ``compose`` of
``recompute_linears`` and ``llm()``, ``torchtitan``, a ``SaveList`` of ops and a region, a ``memory_budget``) with
their answers to one recorded forward of ``helpers.Block(16, heads=2)``, two ``context_fn`` partials, and five
``nn.Sequential``s of ``helpers.Block``s wrapped by ``apply_ac`` (selective, full, regions), ``checkpoint_wrapper``
with ``checkpoint_module``, and ``offload_wrapper``, with the output, the gradients and the checkpointed forwards
0.4 counted for one step on a fixed input. The pickles name 0.4's module paths (``sac2.answers``,
``sac2.wrappers``, ...), which ``sac2.api.moved`` resolves.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
import torch

import sac2
from sac2.core.decisions import ForwardContext

DATA = torch.load(Path(__file__).parent / "data" / "sac2-0.4-pickles.pt", weights_only=False)


def _answers(policy: Any, calls: list[tuple]) -> list[str]:
    ctx = ForwardContext()
    return [policy(ctx, op, *args, **kwargs).name for op, args, kwargs in calls]


@pytest.mark.parametrize("name", sorted(DATA["policies"]))
def test_a_policy_pickled_by_0_4_decides_as_it_did(name: str) -> None:
    assert _answers(DATA["policies"][name], DATA["calls"]) == DATA["answers"][name]


@pytest.mark.parametrize("name", sorted(DATA["context_fns"]))
def test_a_context_fn_pickled_by_0_4_gives_sac2_contexts_that_save(name: str) -> None:
    context_fn = DATA["context_fns"][name]
    assert isinstance(context_fn, functools.partial) and context_fn.func is sac2.create_selective_checkpoint_contexts
    x = DATA["input"].clone().requires_grad_()
    w = torch.randn(16, 16, generator=torch.Generator().manual_seed(0), requires_grad=True)
    out = sac2.checkpoint(lambda x, w: torch.relu(x @ w) @ w, x, w, context_fn=context_fn)
    (got,) = torch.autograd.grad(out.sum(), w)
    (want,) = torch.autograd.grad((torch.relu(x @ w) @ w).sum(), w)
    assert torch.equal(got, want)


@pytest.mark.parametrize("name", sorted(DATA["models"]))
def test_a_model_wrapped_by_0_4_trains_as_it_did(name: str) -> None:
    model = DATA["models"][name]
    out_0_4, grads_0_4, forwards_0_4 = DATA["expected"][name]
    x = DATA["input"].clone().requires_grad_()
    before = sac2.forward_count()
    out = model(x)
    out.sum().backward()
    assert torch.equal(out, out_0_4)
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads_0_4, strict=True))
    assert sac2.forward_count() - before == forwards_0_4  # still checkpointed, by sac2
