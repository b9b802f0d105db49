"""sac2 under the user's own dispatch-mode tools: FLOP counters, memory trackers, debug and pass-through modes.

Each tool is active in the forward only, the backward only, or both, around two checkpointed blocks of two
Linears, on every route (sac2's SAC, sac2's full AC, one-line regions, torch's checkpoint under ``install()``); the
reference is the same run, with the tool in the same place, without checkpointing. A tool makes ``nn.Linear``
decompose along another path (``t`` before ``view``): recompute may run views in another order (replay rule 3,
``sac2.modes.replay.ReplayMode._realign``), never another op that carries a decision.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
from typing import Any, Callable

import pytest
import torch
import torch.utils.checkpoint as tuc
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

import sac2

from helpers import contexts

_MM = [torch.ops.aten.mm.default, torch.ops.aten.addmm.default]


class _PassThrough(TorchDispatchMode):
    """A user's mode that only counts what it sees."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.calls += 1
        return func(*args, **(kwargs or {}))


def _mem_tracker() -> TorchDispatchMode:
    from torch.distributed._tools.mem_tracker import MemTracker

    return MemTracker()


def _debug_mode() -> TorchDispatchMode:
    from torch.utils._debug_mode import DebugMode  # torch 2.14 and later

    return DebugMode()


# Any: each is a context manager around the step, and FlopCounterMode is not a TorchDispatchMode (it holds one)
TOOLS: dict[str, Callable[[], Any]] = {
    "FlopCounterMode": lambda: FlopCounterMode(display=False),
    "MemTracker": _mem_tracker,
    "pass-through": _PassThrough,
}
if importlib.util.find_spec("torch.utils._debug_mode") is not None:
    TOOLS["DebugMode"] = _debug_mode


class _Blocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16)) for _ in range(2)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _plain(model: _Blocks, x: torch.Tensor) -> torch.Tensor:
    return model(x)


def _sac(model: _Blocks, x: torch.Tensor) -> torch.Tensor:
    for layer in model.layers:
        x = sac2.checkpoint(layer, x, use_reentrant=False, context_fn=contexts(_MM))
    return x


def _full(model: _Blocks, x: torch.Tensor) -> torch.Tensor:
    for layer in model.layers:
        x = sac2.checkpoint(layer, x, use_reentrant=False)
    return x


def _installed(model: _Blocks, x: torch.Tensor) -> torch.Tensor:
    context_fn = functools.partial(tuc.create_selective_checkpoint_contexts, _MM)
    with sac2.install():
        for layer in model.layers:
            x = tuc.checkpoint(layer, x, use_reentrant=False, context_fn=context_fn)
    return x


ROUTES: dict[str, Callable[[_Blocks, torch.Tensor], torch.Tensor]] = {
    "sac2 SAC": _sac,
    "sac2 full AC": _full,
    "one-line regions": _plain,  # the model is prepared by apply_ac below
    "install()": _installed,
}


def _model(route: str) -> _Blocks:
    model = _Blocks()
    if route == "one-line regions":
        sac2.apply_ac(model, mode="regions", save=["linear"])
    return model


def _train(route: str, where: str, tool: str) -> tuple[list[torch.Tensor], Any]:  # the tool, as TOOLS makes it
    """One step with ``tool`` active ``where``; the gradients of the input and every parameter, and the tool."""
    model = _model(route)
    run = ROUTES[route] if route != "none" else _plain
    x = torch.randn(4, 3, 16, generator=torch.Generator().manual_seed(1), requires_grad=True)
    mode = TOOLS[tool]()
    forward = mode if where in ("forward", "both") else contextlib.nullcontext()
    backward = mode if where in ("backward", "both") else contextlib.nullcontext()
    if where == "both":
        with mode:
            run(model, x).sin().sum().backward()
    else:
        with forward:
            loss = run(model, x).sin().sum()
        with backward:
            loss.backward()
    return [x.grad, *(p.grad for p in model.parameters())], mode


@pytest.mark.parametrize("tool", list(TOOLS))
@pytest.mark.parametrize("where", ["forward", "backward", "both"])
@pytest.mark.parametrize("route", list(ROUTES))
def test_a_user_tool_around_checkpointed_blocks_gives_the_gradients_of_no_checkpointing(route, where, tool):
    before = sac2.forward_count()
    grads, _ = _train(route, where, tool)
    assert sac2.forward_count() > before  # sac2 ran on this route
    reference, _ = _train("none", where, tool)
    for got, want in zip(grads, reference, strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize("route", ["sac2 SAC", "install()"])
def test_a_flop_counter_over_the_forward_counts_what_no_checkpointing_counts(route):
    _, counted = _train(route, "forward", "FlopCounterMode")
    _, reference = _train("none", "forward", "FlopCounterMode")
    assert counted.get_total_flops() == reference.get_total_flops() > 0


def test_a_pass_through_mode_over_the_backward_sees_the_recompute_of_unsaved_ops():
    _, checkpointed = _train("sac2 SAC", "backward", "pass-through")
    _, reference = _train("none", "backward", "pass-through")
    assert checkpointed.calls > reference.calls  # relu and the views run again under it; saved mms do not


def test_a_mode_pushed_inside_the_checkpointed_function_runs_in_forward_and_recompute():
    inner = _PassThrough()

    def block(x: torch.Tensor) -> torch.Tensor:
        with inner:
            return torch.relu(x @ x.t()).sum(0)

    x = torch.randn(4, 4, requires_grad=True)
    y = x.detach().requires_grad_()
    (want,) = torch.autograd.grad(block(y).sum(), [y])
    inner.calls = 0
    out = sac2.checkpoint(block, x, use_reentrant=False, context_fn=contexts(_MM))
    forward_calls = inner.calls
    (got,) = torch.autograd.grad(out.sum(), [x])
    assert torch.equal(got, want)
    assert inner.calls > forward_calls  # recompute ran under it too


def test_recompute_that_runs_another_decision_op_still_reports_the_op_and_its_position():
    calls = {"n": 0}

    def block(x: torch.Tensor) -> torch.Tensor:
        calls["n"] += 1
        y = x @ x if calls["n"] == 1 else x * x  # forward and recompute run different ops
        return torch.relu(y).sum()

    out = sac2.checkpoint(block, torch.randn(3, 3, requires_grad=True), use_reentrant=False,
                          context_fn=contexts(_MM))
    with pytest.raises(RuntimeError, match=r"recompute diverged from forward at op 0 .*aten\.mm.*aten\.mul"):
        out.backward()


def _profiled(run: Callable[[_Blocks, torch.Tensor], torch.Tensor]) -> dict[str, int]:
    model = _Blocks()
    x = torch.randn(4, 3, 16, requires_grad=True)
    with torch.profiler.profile() as prof:
        run(model, x).sum().backward()
    return {e.key: e.count for e in prof.key_averages()}


def test_torch_profiler_sees_the_ops_recompute_runs_again():
    # (sac2's mode redispatches each op it runs, and the profiler counts both entries: compare presence only)
    plain, checkpointed = _profiled(_plain), _profiled(_sac)
    assert checkpointed["aten::relu"] > plain["aten::relu"]  # recompute runs relu again
    assert "aten::addmm" in checkpointed


def test_under_fake_tensors_a_flop_counter_estimates_the_recompute_at_full_size():
    from torch._subclasses.fake_tensor import FakeTensorMode

    n, d = 8192, 4096  # 256 MiB per activation: estimated, never allocated
    with FakeTensorMode(allow_non_fake_inputs=True):
        block = nn.Sequential(nn.Linear(d, d, bias=False), nn.ReLU(), nn.Linear(d, d, bias=False))
        out = sac2.checkpoint(block, torch.randn(n, d, requires_grad=True), use_reentrant=False).sum()
        with FlopCounterMode(display=False) as counter:
            out.backward()
    unit = 2 * n * d * d  # one matmul
    assert counter.get_total_flops() == 4 * unit + 1 * unit  # four gradient matmuls; recompute stops after the first
