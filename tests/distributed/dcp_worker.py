"""One rank of tests/distributed/test_dcp.py: save a checkpointed FSDP2 model with torch.distributed.checkpoint
(DCP) and load it into a model under another checkpointing mode, per direction.

Arguments: a directory both ranks write to, then directions ``SRC>DST`` (modes of tests/distributed/models.py).
Per direction: the ``SRC`` model (seed 0) trains one AdamW step and is saved; the ``DST`` model (seed 1, other
weights) loads it. Both then train 2 more steps from fresh optimizers on the same batches. Rank r prints one JSON
line: per direction, whether the two state dicts have the same keys, whether the weights differed before loading,
both models' losses after loading, whether their final full parameters are equal bitwise, and how far
``sac2.forward_count()`` moved while each trained.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from models import Model, batch, checkpoint
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from worker_exit import shut_down

import sac2


def sharded(mode: str, seed: int, mesh) -> Any:
    model = checkpoint(Model(seed), mode)
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def train(model: torch.nn.Module, rank: int, steps: range) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in steps:
        loss = model(batch(rank, step))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def direction(root: Path, src_mode: str, dst_mode: str, mesh, rank: int) -> dict:
    path = str(root / f"{src_mode}-to-{dst_mode}")
    src_before = sac2.forward_count()
    src = sharded(src_mode, 0, mesh)
    train(src, rank, range(1))
    dcp.save(  # type: ignore[attr-defined]  # torch.distributed.checkpoint re-exports it without __all__
        {"model": src.state_dict()}, checkpoint_id=path)
    dst = sharded(dst_mode, 1, mesh)
    differed = not all(_equal_params(src, dst))
    state = {"model": dst.state_dict()}
    keys_equal = sorted(state["model"]) == sorted(src.state_dict())
    dcp.load(  # type: ignore[attr-defined]  # as dcp.save
        state, checkpoint_id=path)
    dst.load_state_dict(state["model"])
    src_losses = train(src, rank, range(1, 3))
    src_moved = sac2.forward_count() - src_before
    before = sac2.forward_count()
    dst_losses = train(dst, rank, range(1, 3))
    moved = sac2.forward_count() - before
    return {"keys_equal": keys_equal, "differed_before_load": differed, "src_losses": src_losses,
            "dst_losses": dst_losses, "params_equal": all(_equal_params(src, dst)), "src_moved": src_moved,
            "dst_moved": moved}


def _equal_params(a: Any, b: Any) -> list[bool]:
    pairs: list[tuple[Any, Any]] = list(zip(a.parameters(), b.parameters(), strict=True))  # DTensors
    return [torch.equal(p.full_tensor(), q.full_tensor()) for p, q in pairs]


def _modes(cell: str) -> tuple[str, str]:
    src, dst = cell.split(">")
    return src, dst


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    root = Path(sys.argv[1])
    report = {d: direction(root, *_modes(d), mesh, rank) for d in sys.argv[2:]}
    print(json.dumps({"rank": rank, "cells": report}), flush=True)
    shut_down()


if __name__ == "__main__":
    main()
