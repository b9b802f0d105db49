"""A checkpointed block that changes a Python object from outside it, under torch.compile: one graph on every sac2
route, where stock torch breaks the graph and runs the block eagerly.

transformers 5.25's attention (through the ``kernels`` package it now requires) sets a context variable before
each call and resets it after; compiled, the variable is a plain object whose attributes change. dynamo refuses
such a change inside torch's checkpoint operator ("HOP: Unsafe side effect"), because eager checkpointing replays
it in recompute. sac2's checkpoint lets its body keep it in the graph, applied once per call as in the compiled run
without checkpointing (``sac2._compat.side_effects_kept``); ``install()`` does the same for torch's own checkpoint
calls while installed. The model here does what transformers does, without transformers.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, cast

import pytest
import torch
import torch.utils.checkpoint as tuc
from torch import nn
from torch._dynamo.utils import counters

import sac2


class _Variable:
    """What compiled code sees of a context variable: an object whose value is set, and reset to what it was."""

    def __init__(self) -> None:
        self.value: object = None
        self.set_now = False

    def set(self, value: object) -> object:
        previous, self.value, self.set_now = self.value, value, True
        return previous

    def reset(self, previous: object) -> None:
        self.value, self.set_now = previous, previous is not None


ACTIVE = _Variable()


class Attention(nn.Module):
    """Sets ``ACTIVE`` around its work, as transformers 5.25's attention does; counts its calls on ``calls``."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.out = nn.Linear(d, d, bias=False)
        self.calls = [0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        previous = ACTIVE.set(self)
        try:
            self.calls[0] += 1
            q, k, v = self.qkv(x).chunk(3, -1)
            return self.out(torch.softmax(q @ k.transpose(-1, -2), -1) @ v)
        finally:
            ACTIVE.reset(previous)


class Block(nn.Module):
    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.attention = Attention(d)
        self.up = nn.Linear(d, 2 * d)
        self.down = nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(x)
        return x + self.down(torch.relu(self.up(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList([Block(), Block()])
        self.call: Callable[[nn.Module, torch.Tensor], torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x) if self.call is None else self.call(layer, x)
        return x


#: Made once, outside compiled code, as users make it (dynamo takes the partial as a constant).
SELECTIVE: Callable[[], Any] = functools.partial(sac2.create_selective_checkpoint_contexts, sac2.policies.llm())


def _torch_checkpoint(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    out: torch.Tensor = tuc.checkpoint(layer, x, use_reentrant=False)
    return out


#: How each sac2 route checkpoints ``Net``'s blocks.
ROUTES: dict[str, Callable[[Net], object]] = {
    "sac2.checkpoint": lambda m: setattr(m, "call", lambda layer, x: sac2.checkpoint(layer, x)),
    "sac2.checkpoint, selective": lambda m: setattr(
        m, "call", lambda layer, x: sac2.checkpoint(layer, x, context_fn=SELECTIVE)),
    "sac2.checkpoint_wrapper": lambda m: setattr(m, "layers", nn.ModuleList(map(sac2.checkpoint_wrapper, m.layers))),
    "sac2.checkpoint_module": lambda m: [sac2.checkpoint_module(b) for b in m.layers],
    "apply_ac full": lambda m: sac2.apply_ac(m, "full"),
    "apply_ac selective": lambda m: sac2.apply_ac(m, "selective"),
    "apply_ac regions": lambda m: sac2.apply_ac(m, "regions", save=["linear"]),
}


def _step(model: nn.Module) -> tuple[torch.Tensor, list[torch.Tensor]]:
    x = torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(1), requires_grad=True)
    loss = model(x).pow(2).mean()
    loss.backward()
    return loss.detach(), [x.grad, *(p.grad for p in model.parameters())]


def _compiled_step(model: nn.Module) -> tuple[torch.Tensor, list[torch.Tensor]]:
    torch._dynamo.reset()
    counters.clear()
    return _step(cast(nn.Module, torch.compile(model, backend="aot_eager")))  # a Module's is an OptimizedModule


@pytest.fixture(scope="module")
def compiled_no_checkpointing() -> tuple[torch.Tensor, list[torch.Tensor]]:
    return _compiled_step(Net())


@pytest.mark.parametrize("route", ROUTES)
def test_a_block_changing_an_outside_object_compiles_in_one_graph(route: str, compiled_no_checkpointing) -> None:
    model = Net()
    ROUTES[route](model)
    loss, grads = _compiled_step(model)
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 1
    want_loss, want_grads = compiled_no_checkpointing
    torch.testing.assert_close(loss, want_loss, rtol=1e-4, atol=1e-5)
    for got, want in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert ACTIVE.value is None and not ACTIVE.set_now  # set and reset once per call, as without checkpointing


def test_the_change_applies_once_per_call_as_without_checkpointing() -> None:
    model = Net()
    sac2.apply_ac(model, "full")
    _compiled_step(model)
    # eager checkpointing calls each attention again in recompute (2 calls); the compiled graph does not
    assert [cast(Block, b).attention.calls[0] for b in model.layers] == [1, 1]


def test_stock_torch_checkpoint_breaks_the_graph_there() -> None:
    """What sac2's routes avoid: torch's own checkpoint, not installed, breaks at the change (the model does what
    it should)."""
    model = Net()
    model.call = _torch_checkpoint
    _compiled_step(model)
    assert any("side effect" in reason for reason in counters["graph_break"]), dict(counters["graph_break"])


def test_torchs_checkpoint_under_install_compiles_in_one_graph(compiled_no_checkpointing) -> None:
    model = Net()
    model.call = _torch_checkpoint
    with sac2.install():
        loss, _ = _compiled_step(model)
    assert not counters["graph_break"], dict(counters["graph_break"])
    torch.testing.assert_close(loss, compiled_no_checkpointing[0], rtol=1e-4, atol=1e-5)


def test_uninstall_puts_dynamos_setting_back() -> None:
    config = torch._dynamo.config
    with sac2.install(), sac2.install():
        assert config.skip_fwd_side_effects_in_bwd_under_checkpoint
    assert not config.skip_fwd_side_effects_in_bwd_under_checkpoint
    with config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=True):
        with sac2.install():
            pass
        assert config.skip_fwd_side_effects_in_bwd_under_checkpoint  # the user's own setting stays
