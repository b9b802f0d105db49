"""One rank of tests/distributed/test_tensor_parallel.py: FSDP2 over tensor-parallel (DTensor) blocks, checkpointed by
sac2.

Launched with torchrun's environment. The 2 ranks form a (dp=1, tp=2) mesh: each block's linears are split with
``ColwiseParallel``/``RowwiseParallel`` as torchtitan's TP does, then ``fully_shard``ed over dp. Rank 0 prints one
JSON line: per AC mode, the 3 step losses and the sum of every parameter after them.
"""

import json

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from worker_exit import shut_down

import sac2

aten = torch.ops.aten


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(d)
        self.up = nn.Linear(d, 4 * d, bias=False)
        self.down = nn.Linear(4 * d, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.silu(self.up(self.norm(x))))


class Model(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block(d) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x.pow(2).mean()


def train(mode: str, mesh) -> dict:
    torch.manual_seed(0)
    model = Model(16)
    for block in model.layers:
        parallelize_module(block, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    if mode == "selective":
        sac2.apply_ac(model, "selective", policy=[aten.mm.default])
    elif mode == "full":
        sac2.apply_ac(model, "full")
    elif mode == "regions":  # the tensor-parallel Linears' calls made regions and saved
        sac2.apply_ac(model, "regions", save=["linear"])
    for block in model.layers:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(1))
    losses = []
    for _ in range(3):
        loss = model(x)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    total = sum(float((p.full_tensor() if isinstance(p, DTensor) else p).sum()) for p in model.parameters())
    return {"losses": losses, "param_sum": total}


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (1, dist.get_world_size()), mesh_dim_names=("dp", "tp"))
    result = {mode: train(mode, mesh) for mode in ("none", "selective", "full", "regions")}
    if dist.get_rank() == 0:
        print(json.dumps(result), flush=True)
    shut_down()


if __name__ == "__main__":
    main()
