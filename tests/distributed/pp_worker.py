"""One rank of tests/distributed/test_pipelining.py: run pipeline schedules over checkpointed stages.

Arguments: cells ``SCHEDULE:ENTRY`` (see ``SCHEDULES`` and ``ENTRIES``). Each cell builds the stages this rank holds
(2 MLP blocks each, weights seeded by stage index), runs one ``schedule.step`` of 4 microbatches and compares every
stage parameter's gradient and the losses with the same schedule without checkpointing (``ENTRY`` "none"), bitwise.
Rank r prints one JSON line: per cell, ``grads_equal``, ``losses_equal``, how far ``sac2.forward_count()`` moved,
or ``error`` (the exception's type and message) if the cell raised.
"""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.utils.checkpoint as tuc
from torch import nn
from torch.distributed.algorithms._checkpoint import checkpoint_wrapper as torch_cw
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import schedules as sch
from worker_exit import shut_down

import sac2

D, BATCH, MICROBATCHES = 16, 8, 4

#: schedule name -> (class, stage layout): "single" one stage per rank, "loop" stages r and r+2, "v" stages r, 3-r.
SCHEDULES: dict[str, tuple[type, str]] = {
    "GPipe": (sch.ScheduleGPipe, "single"),
    "1F1B": (sch.Schedule1F1B, "single"),
    "Interleaved1F1B": (sch.ScheduleInterleaved1F1B, "loop"),
    "LoopedBFS": (sch.ScheduleLoopedBFS, "loop"),
    "InterleavedZeroBubble": (sch.ScheduleInterleavedZeroBubble, "loop"),
    "ZBVZeroBubble": (sch.ScheduleZBVZeroBubble, "v"),
    "DualPipeV": (sch.ScheduleDualPipeV, "v"),
}

MATMULS = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)


def save_matmuls(_ctx, op, *args, **kwargs):
    """A policy written against torch's API (torch's names only): save the Linears' matmuls."""
    return tuc.CheckpointPolicy.MUST_SAVE if op in MATMULS else tuc.CheckpointPolicy.PREFER_RECOMPUTE


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(D, 2 * D)
        self.down = nn.Linear(2 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(x))).tanh()


class TorchCheckpointCall(nn.Module):
    """A block whose forward calls torch.utils.checkpoint.checkpoint itself (looked up at call time), as model code
    that checkpoints inside its own forward does."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        context_fn = functools.partial(tuc.create_selective_checkpoint_contexts, save_matmuls)
        return tuc.checkpoint(self.block, x, use_reentrant=False, context_fn=context_fn)


class Stage(nn.Module):
    def __init__(self, index: int) -> None:
        super().__init__()
        torch.manual_seed(index)
        self.layers = nn.ModuleList(Block() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def torch_contexts() -> Callable[[], object]:
    # Looked up when called: under sac2.install() torch's name is bound to sac2's function.
    return functools.partial(tuc.create_selective_checkpoint_contexts, save_matmuls)


#: entry point -> what it does to one block; "torch_wrapper" and "torch_checkpoint" run under sac2.install(),
#: "stock" is torch's checkpoint_wrapper with torch's own SAC contexts.
PER_BLOCK: dict[str, Callable[[nn.Module], nn.Module]] = {
    "sac2_wrapper": lambda block: sac2.checkpoint_wrapper(block, context_fn=functools.partial(
        sac2.create_selective_checkpoint_contexts, sac2.policies.llm())),
    "torch_wrapper": lambda block: torch_cw.checkpoint_wrapper(block, context_fn=torch_contexts()),
    "stock": lambda block: torch_cw.checkpoint_wrapper(block, context_fn=torch_contexts()),
    "torch_checkpoint": TorchCheckpointCall,
}
#: entry point -> what it does to a stage (sac2.apply_ac finds ``stage.layers``)
PER_STAGE: dict[str, Callable[[nn.Module], object]] = {
    "none": lambda _stage: None,
    "apply_ac": lambda stage: sac2.apply_ac(stage, "selective"),
    "apply_ac_save_list": lambda stage: sac2.apply_ac(stage, "selective", policy=list(MATMULS)),
    "regions": lambda stage: sac2.apply_ac(stage, "regions", save=["linear"]),
}


def checkpoint(stage: Stage, entry: str) -> None:
    """Put ``stage``'s blocks under the entry point ``entry``."""
    if entry in PER_BLOCK:
        for i, block in enumerate(stage.layers):
            stage.layers[i] = PER_BLOCK[entry](block)
    else:
        PER_STAGE[entry](stage)


def stage_indices(layout: str, rank: int) -> list[int]:
    return {"single": [rank], "loop": [rank, rank + 2], "v": [rank, 3 - rank]}[layout]


def run(schedule_name: str, entry: str, rank: int) -> dict:
    """One ``step`` of the schedule; the gradients (in parameter order) and the losses this rank sees."""
    cls, layout = SCHEDULES[schedule_name]
    indices = stage_indices(layout, rank)
    num_stages = 2 if layout == "single" else 4
    installation = sac2.install() if entry in ("torch_wrapper", "torch_checkpoint") else None
    try:
        modules = [Stage(i) for i in indices]
        for m in modules:
            checkpoint(m, entry)
        stages = [PipelineStage(m, i, num_stages, torch.device("cpu")) for m, i in zip(modules, indices, strict=True)]
        loss_fn = torch.nn.functional.mse_loss
        schedule = cls(stages[0], MICROBATCHES, loss_fn=loss_fn) if layout == "single" else cls(
            stages, MICROBATCHES, loss_fn=loss_fn)
        gen = torch.Generator().manual_seed(1234)
        x, target = torch.randn(BATCH, D, generator=gen), torch.randn(BATCH, D, generator=gen)
        first, last = 0 in indices, num_stages - 1 in indices
        losses: list[torch.Tensor] = []
        before = sac2.forward_count()
        args = (x,) if first else ()
        schedule.step(*args, target=target if last else None, losses=losses if last else None)
        moved = sac2.forward_count() - before
    finally:
        if installation is not None:
            installation.uninstall()
    grads = [p.grad for m in modules for p in m.parameters()]
    return {"grads": grads, "losses": [loss.detach() for loss in losses], "moved": moved}


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    references: dict[str, dict] = {}
    report: dict[str, dict] = {}
    for cell in sys.argv[1:]:
        schedule_name, entry = cell.split(":")
        if schedule_name not in references:
            references[schedule_name] = run(schedule_name, "none", rank)
        ref = references[schedule_name]
        try:
            got = run(schedule_name, entry, rank)
        except Exception as e:  # noqa: BLE001 - reported, the test asserts on it
            print(json.dumps({"rank": rank, "cells": {**report, cell: {"error": f"{type(e).__name__}: {e}"}}}),
                  flush=True)
            raise
        report[cell] = {
            "grads_equal": all(g is not None and r is not None and torch.equal(g, r)
                               for g, r in zip(got["grads"], ref["grads"], strict=True)),
            "some_grad_missing": any(g is None for g in got["grads"]),
            "losses_equal": len(got["losses"]) == len(ref["losses"])
            and all(torch.equal(a, b) for a, b in zip(got["losses"], ref["losses"], strict=True)),
            "n_losses": len(got["losses"]),
            "moved": got["moved"],
        }
    print(json.dumps({"rank": rank, "cells": report}), flush=True)
    shut_down()


if __name__ == "__main__":
    main()
