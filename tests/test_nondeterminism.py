"""A recompute that saves other tensors than its forward did, through every route to sac2's frame: what PyTorch's
``test_checkpoint_detects_non_determinism`` checks of torch's frame, and ``debug=True``'s wording.

A function that runs one computation on its first call and another on later calls (its recompute) saves fewer
tensors, more tensors, or tensors of another shape in recompute. Each is torch's ``CheckpointError``, worded as
torch words it; more tensors pass with early stop (what backward needs is back before the difference). With
``debug=True`` (or ``set_checkpoint_debug_enabled(True)``, which overrides ``debug`` either way) the error leads with
torch's own debug wording, then sac2's side-by-side op lists, and drops torch's tip to pass ``debug=True``.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import pytest
import torch
import torch.utils.checkpoint as tuc
from expecttest import assert_expected_inline
from torch import nn

import sac2

Fn = Callable[[torch.Tensor], torch.Tensor]
DEBUG_TIP: str = getattr(tuc, "_debug_tip_msg", "")


def _three(x: torch.Tensor) -> torch.Tensor:
    return x.sin().exp().sin()  # saves x, sin(x), exp(sin(x))


def _two(x: torch.Tensor) -> torch.Tensor:
    return x.sin().exp()  # saves x, sin(x)


def _two_of_another_shape(x: torch.Tensor) -> torch.Tensor:
    return x.sin() * torch.tensor([1.0, 2.0])  # sin(x) saves x; the product saves a 2-element tensor


def _first_then(forward: Fn, recompute: Fn) -> Fn:
    """``forward`` on the first call, ``recompute`` on every later one."""
    calls = [0]

    def fn(x: torch.Tensor) -> torch.Tensor:
        calls[0] += 1
        return forward(x) if calls[0] == 1 else recompute(x)

    return fn


class _Module(nn.Module):
    def __init__(self, fn: Fn) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x)


def _installed(fn: Fn, x: torch.Tensor, **options: Any) -> torch.Tensor:
    with sac2.install():
        out: torch.Tensor = tuc.checkpoint(fn, x, use_reentrant=False, **options)
    return out


#: Every way to reach sac2's eager frame: its checkpoint, torch's under install(), its module wrapper.
ROUTES: dict[str, Callable[..., torch.Tensor]] = {
    "sac2.checkpoint": lambda fn, x, **o: sac2.checkpoint(fn, x, **o),
    "torch's checkpoint under install()": _installed,
    "sac2.checkpoint_wrapper": lambda fn, x, **o: sac2.checkpoint_wrapper(_Module(fn), **o)(x),
}


def _backward(route: str, forward: Fn, recompute: Fn, **options: Any) -> None:
    x = torch.randn(1, requires_grad=True)
    before = sac2.forward_count()
    out = ROUTES[route](_first_then(forward, recompute), x, **options)
    assert sac2.forward_count() == before + 1  # full AC on sac2's frame: counted, so sac2's frame ran it
    out.sum().backward()


@pytest.mark.parametrize("route", ROUTES)
def test_fewer_tensors_saved_in_recompute_raise(route: str) -> None:
    with pytest.raises(tuc.CheckpointError, match="A different number of tensors was saved") as caught:
        _backward(route, _three, _two)
    assert str(caught.value).endswith(DEBUG_TIP)  # the tip to pass debug=True, which was not passed


@pytest.mark.parametrize("route", ROUTES)
def test_more_tensors_saved_in_recompute_raise_without_early_stop(route: str) -> None:
    with tuc.set_checkpoint_early_stop(False), pytest.raises(
        tuc.CheckpointError, match="trying to save more tensors during recomputation"
    ):
        _backward(route, _two, _three)


@pytest.mark.parametrize("route", ROUTES)
def test_more_tensors_saved_in_recompute_pass_with_early_stop(route: str) -> None:
    _backward(route, _two, _three)  # recompute stops once the two tensors backward needs are back


@pytest.mark.parametrize("route", ROUTES)
def test_tensors_of_another_shape_in_recompute_raise(route: str) -> None:
    with pytest.raises(tuc.CheckpointError, match="tensors have different metadata than during the forward pass"):
        _backward(route, _two, _two_of_another_shape)


@pytest.mark.parametrize("route", ROUTES)
def test_debug_true_gives_torchs_debug_wording(route: str) -> None:
    match = "You are seeing this error because you passed `debug=True` to checkpoint"
    with pytest.raises(tuc.CheckpointError, match=match) as caught:
        _backward(route, _two, _two_of_another_shape, debug=True)
    assert DEBUG_TIP.strip() not in str(caught.value)  # no tip to pass what was passed


@pytest.mark.parametrize("route", ROUTES)
def test_set_checkpoint_debug_enabled_true_gives_torchs_debug_wording(route: str) -> None:
    match = "You are seeing this error because you passed `debug=True` to checkpoint"
    with tuc.set_checkpoint_debug_enabled(True), pytest.raises(tuc.CheckpointError, match=match):
        _backward(route, _two, _two_of_another_shape)


@pytest.mark.parametrize("route", ROUTES)
def test_set_checkpoint_debug_enabled_false_overrides_debug_true(route: str) -> None:
    with tuc.set_checkpoint_debug_enabled(False), pytest.raises(tuc.CheckpointError) as caught:
        _backward(route, _two, _two_of_another_shape, debug=True)
    assert "debug=True` to checkpoint and" not in str(caught.value)
    assert str(caught.value).endswith(DEBUG_TIP)


# The whole text of ``debug=True``'s error, for each way a recompute differs from its forward: torch's debug
# wording first, the difference itself, then sac2's op lists (and, under a selective policy, what it saved).


def _error(forward: Fn, recompute: Fn, **options: Any) -> str:
    x = torch.randn(1, requires_grad=True)
    out = sac2.checkpoint(_first_then(forward, recompute), x, debug=True, **options)
    with pytest.raises(RuntimeError) as caught:
        out.sum().backward()
    return str(caught.value)


def test_fewer_tensors_saved() -> None:
    assert_expected_inline(_error(_three, _two), """\
An error happened while unpacking tensors; dumping logs of latest computation
because you passed `debug=True` to `torch.utils.checkpoint.checkpoint()`.

 ERROR: Detected non-determinism while running activation checkpointing

 You are seeing this error because you passed `debug=True` to checkpoint and
 tensors to be saved during the original forward and differ between those saved
 during recomputation. This can happen if different operators were ran in the
 original forward and in the recomputation.

torch.utils.checkpoint: A different number of tensors was saved during the original forward and recomputation.
Number of tensors saved during forward: 3
Number of tensors saved during recomputation: 2.

sac2 debug trace (debug=True): the ops the checkpointed function dispatched, first difference marked <<
       forward           recompute
    0  aten.sin.default  aten.sin.default
    1  aten.exp.default  aten.exp.default
    2  aten.sin.default  -  <<
sac2 saved: nothing (full activation checkpointing, or no selective policy)""")  # noqa: E501


def test_more_tensors_saved_without_early_stop() -> None:
    with tuc.set_checkpoint_early_stop(False):
        error = _error(_two, _three)
    assert_expected_inline(error.split("\n\n", 3)[3], """\
torch.utils.checkpoint: trying to save more tensors during recomputation than during the original forward pass.

sac2 debug trace (debug=True): the ops the checkpointed function dispatched, first difference marked <<
       forward           recompute
    0  aten.sin.default  aten.sin.default
    1  aten.exp.default  aten.exp.default
sac2 saved: nothing (full activation checkpointing, or no selective policy)""")  # noqa: E501


def test_tensors_of_another_shape() -> None:
    assert_expected_inline(_error(_two, _two_of_another_shape).split("\n\n", 3)[3], """\
torch.utils.checkpoint: Recomputed values for the following tensors have different metadata than during the forward pass.
tensor at position 1:
saved metadata: {'shape': torch.Size([1]), 'dtype': torch.float32, 'device': device(type='cpu')}
recomputed metadata: {'shape': torch.Size([2]), 'dtype': torch.float32, 'device': device(type='cpu')}
.

sac2 debug trace (debug=True): the ops the checkpointed function dispatched, first difference marked <<
       forward           recompute
    0  aten.sin.default  aten.sin.default
    1  aten.exp.default  aten.lift_fresh.default  <<
sac2 saved: nothing (full activation checkpointing, or no selective policy)""")  # noqa: E501


def test_a_divergence_sac2s_replay_found() -> None:
    context_fn = functools.partial(sac2.create_selective_checkpoint_contexts, [torch.ops.aten.exp.default])
    error = _error(lambda x: x.sin().exp(), lambda x: x.cos().exp(), context_fn=context_fn)
    assert_expected_inline(error.split("\n\n", 3)[3], """\
sac2: recompute diverged from forward at op 0 of the region: forward ran aten.sin.default (call 0 of that op, op 0 of the region), recompute ran aten.cos.default. The checkpointed function must run the same ops in backward as in forward: look for control flow that depends on global state, on data that changed since forward, or on whether a tensor requires grad, and for state the function updates as it runs, such as a KV cache (Hugging Face models: pass use_cache=False when training with checkpointing).

sac2 debug trace (debug=True): the ops the checkpointed function dispatched, first difference marked <<
       forward           recompute
    0  aten.sin.default  aten.cos.default  <<
    1  aten.exp.default  -
sac2 saved: aten.exp.default (call 0 of that op, op 1 of the region)""")  # noqa: E501
