"""torch.distributed.checkpoint (DCP) between a sac2-checkpointed model and an unwrapped one, both directions.

Two gloo ranks, FSDP2-sharded models (tests/distributed/dcp_worker.py): a model under one mode trains a step and is
saved with ``dcp.save``; a model with other weights under the other mode loads it with ``dcp.load``. The state dicts
have the same keys (sac2's wrappers and regions add no prefix), and after loading the two train to the same losses
and parameters, bitwise. Modes: ``sac2.checkpoint_wrapper``, ``apply_ac`` selective and regions, and stock SAC
(torch's ``checkpoint_wrapper``) for comparison.
"""

from __future__ import annotations

import pytest

from .launch import run_ranks

MODES = ["wrapper", "selective", "regions", "stock"]
DIRECTIONS = [d for m in MODES for d in (f"none>{m}", f"{m}>none")]
#: checkpointed forwards per rank of a model that trains 3 steps (src: 1 before saving, 2 after) or 2 (dst) over 3
#: blocks
FORWARDS = {"src": 9, "dst": 6}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    results = run_ranks("dcp_worker.py", str(tmp_path_factory.mktemp("dcp")), *DIRECTIONS, timeout_s=240)
    return [r["cells"] for r in results if r is not None]


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_state_dict_keys_are_those_of_the_unwrapped_model(ranks, direction):
    assert len(ranks) == 2
    assert all(cells[direction]["keys_equal"] for cells in ranks)


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_loaded_model_trains_like_the_saved_one(ranks, direction):
    for cells in ranks:
        cell = cells[direction]
        assert cell["differed_before_load"]
        assert cell["dst_losses"] == cell["src_losses"]
        assert cell["params_equal"]


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_only_the_sac2_checkpointed_side_runs_sac2(ranks, direction):
    src, dst = direction.split(">")
    for cells in ranks:
        cell = cells[direction]
        for side, mode in (("src", src), ("dst", dst)):
            assert cell[f"{side}_moved"] == (FORWARDS[side] if mode not in ("none", "stock") else 0)
