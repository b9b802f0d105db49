"""sac2.measure.memory measures what a forward keeps for backward, checked against cases whose answer is known."""

import gc

import pytest
import torch
import torch.utils.checkpoint as tuc

import sac2
from sac2.measure.memory import measure_step

N_OPS = 4


def _exp_chain(x: torch.Tensor) -> torch.Tensor:
    for _ in range(N_OPS):
        x = x.exp()  # exp saves its output for backward
    return x


def _input() -> torch.Tensor:
    return torch.randn(4096, requires_grad=True)


def _nbytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


def test_no_checkpointing_keeps_every_output_of_an_exp_chain():
    x = _input()
    memory, loss = measure_step(lambda: _exp_chain(x).sum(), "cpu")
    assert memory.kept == N_OPS * _nbytes(x) + _nbytes(loss)


def test_full_checkpointing_keeps_nothing_but_the_loss():
    x = _input()
    memory, loss = measure_step(
        lambda: tuc.checkpoint(_exp_chain, x, use_reentrant=False, preserve_rng_state=False).sum(), "cpu"
    )
    assert memory.kept == _nbytes(loss)


def test_outputs_sac2_saves_are_counted():
    x = _input()
    context_fn = lambda: sac2.create_selective_checkpoint_contexts([torch.ops.aten.exp.default])  # noqa: E731
    memory, loss = measure_step(
        lambda: sac2.checkpoint(_exp_chain, x, context_fn=context_fn, preserve_rng_state=False).sum(), "cpu"
    )
    assert memory.kept == N_OPS * _nbytes(x) + _nbytes(loss)


def test_outputs_stock_sac_saves_are_counted():
    x = _input()
    context_fn = lambda: tuc.create_selective_checkpoint_contexts([torch.ops.aten.exp.default])  # noqa: E731
    memory, loss = measure_step(
        lambda: tuc.checkpoint(
            _exp_chain, x, use_reentrant=False, context_fn=context_fn, preserve_rng_state=False
        ).sum(),
        "cpu",
    )
    assert memory.kept == N_OPS * _nbytes(x) + _nbytes(loss)


def test_peak_sees_a_temporary_freed_inside_forward():
    x = _input()
    big = []

    def forward():
        big.append(_nbytes(torch.ones(20 * x.numel())))  # allocated and freed at once
        return (x * 2).sum()

    memory, _ = measure_step(forward, "cpu")
    assert memory.peak == big[0]


def test_peak_sees_the_recompute_of_full_checkpointing_in_backward():
    x = _input()
    memory, _ = measure_step(lambda: tuc.checkpoint(_exp_chain, x, use_reentrant=False).sum(), "cpu")
    assert memory.peak >= N_OPS * _nbytes(x)  # recompute materialises every output at once


def test_a_block_allocated_before_the_step_and_freed_inside_it_is_not_counted():
    class Cycle:  # only the cycle collector frees it, whenever it runs
        def __init__(self, t):
            self.me, self.t = self, t

    x = _input()
    held = []

    def allocating_forward():
        held.append(Cycle(torch.randn(4 * x.numel())))
        return (x * 2).sum()

    measure_step(allocating_forward, "cpu")

    def forward():
        gc.collect()  # frees the earlier step's block in this step's window
        return _exp_chain(x).sum()

    gc.disable()  # no automatic collection frees it before the window opens
    try:
        held.clear()
        memory, loss = measure_step(forward, "cpu")
    finally:
        gc.enable()
    assert memory.kept == N_OPS * _nbytes(x) + _nbytes(loss)


def test_backward_ran():
    x = _input()
    measure_step(lambda: _exp_chain(x).sum(), "cpu")
    assert x.grad is not None


def test_unsupported_device_is_an_error_naming_it():
    with pytest.raises(ValueError, match="cannot measure memory on meta"):
        measure_step(lambda: torch.zeros((), device="meta"), "meta")
