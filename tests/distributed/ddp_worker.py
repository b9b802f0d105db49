"""One rank of tests/distributed/test_ddp.py: DistributedDataParallel over the model of tests/distributed/models.py,
per DDP configuration and checkpointing mode.

Arguments: configurations: ``static_graph`` (``static_graph=True``), ``find_unused`` (``find_unused_parameters=True``;
the model's ``spare`` Linear, there in these two, is never used), ``no_sync`` (2 microbatches per step, the first
under ``no_sync()``; no ``spare``).
Each trains 3 SGD steps. Rank r prints one JSON line: per configuration and mode, the losses, whether every
parameter's final value and last gradient equal those of the mode "none" bitwise, and how far
``sac2.forward_count()`` moved.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import torch
import torch.distributed as dist
from models import MODES, Model, batch, checkpoint
from torch.nn.parallel import DistributedDataParallel as DDP
from worker_exit import shut_down

import sac2

STEPS = 3
OPTIONS: dict[str, dict[str, Any]] = {
    "static_graph": {"static_graph": True},
    "find_unused": {"find_unused_parameters": True},
    "no_sync": {},
}


def train(config: str, mode: str, rank: int) -> tuple[list[float], list[torch.Tensor], int]:
    model = DDP(checkpoint(Model(spare=config != "no_sync"), mode), **OPTIONS[config])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    before = sac2.forward_count()
    for step in range(STEPS):
        opt.zero_grad()
        if config == "no_sync":
            with model.no_sync():
                loss = model(batch(rank, 2 * step))
                loss.backward()
            losses.append(loss.item())
            loss = model(batch(rank, 2 * step + 1))
        else:
            loss = model(batch(rank, step))
        loss.backward()
        losses.append(loss.item())
        opt.step()
    moved = sac2.forward_count() - before
    tensors = [p.detach().clone() for p in model.parameters()]
    tensors += [p.grad.clone() for p in model.parameters() if p.grad is not None]
    return losses, tensors, moved


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    report: dict[str, dict] = {}
    for config in sys.argv[1:]:
        ref_losses, ref_tensors, _ = train(config, "none", rank)
        for mode in MODES:
            losses, tensors, moved = train(config, mode, rank)
            report[f"{config}:{mode}"] = {
                "losses": losses, "ref_losses": ref_losses, "moved": moved,
                "params_and_grads_equal": len(tensors) == len(ref_tensors)
                and all(torch.equal(a, b) for a, b in zip(tensors, ref_tensors, strict=True)),
            }
    print(json.dumps({"rank": rank, "cells": report}), flush=True)
    shut_down()


if __name__ == "__main__":
    main()
