"""sac2 under FSDP2: two gloo ranks train 4 checkpointed blocks; losses match, saved collectives do not re-run."""

import pytest
import torch

from .launch import rank0


@pytest.fixture(scope="module")
def result() -> dict:
    return rank0("fsdp2_worker.py", timeout_s=55)


@pytest.mark.parametrize("mode", ["selective", "full", "regions"])
def test_three_adamw_steps_give_the_losses_of_training_without_checkpointing(result, mode):
    torch.testing.assert_close(result[mode]["losses"], result["none"]["losses"])


def test_saved_functional_collective_is_not_rerun_in_backward(result):
    steps, blocks = 3, 4
    assert result["selective"]["all_reduce_calls"] == steps * blocks
    assert result["full"]["all_reduce_calls"] == 2 * steps * blocks  # full AC re-runs it: the counter sees recompute


def test_saved_linear_regions_are_not_rerun_in_backward(result):
    """Regions over FSDP2-sharded Linears: a saved region's matmul runs once per step, as without checkpointing,
    while the blocks' other ops (the all_reduce) are recomputed."""
    steps, blocks = 3, 4
    assert result["regions"]["addmm_calls"] == result["none"]["addmm_calls"]
    assert result["full"]["addmm_calls"] > result["none"]["addmm_calls"]
    assert result["regions"]["all_reduce_calls"] == 2 * steps * blocks
