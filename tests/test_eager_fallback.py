"""A checkpointed block that ran eagerly while torch.compile compiled its caller: sac2 warns
(``sac2.EagerFallbackWarning``), naming the block and dynamo's graph break, where stock torch is silent.

The block breaks dynamo's graph inside its checkpoint (``torch._dynamo.graph_break()``, as any untraceable code
would), so the checkpoint runs outside the compiled graph on every route: on torch's eager frame (sac2's compiled
path, torch's checkpoint with sac2's ``context_fn``) or on sac2's (torch's checkpoint under ``install()``). The
warnings filter makes it an error. Eager code, compiled submodules inside an eager checkpoint, and checkpoints that
compile give none.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from typing import Any, Callable

import pytest
import torch
import torch.utils.checkpoint as tuc
from expecttest import assert_expected_inline
from torch import nn

import sac2

SELECTIVE: Callable[[], Any] = functools.partial(sac2.create_selective_checkpoint_contexts, sac2.policies.llm())


class Breaking(nn.Module):
    """A block dynamo cannot trace in one graph: it breaks the graph between its two Linears."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first = nn.Linear(8, 8)
        self.second = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.first(x))
        torch._dynamo.graph_break()
        return self.second(y).sin()


def _installed(block: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    def call(x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = tuc.checkpoint(block, x, use_reentrant=False)
        return out

    return call


#: Each route, as what compiles: a callable made of the block.
ROUTES: dict[str, Callable[[nn.Module], Callable[[torch.Tensor], torch.Tensor]]] = {
    "sac2.checkpoint": lambda b: lambda x: sac2.checkpoint(b, x),
    "sac2.checkpoint, selective": lambda b: lambda x: sac2.checkpoint(b, x, context_fn=SELECTIVE),
    "sac2.checkpoint_wrapper": lambda b: sac2.checkpoint_wrapper(b),
    "sac2.checkpoint_module": lambda b: sac2.checkpoint_module(b),
    "torch's checkpoint under install()": _installed,
}


def _fallbacks(run: Callable[[], None]) -> list[str]:
    """The texts of the ``EagerFallbackWarning``s ``run`` gives."""
    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run()
    return [str(w.message) for w in caught if issubclass(w.category, sac2.EagerFallbackWarning)]


def _compiled_step(route: str, block: nn.Module | None = None) -> None:
    block = Breaking() if block is None else block
    x = torch.randn(2, 8, requires_grad=True)
    if route == "torch's checkpoint under install()":
        with sac2.install():
            torch.compile(ROUTES[route](block), backend="aot_eager")(x).sum().backward()
        return
    torch.compile(ROUTES[route](block), backend="aot_eager")(x).sum().backward()


@pytest.mark.parametrize("route", ROUTES)
def test_a_block_that_falls_back_to_eager_under_compile_warns_once_naming_it(route: str) -> None:
    got = _fallbacks(lambda: _compiled_step(route))
    assert len(got) == 1, got  # its forward, not its recompute
    assert "the checkpointed block Breaking" in got[0]
    assert "Call to `torch._dynamo.graph_break()`" in got[0]  # dynamo's reason


@pytest.mark.parametrize("route", ROUTES)
def test_the_warnings_filter_makes_the_fallback_an_error(route: str) -> None:
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("error", sac2.EagerFallbackWarning)
        with pytest.raises(sac2.EagerFallbackWarning, match="ran eagerly under torch.compile"):
            _compiled_step(route)
    assert not torch._C._len_torch_dispatch_stack()  # nothing left entered
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None


def test_torchs_checkpoint_with_sac2s_context_fn_warns_without_the_name() -> None:
    def step() -> None:
        block = Breaking()
        compiled = torch.compile(lambda x: tuc.checkpoint(block, x, use_reentrant=False, context_fn=SELECTIVE),
                                 backend="aot_eager")
        compiled(torch.randn(2, 8, requires_grad=True)).sum().backward()

    got = _fallbacks(step)
    assert len(got) == 1 and "a block torch's checkpoint runs with sac2's context_fn" in got[0], got


def test_stock_torch_is_silent() -> None:
    def step() -> None:
        block = Breaking()
        compiled = torch.compile(lambda x: tuc.checkpoint(block, x, use_reentrant=False), backend="aot_eager")
        compiled(torch.randn(2, 8, requires_grad=True)).sum().backward()

    assert _fallbacks(step) == []


@pytest.mark.parametrize("route", ["sac2.checkpoint", "sac2.checkpoint, selective"])
def test_eager_checkpoints_do_not_warn(route: str) -> None:
    assert _fallbacks(lambda: ROUTES[route](Breaking())(torch.randn(2, 8, requires_grad=True)).sum().backward()) == []


def test_compiled_submodules_inside_an_eager_checkpoint_do_not_warn() -> None:
    def step() -> None:
        block = Breaking()
        block.first.compile(backend="aot_eager")
        sac2.checkpoint(block, torch.randn(2, 8, requires_grad=True), context_fn=SELECTIVE).sum().backward()

    assert _fallbacks(step) == []


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("route", ROUTES)
def test_a_checkpoint_that_compiles_does_not_warn(route: str, backend: str) -> None:
    """No graph break: the eager backend runs torch's checkpoint operator eagerly, which is no fallback."""

    class Traceable(Breaking):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.second(torch.relu(self.first(x))).sin()

    def step() -> None:
        compiled = torch.compile(ROUTES[route](Traceable()), backend=backend)
        with sac2.install() if route.endswith("install()") else contextlib.nullcontext():
            compiled(torch.randn(2, 8, requires_grad=True)).sum().backward()

    assert _fallbacks(step) == []


def test_the_warning_names_the_block_and_dynamos_graph_break() -> None:
    (text,) = _fallbacks(lambda: _compiled_step("sac2.checkpoint_wrapper"))
    assert_expected_inline(text.split(" (at ")[0], """sac2: the checkpointed block Breaking ran eagerly under torch.compile: dynamo could not trace its checkpoint, so the block and its recompute run outside the compiled graph. dynamo's last graph break: Call to `torch._dynamo.graph_break()`; Called `torch._dynamo.graph_break()` with args `[]`, kwargs `{}`""")  # noqa: E501
