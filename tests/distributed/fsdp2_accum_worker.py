"""One rank of tests/distributed/test_fsdp2_accumulation.py: FSDP2 (``fully_shard`` per block and at the root)
with gradient accumulation and with ``reshard_after_forward=False``, per checkpointing mode
(tests/distributed/models.py).

Arguments: scenarios (``accumulate``, ``no_reshard``). Each trains 2 AdamW steps; ``accumulate`` runs 2 microbatches
per step, the first under ``set_requires_gradient_sync(False)``. Rank 0 prints one JSON line: per scenario and mode,
the losses (floats, repr-exact), whether the final full parameters equal those of the mode "none" bitwise, and how
far ``sac2.forward_count()`` moved.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from models import MODES, Model, batch, checkpoint
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from worker_exit import shut_down

import sac2


def train(scenario: str, mode: str, mesh, rank: int) -> tuple[list[float], list[torch.Tensor], int]:
    model = checkpoint(Model(), mode)
    reshard = scenario != "no_reshard"
    for block in model.layers:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    before = sac2.forward_count()
    for step in range(2):
        if scenario == "accumulate":
            model.set_requires_gradient_sync(False)
            loss = model(batch(rank, 2 * step))
            loss.backward()
            losses.append(loss.item())
            model.set_requires_gradient_sync(True)
            loss = model(batch(rank, 2 * step + 1))
        else:
            loss = model(batch(rank, step))
        loss.backward()
        losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    moved = sac2.forward_count() - before
    params = [p.full_tensor() for p in model.parameters()]  # DTensors (the model is Any)
    return losses, params, moved


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    report: dict[str, dict] = {}
    for scenario in sys.argv[1:]:
        ref_losses, ref_params, _ = train(scenario, "none", mesh, rank)
        for mode in MODES:
            losses, params, moved = train(scenario, mode, mesh, rank)
            report[f"{scenario}:{mode}"] = {
                "losses": losses, "ref_losses": ref_losses, "moved": moved,
                "params_equal": all(torch.equal(a, b) for a, b in zip(params, ref_params, strict=True)),
            }
    print(json.dumps({"rank": rank, "cells": report}), flush=True)
    shut_down()


if __name__ == "__main__":
    main()
