"""One rank of tests/distributed/test_fsdp2.py: train 4 sac2-checkpointed blocks under FSDP2 and report losses and
collectives.

Launched with torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT). Rank 0 prints one JSON line:
per AC mode, the 3 step losses and how many times the blocks' functional all_reduce and the Linears' addmm actually
ran.
"""

import json
import os

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils._python_dispatch import TorchDispatchMode
from worker_exit import shut_down

import sac2

ALL_REDUCE = torch.ops._c10d_functional.all_reduce.default
ADDMM = torch.ops.aten.addmm.default


class Block(nn.Module):
    """An MLP block whose output is scaled by an all-reduced statistic, as sequence-parallel norms do."""

    def __init__(self, d: int, mesh) -> None:
        super().__init__()
        self.up = nn.Linear(d, 2 * d)
        self.down = nn.Linear(2 * d, d)
        self.mesh = mesh

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.down(torch.nn.functional.gelu(self.up(x)))
        total = funcol.all_reduce(h.detach().pow(2).mean(), "sum", self.mesh)
        return x + h * torch.rsqrt(total + 1.0)


class Model(nn.Module):
    def __init__(self, d: int, mesh) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block(d, mesh) for _ in range(4))
        self.head = nn.Linear(d, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x).pow(2).mean()


class CountOps(TorchDispatchMode):
    """Counts executions of the functional all_reduce and of addmm (the Linears' forward); a saved op or region is
    served by sac2 and never reaches this mode."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = {ALL_REDUCE: 0, ADDMM: 0}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self.calls:
            self.calls[func] += 1
        return func(*args, **(kwargs or {}))


def train(mode: str, mesh, rank: int) -> dict:
    torch.manual_seed(0)
    model = Model(16, mesh)
    if mode == "regions":  # the Linears' calls made regions and saved (the dispatch-free pair; FSDP2 shards them)
        sac2.apply_ac(model, "regions", save=["linear"])
    elif mode != "none":  # "selective": sac2.policies.llm(), which saves _c10d_functional.all_reduce
        sac2.apply_ac(model, mode)
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(rank))
    losses, counter = [], CountOps()
    for _ in range(3):
        with counter:
            loss = model(x)
            loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "all_reduce_calls": counter.calls[ALL_REDUCE], "addmm_calls": counter.calls[ADDMM]}


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    result = {mode: train(mode, mesh, rank) for mode in ("none", "selective", "full", "regions")}
    if rank == 0:
        print(json.dumps(result), flush=True)
    shut_down()


if __name__ == "__main__":
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "0")
    main()
