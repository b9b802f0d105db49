"""sac2 with tensor parallelism: two gloo ranks train FSDP2 over DTensor (Colwise/Rowwise) blocks; selective and
full AC give exactly the losses and weights of training without checkpointing."""

import pytest
import torch

from .launch import run_ranks


@pytest.fixture(scope="module")
def result() -> dict:
    if not torch.distributed.is_available():
        pytest.skip("torch built without torch.distributed")
    rank0, _ = run_ranks("tp_worker.py", timeout_s=90)
    assert rank0 is not None
    return rank0


@pytest.mark.parametrize("mode", ["selective", "full", "regions"])
def test_training_matches_no_checkpointing_exactly(result, mode):
    assert result[mode] == result["none"]
