"""Compiled code inside an eager checkpoint, and the frame's hooks wherever autograd may call them.

Autograd calls the frame's saved-tensor hooks from C++, so they run inside whatever is running: the compiled code
of a ``module.compile()``-d submodule (where dynamo would trace them as user code), fake tensors, ``no_dispatch``,
compiled autograd. Each test runs a block with and without checkpointing and compares the gradients.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import pytest
import torch
import torch.utils.checkpoint as tuc
from torch import nn
from torch._dynamo.utils import counters
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._mode_utils import no_dispatch

import sac2

from helpers import WrittenRMSNorm, assert_same_as_without_checkpointing, outputs_and_grads


class _Proj(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d, d, generator=torch.Generator().manual_seed(d)) / d**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.t()


class _Block(nn.Module):
    """PyTorch's ``test_attr_compile_submodules_in_checkpoint_wrapper`` block, three norm + projection residuals,
    of torch's modules (``nn.RMSNorm``, ``nn.Linear``, which compiled run as they are, with dynamo's frame hook
    active) or of the user's own (which compile)."""

    def __init__(self, d: int = 32, users: bool = False) -> None:
        super().__init__()
        def pair() -> tuple[nn.Module, nn.Module]:
            return (WrittenRMSNorm(d), _Proj(d)) if users else (nn.RMSNorm(d), nn.Linear(d, d, bias=False))

        (self.norm1, self.linear1), (self.norm2, self.linear2), (self.norm3, self.linear3) = pair(), pair(), pair()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.linear1(self.norm1(x))
        x = x + self.linear2(self.norm2(x))
        return x + self.linear3(self.norm3(x))


def _selective() -> Callable[[], Any]:
    return functools.partial(sac2.create_selective_checkpoint_contexts, sac2.policies.llm())


def _installed(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with sac2.install():
        out: torch.Tensor = tuc.checkpoint(block, x, use_reentrant=False)
    return out


#: Every way a user checkpoints a block whose submodules they compiled.
ROUTES: dict[str, Callable[[nn.Module, torch.Tensor], torch.Tensor]] = {
    "sac2.checkpoint": lambda b, x: sac2.checkpoint(b, x, use_reentrant=False),
    "sac2.checkpoint, selective": lambda b, x: sac2.checkpoint(b, x, use_reentrant=False, context_fn=_selective()),
    "torch's checkpoint under install()": _installed,
    "sac2.checkpoint_wrapper": lambda b, x: sac2.checkpoint_wrapper(b)(x),
}


X = torch.randn(4, 32, generator=torch.Generator().manual_seed(0), requires_grad=True)


def _compiled_submodules(backend: str, users: bool = False) -> _Block:
    torch._dynamo.reset()
    block = _Block(users=users)
    for _, m in block.named_children():
        m.compile(backend=backend)
    return block


@pytest.mark.parametrize("users", [False, True], ids=["torch's modules", "the user's modules"])
@pytest.mark.parametrize("route", ROUTES)
def test_compiled_submodules_inside_a_checkpoint_give_the_gradients_of_no_checkpointing(
    route: str, users: bool
) -> None:
    block = _compiled_submodules("aot_eager", users)
    before = sac2.forward_count()
    assert_same_as_without_checkpointing(ROUTES[route], block, X)
    assert sac2.forward_count() > before  # sac2's frame ran it


def test_compiled_submodules_inside_a_checkpoint_under_inductor() -> None:
    block = _compiled_submodules("inductor", users=True)
    assert_same_as_without_checkpointing(ROUTES["sac2.checkpoint, selective"], block, X, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("users", [False, True], ids=["torch's modules", "the user's modules"])
def test_compiled_submodules_inside_a_checkpoint_compile_once_each(users: bool) -> None:
    """PyTorch's test holds the recompiles to ``recompile_limit=2``; here hitting the limit fails, and dynamo
    compiles the submodules only (one graph per class: it reuses it across instances), no frame of sac2's, and
    breaks no graph. torch 2.13 runs torch's own modules as they are (no graph); 2.14 and 2.15 compile them too."""
    block = _compiled_submodules("aot_eager", users)
    counters.clear()
    with torch._dynamo.config.patch(recompile_limit=2, fail_on_recompile_limit_hit=True):
        for _ in range(2):  # a second step reuses every compiled submodule
            outputs_and_grads(ROUTES["sac2.checkpoint"], block, X)
    graphs = counters["stats"]["unique_graphs"]
    assert counters["frames"]["total"] == graphs  # each frame compiled once, none again
    assert graphs == 2 if users else graphs in (0, 2)  # a norm class and a projection class
    assert not counters["graph_break"]


@pytest.mark.parametrize("cost", ["flops", "time"])
def test_profiling_a_memory_budget_leaves_the_compiled_submodules_compiling(cost: str) -> None:
    """The budget's profile runs the block once under sac2's cost counters; compiled code below them compiles as it
    would in training (dynamo would otherwise skip it there and never compile it again: the seam matrix's budget
    cells with compiled functions ran eagerly)."""
    block = _compiled_submodules("aot_eager", users=True)
    counters.clear()
    sac2.policies.memory_budget(block, (torch.randn(4, 32, requires_grad=True),), 0.5, cost=cost)
    outputs_and_grads(ROUTES["sac2.checkpoint"], block, X)
    assert counters["frames"]["total"] == counters["stats"]["unique_graphs"] == 2  # a norm, a projection


def test_the_frame_runs_under_fake_tensors() -> None:
    with FakeTensorMode():
        x = torch.randn(4, 8, requires_grad=True)
        w = torch.randn(8, 8, requires_grad=True)
        before = sac2.forward_count()
        out = sac2.checkpoint(lambda x, w: torch.relu(x @ w) @ w, x, w, use_reentrant=False, context_fn=_selective())
        out.sum().backward()
    assert sac2.forward_count() > before
    assert w.grad is not None and w.grad.shape == (8, 8)


def test_the_frame_runs_under_no_dispatch() -> None:
    x = torch.randn(4, 8, requires_grad=True)
    w = torch.randn(8, 8, requires_grad=True)
    with no_dispatch():
        out = sac2.checkpoint(lambda x, w: torch.relu(x @ w).sin() @ w, x, w, use_reentrant=False)
    (got,) = torch.autograd.grad(out.sum(), w)
    (want,) = torch.autograd.grad((torch.relu(x @ w).sin() @ w).sum(), w)
    assert torch.equal(got, want)


@pytest.mark.parametrize("selective", [False, True], ids=["full", "selective"])
def test_the_frame_runs_under_compiled_autograd(selective: bool) -> None:
    torch._dynamo.reset()
    x = torch.randn(4, 8, requires_grad=True)
    w = torch.randn(8, 8, requires_grad=True)
    options: dict[str, Any] = {"context_fn": _selective()} if selective else {}
    out = sac2.checkpoint(lambda x, w: torch.relu(x @ w).sin() @ w, x, w, use_reentrant=False, **options)
    with torch._dynamo.compiled_autograd._enable(torch.compile(backend="aot_eager")):
        out.sum().backward()
    (want,) = torch.autograd.grad((torch.relu(x @ w).sin() @ w).sum(), w)
    torch.testing.assert_close(w.grad, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("keep_inputs", [False, True])
def test_a_compiled_submodule_as_a_saved_region_traces_none_of_the_regions_hooks(keep_inputs: bool) -> None:
    """The hooks a saved region's body runs under are sac2's: dynamo must not trace them (on 0.4 it did, breaking
    its graph inside them), whatever the body compiled."""
    torch._dynamo.reset()
    linear = nn.Linear(32, 32)
    linear.compile(backend="aot_eager")
    name = f"compiled_linear_keeping_inputs_{keep_inputs}"  # a region name's keep_inputs holds process-wide
    saved = sac2.region(linear, name=name, keep_inputs=keep_inputs)
    context_fn = functools.partial(sac2.create_selective_checkpoint_contexts, [sac2.Region(name)])
    counters.clear()
    try:
        assert_same_as_without_checkpointing(
            lambda b, x: sac2.checkpoint(lambda y: saved(y).sin() @ b.weight, x, context_fn=context_fn),
            linear, X, reference=lambda b, x: b(x).sin() @ b.weight,
        )
    finally:
        sac2.region(linear, name=name, keep_inputs=False)
    # the Linear's own frame at most (torch 2.14+ compile torch's modules; 2.13 runs them as they are), compiled
    # once and whole: no frame of the region's hooks, no graph break in them
    assert counters["frames"]["total"] == counters["frames"]["ok"] <= 1
    assert not counters["graph_break"]
