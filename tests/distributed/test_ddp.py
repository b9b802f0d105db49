"""sac2 under DistributedDataParallel: ``static_graph=True`` and ``find_unused_parameters=True`` (the model has a
Linear it never calls) and ``no_sync()`` accumulation over 2 microbatches, 3 SGD steps on two gloo ranks.

Per mode (``sac2.checkpoint_wrapper`` with ``llm()``, ``sac2.apply_ac`` selective, ``apply_ac(mode="regions")``,
and stock SAC: torch's ``checkpoint_wrapper`` with torch's own contexts) the losses, the final parameters and the
last gradients equal those of the same DDP configuration without checkpointing, bitwise, on both ranks; sac2's
modes move ``sac2.forward_count()`` once per block per forward, stock's not at all.
"""

from __future__ import annotations

import pytest

from .launch import run_ranks

CONFIGS = ["static_graph", "find_unused", "no_sync"]
SAC2_MODES = ["wrapper", "selective", "regions"]
#: checkpointed forwards per rank: 3 blocks x 3 steps, x 2 microbatches under no_sync
FORWARDS = {"static_graph": 9, "find_unused": 9, "no_sync": 18}


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    results = run_ranks("ddp_worker.py", *CONFIGS, timeout_s=240)
    return [r["cells"] for r in results if r is not None]


@pytest.mark.parametrize("mode", [*SAC2_MODES, "stock"])
@pytest.mark.parametrize("config", CONFIGS)
def test_losses_parameters_and_gradients_equal_ddp_without_checkpointing(ranks, config, mode):
    assert len(ranks) == 2
    for cells in ranks:
        cell = cells[f"{config}:{mode}"]
        assert cell["losses"] == cell["ref_losses"]
        assert cell["params_and_grads_equal"]


@pytest.mark.parametrize("mode", SAC2_MODES)
@pytest.mark.parametrize("config", CONFIGS)
def test_sac2_ran_every_checkpointed_forward(ranks, config, mode):
    assert [cells[f"{config}:{mode}"]["moved"] for cells in ranks] == [FORWARDS[config]] * 2


@pytest.mark.parametrize("config", CONFIGS)
def test_stock_sac_does_not_run_sac2(ranks, config):
    assert [cells[f"{config}:stock"]["moved"] for cells in ranks] == [0, 0]
