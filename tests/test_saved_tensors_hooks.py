"""``respect_saved_tensors_hooks``: what sac2's policy saves goes through the user's saved-tensor hooks
(``save_on_cpu``, a counting pack hook) as torch 2.14+ does for its own SAC: True routes it through them, False
bypasses them silently, None bypasses them and warns. sac2 does this on torch 2.13 too."""

from __future__ import annotations

import inspect
import warnings
from functools import partial
from typing import Any, Callable

import pytest
import torch
import torch.utils.checkpoint as tuc
from expecttest import assert_expected_inline
from torch.autograd.graph import save_on_cpu, saved_tensors_hooks

import sac2

from helpers import randn

STOCK_RESPECTS_HOOKS = "respect_saved_tensors_hooks" in inspect.signature(tuc.checkpoint).parameters  # 2.14+
SAVE_ALL = [torch.ops.aten.exp.default, torch.ops.aten.tanh.default]


def _fn(x: torch.Tensor) -> torch.Tensor:
    return x.exp().tanh()  # autograd saves exactly what the save list saves: each op's output


def _packed(run: Callable[[torch.Tensor], torch.Tensor]) -> list[torch.Tensor]:
    """The tensors a pack hook around ``run`` sees, in order, while the forward runs. The checkpointed functions
    below take ``x`` from their closure, so no checkpoint packs an input of its own."""
    seen: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen.append(t.detach().clone())
        return t

    x = randn(4, 4, dtype=torch.float64)
    with saved_tensors_hooks(pack, lambda t: t):
        out = run(x)
    out.sum().backward()
    return seen


def _sac2(x: torch.Tensor, respect: bool | None = True, policy: Any = SAVE_ALL) -> torch.Tensor:
    context_fn = partial(sac2.create_selective_checkpoint_contexts, policy)
    return sac2.checkpoint(lambda: _fn(x), context_fn=context_fn, respect_saved_tensors_hooks=respect)


def _reference(x: torch.Tensor) -> torch.Tensor:
    """What torch sends through the hooks: stock SAC with the flag on 2.14+; on 2.13, whose SAC bypasses them,
    plain autograd without checkpointing (the policy saves exactly what autograd saves in ``_fn``)."""
    if not STOCK_RESPECTS_HOOKS:
        return _fn(x)
    context_fn = partial(tuc.create_selective_checkpoint_contexts, SAVE_ALL)
    return tuc.checkpoint(
        lambda: _fn(x), use_reentrant=False, context_fn=context_fn, respect_saved_tensors_hooks=True
    )


def test_respect_true_packs_what_torch_packs() -> None:
    got, want = _packed(_sac2), _packed(_reference)
    assert len(got) == len(want) == 2
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_respect_false_bypasses_the_hooks() -> None:
    assert _packed(partial(_sac2, respect=False)) == []


def test_respect_none_bypasses_the_hooks() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        assert _packed(partial(_sac2, respect=None)) == []


def test_save_on_cpu_gives_the_gradients_of_no_checkpointing() -> None:
    def grad(run: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        x = randn(4, 4, dtype=torch.float64)
        with save_on_cpu():
            out = run(x)
        return torch.autograd.grad(out.sum(), x)[0]

    assert torch.equal(grad(_sac2), grad(_fn))


def test_nested_checkpoint_packs_through_the_users_hooks_not_the_outer_checkpoints() -> None:
    def outer(x: torch.Tensor) -> torch.Tensor:
        return _sac2(x.sin()).cos()  # the outer checkpoint's own hooks are innermost when the inner one starts

    got = _packed(lambda x: sac2.checkpoint(lambda: outer(x)))
    assert len(got) == 2  # the inner cache: exp's and tanh's outputs


def test_the_users_hooks_stay_in_place_after_a_nested_lookup() -> None:
    pack, unpack = (lambda t: t), (lambda t: t)

    def outer(x: torch.Tensor) -> torch.Tensor:
        inner = _sac2(x)
        assert torch._C._autograd._top_saved_tensors_default_hooks(False) != (pack, unpack)  # the outer's own
        return inner

    with saved_tensors_hooks(pack, unpack):
        sac2.checkpoint(outer, randn(4, 4, dtype=torch.float64)).sum().backward()
        assert torch._C._autograd._top_saved_tensors_default_hooks(False) == (pack, unpack)


def _warnings(run: Callable[[torch.Tensor], torch.Tensor]) -> list[warnings.WarningMessage]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _packed(run)
    return [w for w in caught if issubclass(w.category, FutureWarning)]


def test_respect_none_warns_when_hooks_are_in_scope_and_something_is_saved() -> None:
    (warning,) = _warnings(partial(_sac2, respect=None))
    assert_expected_inline(str(warning.message), """A saved_tensors_hooks context (e.g. save_on_cpu) is active around a selective activation checkpoint region. Tensors that SAC saves currently bypass these hooks, but a future release will route them through the hooks like any other saved tensor. Silence this warning and choose the behavior explicitly by passing respect_saved_tensors_hooks=True|False to sac2.checkpoint.""")  # noqa: E501


def test_warning_points_at_the_callers_line() -> None:
    (warning,) = _warnings(partial(_sac2, respect=None))
    assert warning.filename == __file__


def test_respect_none_is_silent_when_nothing_is_saved() -> None:
    assert _warnings(partial(_sac2, respect=None, policy=[])) == []


def test_respect_false_is_silent() -> None:
    assert _warnings(partial(_sac2, respect=False)) == []


def test_respect_none_is_silent_without_user_hooks() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _sac2(randn(4, 4, dtype=torch.float64), respect=None).sum().backward()


@pytest.mark.skipif(not STOCK_RESPECTS_HOOKS, reason="torch 2.13's SAC has no respect_saved_tensors_hooks")
def test_stock_sac_contexts_given_to_sac2_checkpoint_get_the_flag() -> None:
    def stock_via_sac2(x: torch.Tensor) -> torch.Tensor:
        context_fn = partial(tuc.create_selective_checkpoint_contexts, SAVE_ALL)
        return sac2.checkpoint(lambda: _fn(x), context_fn=context_fn, respect_saved_tensors_hooks=True)

    assert len(_packed(stock_via_sac2)) == len(_packed(_reference))


_exp_region = sac2.region(lambda t: t.exp(), name="saved_tensors_hooks.exp")


@pytest.mark.parametrize(
    "policy",
    [[sac2.Region("saved_tensors_hooks.exp")], lambda _ctx, op, *a, **k: isinstance(op, sac2.Region)],
    ids=["region_only_list", "policy_function"],
)
def test_a_saved_region_goes_through_the_hooks(policy):
    def run(x):
        context_fn = partial(sac2.create_selective_checkpoint_contexts, policy)
        return sac2.checkpoint(lambda: _exp_region(x).tanh(), context_fn=context_fn, respect_saved_tensors_hooks=True)

    seen = _packed(run)
    x = randn(4, 4, dtype=torch.float64)
    assert any(torch.equal(t, x.exp()) for t in seen)  # the region's output, handed to the pack hook
    grad = torch.autograd.grad(run(x).sum(), x)[0]
    assert torch.equal(grad, torch.autograd.grad(x.exp().tanh().sum(), x)[0])


def test_a_saved_region_that_wrote_where_sac2_cannot_see_runs_again_under_the_hooks():
    # It has nothing for the hooks to hold: recompute runs it again, as without hooks.
    @sac2.region(name="saved_tensors_hooks.invisible")
    def invisible(t, buf):
        buf.data.copy_(t.detach() * 2)  # a write sac2 cannot see: no version bump, nothing returned

    def fn(t):
        buf = torch.zeros_like(t)
        invisible(t, buf)
        return (buf * t).exp()

    x = randn(4, 4, dtype=torch.float64)
    policy = partial(sac2.create_selective_checkpoint_contexts, [sac2.Region("saved_tensors_hooks.invisible")])
    with warnings.catch_warnings(), save_on_cpu():
        warnings.simplefilter("ignore")  # sac2 says it recomputes the region
        y = sac2.checkpoint(fn, x, context_fn=policy, respect_saved_tensors_hooks=True)
    (grad,) = torch.autograd.grad(y.sum(), x)
    assert torch.equal(grad, torch.autograd.grad(fn(x).sum(), x)[0])
