"""Ops with an ordered side effect (``torch._higher_order_ops.effects``: ``aten._print``, torchbind calls, custom
ops registered so) run once: recomputing one would repeat its effect in backward. sac2 saves them whatever the
policy answers, unless it answers MUST_RECOMPUTE, as torch 2.15's SAC does."""

from __future__ import annotations

from functools import partial
from typing import Any, Callable

import pytest
import torch
import torch.utils.checkpoint as tuc
from torch._higher_order_ops.effects import _EffectType

import sac2

_effects: list[str] = []


@torch.library.custom_op("sac2_test_effects::logged_double", mutates_args=())
def logged_double(x: torch.Tensor) -> torch.Tensor:
    """2 * x that appends to a log each time it really runs: an ordered side effect."""
    _effects.append("logged")
    return x * 2


logged_double.register_autograd(lambda _ctx, grad: grad * 2)
logged_double.register_effect(_EffectType.ORDERED)
LOGGED = torch.ops.sac2_test_effects.logged_double.default
RECOMPUTE = tuc.CheckpointPolicy.PREFER_RECOMPUTE
STOCK_SAVES_EFFECTS = hasattr(tuc, "_is_cacheable_effect")  # torch 2.15+


def _fn(x: torch.Tensor) -> torch.Tensor:
    return logged_double(x.sin()).exp()  # exp keeps its output: its input must be recomputed or served


def _answer(value: Any) -> Callable:
    return lambda _ctx, _op, *args, **kwargs: value


def _effects_in_step(checkpoint: Callable, create: Callable, policy: Any) -> int:
    """How often the effectful op runs in one checkpointed forward and backward."""
    x = torch.randn(4, dtype=torch.float64, generator=torch.Generator().manual_seed(0), requires_grad=True)
    _effects.clear()
    checkpoint(_fn, x, use_reentrant=False, context_fn=partial(create, policy)).sum().backward()
    return len(_effects)


def _sac2_runs(policy: Any) -> int:
    return _effects_in_step(sac2.checkpoint, sac2.create_selective_checkpoint_contexts, policy)


def test_effectful_op_runs_once_under_a_recomputing_policy() -> None:
    assert _sac2_runs(_answer(RECOMPUTE)) == 1


def test_effectful_op_runs_once_under_a_save_list_without_it() -> None:
    assert _sac2_runs([torch.ops.aten.sin.default]) == 1


def test_effectful_op_runs_again_when_the_policy_says_must_recompute() -> None:
    assert _sac2_runs(_answer(tuc.CheckpointPolicy.MUST_RECOMPUTE)) == 2


@pytest.mark.skipif(not STOCK_SAVES_EFFECTS, reason="torch before 2.15 recomputes effectful ops in its SAC")
@pytest.mark.parametrize("policy", [RECOMPUTE, tuc.CheckpointPolicy.MUST_RECOMPUTE], ids=str)
def test_effectful_op_runs_as_often_as_under_stock_sac(policy: Any) -> None:
    stock = _effects_in_step(tuc.checkpoint, tuc.create_selective_checkpoint_contexts, _answer(policy))
    assert _sac2_runs(_answer(policy)) == stock


def test_saved_effectful_op_gives_the_gradients_of_no_checkpointing() -> None:
    x = torch.randn(4, dtype=torch.float64, generator=torch.Generator().manual_seed(0), requires_grad=True)
    context_fn = partial(sac2.create_selective_checkpoint_contexts, _answer(RECOMPUTE))
    (got,) = torch.autograd.grad(sac2.checkpoint(_fn, x, context_fn=context_fn).sum(), x)
    (want,) = torch.autograd.grad(_fn(x).sum(), x)
    assert torch.equal(got, want)


def test_aten_print_prints_once(capfd: pytest.CaptureFixture) -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        torch.ops.aten._print("sac2 effect")
        return x.sin()

    x = torch.randn(4, requires_grad=True)
    context_fn = partial(sac2.create_selective_checkpoint_contexts, _answer(RECOMPUTE))
    sac2.checkpoint(fn, x, context_fn=context_fn).sum().backward()
    assert capfd.readouterr().out.count("sac2 effect") == 1
