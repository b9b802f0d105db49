"""sac2 under FSDP2 beyond one step per batch: gradient accumulation over 2 microbatches (the first under
``set_requires_gradient_sync(False)``, the second with it True) and ``reshard_after_forward=False``.

Two gloo ranks, ``fully_shard`` per block and at the root, 2 AdamW steps of the llama-like model in
tests/distributed/models.py, per mode: ``sac2.checkpoint_wrapper`` with ``llm()``, ``sac2.apply_ac`` selective,
``apply_ac(mode="regions")`` over the Linears and the attention kernel, and stock SAC (torch's
``checkpoint_wrapper`` and ``create_selective_checkpoint_contexts``). Each matches training without checkpointing
bitwise: the losses and the final full (unsharded) parameters. sac2's modes move ``sac2.forward_count()``; stock's
does not.
"""

from __future__ import annotations

import pytest

from .launch import run_ranks

SCENARIOS = ["accumulate", "no_reshard"]
SAC2_MODES = ["wrapper", "selective", "regions"]
#: checkpointed forwards per rank: 3 blocks x 2 steps, x 2 microbatches when accumulating
FORWARDS = {"accumulate": 12, "no_reshard": 6}


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    results = run_ranks("fsdp2_accum_worker.py", *SCENARIOS, timeout_s=240)
    return [r["cells"] for r in results if r is not None]


@pytest.mark.parametrize("mode", [*SAC2_MODES, "stock"])
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_losses_and_parameters_equal_training_without_checkpointing(ranks, scenario, mode):
    assert len(ranks) == 2
    for cells in ranks:
        cell = cells[f"{scenario}:{mode}"]
        assert cell["losses"] == cell["ref_losses"]
        assert cell["params_equal"]


@pytest.mark.parametrize("mode", SAC2_MODES)
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_sac2_ran_every_checkpointed_forward(ranks, scenario, mode):
    assert [cells[f"{scenario}:{mode}"]["moved"] for cells in ranks] == [FORWARDS[scenario]] * 2


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_stock_sac_does_not_run_sac2(ranks, scenario):
    assert [cells[f"{scenario}:stock"]["moved"] for cells in ranks] == [0, 0]
