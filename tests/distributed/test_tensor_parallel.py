"""sac2 with tensor parallelism: two gloo ranks train FSDP2 over DTensor (Colwise/Rowwise) blocks; selective and
full AC give exactly the losses and weights of training without checkpointing."""

import pytest

from .launch import rank0


@pytest.fixture(scope="module")
def result() -> dict:
    return rank0("tp_worker.py", timeout_s=90)


@pytest.mark.parametrize("mode", ["selective", "full", "regions"])
def test_training_matches_no_checkpointing_exactly(result, mode):
    assert result[mode] == result["none"]
