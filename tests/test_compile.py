"""torch.compile and sac2: compiled code inside a sac2 checkpoint, and a sac2 checkpoint inside torch.compile.

- A ``torch.compile``d function called under sac2's modes still compiles (they ignore compile internals), in a
  ``sac2.region`` or not, and gives the gradients of the un-checkpointed compiled run.
- ``torch.compile(fullgraph=True)`` over ``sac2.checkpoint`` turns it into torch's checkpoint HOP, and sac2's
  policy decides what the partitioner saves: the same ops are re-run in backward as in eager.
"""

from __future__ import annotations

from functools import partial
from typing import Callable

import pytest
import torch
from torch._dynamo.utils import counters
from torch.utils._python_dispatch import TorchDispatchMode

import sac2

from helpers import randn, scaling_op

DTYPE = torch.float64
runs = {"saved": 0, "recomputed": 0}


saved_op = scaling_op("sac2_test_compile::saved", runs, 3)
recomputed_op = scaling_op("sac2_test_compile::recomputed", runs, 3)


def _block(x: torch.Tensor) -> torch.Tensor:
    return recomputed_op(saved_op(x).sin()).cos().sum()


def _policy(_ctx, op, *args, **kwargs) -> bool:
    return op is torch.ops.sac2_test_compile.saved.default


def _checkpointed(x: torch.Tensor) -> torch.Tensor:
    return sac2.checkpoint(_block, x, context_fn=partial(sac2.create_selective_checkpoint_contexts, _policy))


def _backward_runs(fn: Callable, x: torch.Tensor) -> tuple[torch.Tensor, dict]:
    out = fn(x)
    runs.update(saved=0, recomputed=0)
    grad = torch.autograd.grad(out, x)[0]
    return grad, dict(runs)


class _NotIgnoringCompile(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


@pytest.fixture
def _dynamo_reset() -> None:
    """Each test compiles its functions afresh."""
    torch._dynamo.reset()


@pytest.fixture
def _counters_cleared() -> None:
    """Each test counts only the frames it compiles."""
    counters.clear()


@pytest.mark.usefixtures("_dynamo_reset", "_counters_cleared")
def test_a_mode_that_does_not_ignore_compile_internals_makes_dynamo_skip():
    # The control for the tests below: a skipped frame leaves counters["frames"] empty.
    with _NotIgnoringCompile():
        torch.compile(torch.sin, backend="aot_eager")(randn(5, dtype=DTYPE))
    assert dict(counters["frames"]) == {}


@pytest.mark.usefixtures("_dynamo_reset", "_counters_cleared")
def test_compiled_function_called_directly_compiles_with_uncheckpointed_gradients():
    compiled = torch.compile(lambda y: (y.sin() * y).cos(), backend="aot_eager")

    def fn(x):
        return compiled(x.exp()).sum()

    x = randn(5, dtype=DTYPE)
    out = sac2.checkpoint(fn, x, context_fn=partial(sac2.create_selective_checkpoint_contexts, _policy))
    grad = torch.autograd.grad(out, x)[0]
    assert dict(counters["frames"]) == {"total": 1, "ok": 1}
    assert torch.equal(grad, torch.autograd.grad(fn(x), x)[0])


@pytest.mark.usefixtures("_dynamo_reset", "_counters_cleared")
def test_inductor_code_in_a_region_compiles_with_uncheckpointed_gradients():
    compiled = torch.compile(lambda y: (y.sin() * y).cos())
    region = sac2.region(compiled, name="fused")

    def fn(x):
        return region(x.exp()).sum()

    x = randn(5, dtype=DTYPE)
    for policy in ([sac2.Region("fused")], []):
        out = sac2.checkpoint(fn, x, context_fn=partial(sac2.create_selective_checkpoint_contexts, policy))
        grad = torch.autograd.grad(out, x)[0]
        assert torch.equal(grad, torch.autograd.grad(fn(x), x)[0])
    assert dict(counters["frames"]) == {"total": 1, "ok": 1}


@pytest.mark.usefixtures("_dynamo_reset")
def test_fullgraph_compile_reruns_in_backward_what_eager_does():
    x = randn(5, dtype=DTYPE)
    eager_grad, eager_runs = _backward_runs(_checkpointed, x)
    compiled = torch.compile(_checkpointed, backend="aot_eager", fullgraph=True)
    compiled_grad, compiled_runs = _backward_runs(compiled, x)
    assert (eager_runs, compiled_runs) == ({"saved": 0, "recomputed": 1},) * 2
    assert torch.equal(compiled_grad, eager_grad)
    assert torch.equal(eager_grad, torch.autograd.grad(_block(x), x)[0])


@pytest.mark.usefixtures("_dynamo_reset")
def test_fullgraph_compile_decides_a_region_as_one_op():
    # dynamo inlines the region's function; every op it traces gets the policy's answer for the region, so
    # a saved region does not run again in backward and a recomputed one runs once more, as in eager.
    attn = sac2.region(lambda y: recomputed_op(saved_op(y).sin()), name="attn")

    def save_attn():
        return sac2.create_selective_checkpoint_contexts([sac2.Region("attn")])

    def save_cos():
        return sac2.create_selective_checkpoint_contexts([torch.ops.aten.cos.default])

    x = randn(5, dtype=DTYPE)
    for context_fn, expected in ((save_attn, 0), (save_cos, 1)):
        torch._dynamo.reset()

        def fn(x, context_fn=context_fn):
            return sac2.checkpoint(lambda y: attn(y).cos().sum(), x, context_fn=context_fn)

        grad, backward_runs = _backward_runs(torch.compile(fn, backend="aot_eager", fullgraph=True), x)
        assert backward_runs == {"saved": expected, "recomputed": expected}, context_fn.__name__
        assert torch.equal(grad, torch.autograd.grad(_block(x), x)[0])


def test_the_modes_dispatch_without_a_dynamo_disable_wrapper_frame():
    # torch wraps a mode's __torch_dispatch__ in torch._disable_dynamo (about 1 us per op) unless the mode opts
    # out; sac2 opts out and marks the code object skipped instead, so the method is its own function.
    from sac2.modes.forward import CachingMode
    from sac2.modes.replay import ReplayMode
    from sac2.policies.profile import _Profiling

    for mode in (CachingMode, ReplayMode, _Profiling):
        modules = ("sac2.modes.forward", "sac2.modes.replay", "sac2.policies.profile")
        assert mode.__dict__["__torch_dispatch__"].__module__ in modules
        assert not hasattr(mode.__dict__["__torch_dispatch__"], "__wrapped__")
