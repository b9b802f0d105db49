"""sac2 under torch.distributed.pipelining: 2 gloo ranks, 4 microbatches, 2-block MLP stages (2 per rank for the
multi-stage schedules: looped r and r+2, V-shaped r and 3-r).

Every cell compares each stage parameter's gradient and the last stage's losses with the same schedule run without
checkpointing, bitwise, and checks that ``sac2.forward_count()`` moved on both ranks (a cell that ran torch's SAC
instead fails). The cells are a covering set, not the full product: every schedule torch 2.13 ships with
``sac2.checkpoint_wrapper``; every entry point (``sac2.checkpoint_wrapper``, ``sac2.apply_ac`` selective with
``llm()`` and with a save list, ``apply_ac(mode="regions")``, torch's ``checkpoint_wrapper`` and torch's
``checkpoint`` under ``sac2.install()``) on 1F1B (full backward) and on ZBVZeroBubble (split backward: input
gradients first, weight gradients later). Stock SAC (torch's ``create_selective_checkpoint_contexts``) runs on
every schedule: it matches on the full-backward ones and raises on each split-backward one.
"""

from __future__ import annotations

import pytest

from .launch import run_ranks

SCHEDULES = ["GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"]
SPLIT_BACKWARD = ["InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"]
FULL_BACKWARD = [s for s in SCHEDULES if s not in SPLIT_BACKWARD]
ENTRIES = ["sac2_wrapper", "apply_ac", "apply_ac_save_list", "regions", "torch_wrapper", "torch_checkpoint"]
SAC2_CELLS = [f"{s}:sac2_wrapper" for s in SCHEDULES] + [
    f"{s}:{e}" for s in ("1F1B", "ZBVZeroBubble") for e in ENTRIES if e != "sac2_wrapper"
]
STOCK_CELLS = [f"{s}:stock" for s in FULL_BACKWARD]
#: stages per rank, and forwards per stage per step: 2 blocks x 4 microbatches (the stage's shape inference adds
#: one forward, not asserted)
STAGES_PER_RANK = {s: 1 if s in ("GPipe", "1F1B") else 2 for s in SCHEDULES}
STOCK_SAC_ERROR = "Trying to backward an extra time. You are only allowed to backward once on any region computed " \
    "under selective activation checkpoint."


@pytest.fixture(scope="module")
def cells() -> dict[str, list[dict]]:
    """Both ranks' reports of every cell that is expected to succeed (one launch), by cell."""
    ranks = run_ranks("pp_worker.py", *SAC2_CELLS, *STOCK_CELLS, timeout_s=240)
    return {cell: [r["cells"][cell] for r in ranks if r is not None] for cell in SAC2_CELLS + STOCK_CELLS}


def _assert_same_as_no_checkpointing(reports: list[dict]) -> None:
    assert len(reports) == 2
    for rank, report in enumerate(reports):
        assert report["grads_equal"] and not report["some_grad_missing"], f"rank {rank}: {report}"
        assert report["losses_equal"], f"rank {rank}: {report}"
    assert sorted(r["n_losses"] for r in reports) == [0, 4]  # the rank with the last stage saw 4 microbatch losses


@pytest.mark.parametrize("cell", SAC2_CELLS)
def test_sac2_gives_the_gradients_and_losses_of_the_schedule_without_checkpointing(cells, cell):
    _assert_same_as_no_checkpointing(cells[cell])


@pytest.mark.parametrize("cell", SAC2_CELLS)
def test_sac2_ran_every_checkpointed_forward(cells, cell):
    schedule = cell.split(":")[0]
    for report in cells[cell]:
        assert report["moved"] >= 2 * 4 * STAGES_PER_RANK[schedule]


@pytest.mark.parametrize("schedule", FULL_BACKWARD)
def test_stock_sac_matches_on_full_backward_schedules(cells, schedule):
    reports = cells[f"{schedule}:stock"]
    _assert_same_as_no_checkpointing(reports)
    assert all(r["moved"] == 0 for r in reports)  # torch's own SAC ran, not sac2


@pytest.mark.parametrize("schedule", SPLIT_BACKWARD)
def test_stock_sac_raises_on_split_backward_schedules(schedule):
    """Stock SAC frees its cache in the input-gradient backward; the weight-gradient backward then raises (on at
    least one rank; its peer may see the connection close instead). sac2 passes the same schedule (above)."""
    ranks = run_ranks("pp_worker.py", f"{schedule}:stock", timeout_s=120, peer_may_fail=True)
    errors = [r["cells"][f"{schedule}:stock"].get("error", "") for r in ranks if r is not None]
    assert any(STOCK_SAC_ERROR in e for e in errors), errors
