"""GPU benchmark of eager CPU offload: activation memory saved and step-time cost against plain saving.

Usage: ``python benchmarks/gpu_offload.py [--json FILE]`` on a CUDA machine (about a minute on an H200). A
llama-style stack is checkpointed per block with three policies over the same ops (matmuls and attention kept, the rest
recomputed): MUST_SAVE keeps them on the GPU, MUST_CPU_OFFLOAD moves them to pinned host memory, and full
recompute keeps nothing. For each: GPU memory still allocated after forward (what forward keeps for backward,
outputs included), peak of the step, and median step time. Gradients of the offload run are checked bit for
bit against the save run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

import sac2
from sac2.answers import CheckpointPolicy

aten = torch.ops.aten
KEEP = {aten.mm.default, aten._scaled_dot_product_flash_attention.default,
        aten._scaled_dot_product_efficient_attention.default, aten._scaled_dot_product_cudnn_attention.default}
DIM, HEADS, FFN, LAYERS, SEQ, BATCH = 2048, 16, 5632, 8, 2048, 4
STEPS, WARMUP = 10, 3


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.n1, self.n2 = nn.RMSNorm(DIM), nn.RMSNorm(DIM)
        self.qkv, self.o = nn.Linear(DIM, 3 * DIM, bias=False), nn.Linear(DIM, DIM, bias=False)
        self.gate, self.up = nn.Linear(DIM, FFN, bias=False), nn.Linear(DIM, FFN, bias=False)
        self.down = nn.Linear(FFN, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.n1(x)).view(b, t, 3, HEADS, d // HEADS).permute(2, 0, 3, 1, 4)
        x = x + self.o(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d))
        h = self.n2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


def _policy(keep: CheckpointPolicy | None):
    def policy(_ctx, op, *args, **kwargs):
        return keep if keep is not None and op in KEEP else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def _step(blocks: nn.ModuleList, x: torch.Tensor, policy) -> tuple[int, torch.Tensor]:
    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated()
    h = x
    for block in blocks:
        h = sac2.checkpoint(block, h, context_fn=lambda: sac2.create_selective_checkpoint_contexts(policy))
    loss = h.float().square().mean()
    torch.cuda.synchronize()  # offload copies finish on the side stream before the memory reading below
    kept = torch.cuda.memory_allocated() - start
    loss.backward()
    return kept, loss


def run(name: str, blocks: nn.ModuleList, x: torch.Tensor, policy) -> tuple[dict, list[torch.Tensor]]:
    times = []
    for i in range(WARMUP + STEPS):
        blocks.zero_grad(set_to_none=True)
        x.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        t0 = time.perf_counter()
        kept, _ = _step(blocks, x, policy)
        torch.cuda.synchronize()
        if i >= WARMUP:
            times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated() - base
    grads = [x.grad.clone(), *(p.grad.clone() for p in blocks.parameters())]
    return {"policy": name, "kept_MiB": kept / 2**20, "peak_MiB": peak / 2**20,
            "step_ms": 1e3 * statistics.median(times)}, grads


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", metavar="FILE", help="also write the table to this JSON file")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_offload: needs a CUDA device", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    blocks = nn.ModuleList(Block() for _ in range(LAYERS)).cuda().to(torch.bfloat16)
    x = torch.randn(BATCH, SEQ, DIM, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    rows, grads = [], {}
    for name, keep in (("save", CheckpointPolicy.MUST_SAVE), ("cpu offload", CheckpointPolicy.MUST_CPU_OFFLOAD),
                       ("recompute all", None)):
        row, grads[name] = run(name, blocks, x, _policy(keep))
        rows.append(row)
    same = all(torch.equal(a, b) for a, b in zip(grads["save"], grads["cpu offload"], strict=True))
    print(f"{'policy':<14} {'kept MiB':>10} {'peak MiB':>10} {'step ms':>9}")
    for r in rows:
        print(f"{r['policy']:<14} {r['kept_MiB']:>10.1f} {r['peak_MiB']:>10.1f} {r['step_ms']:>9.1f}")
    save, off = rows[0], rows[1]
    print(f"offload keeps {save['kept_MiB'] - off['kept_MiB']:.1f} MiB less than save, "
          f"step time x{off['step_ms'] / save['step_ms']:.2f}; gradients bit-equal to save: {same}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows, "grads_equal_to_save": same}, f, indent=2)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
