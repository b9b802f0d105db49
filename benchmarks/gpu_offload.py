"""GPU benchmark of eager CPU offload: activation memory saved and step-time cost against plain saving.

Usage: ``python benchmarks/gpu_offload.py [--json FILE]`` on a CUDA machine (about a minute on an H200). A
llama-style stack is checkpointed per block with three policies over the same ops (matmuls and attention kept, the rest
recomputed): MUST_SAVE keeps them on the GPU, MUST_CPU_OFFLOAD moves them to pinned host memory, and full
recompute keeps nothing. For each: GPU memory still allocated after forward (what forward keeps for backward,
outputs included), peak of the step, median step time (and forward's share), and the device memory each step
leaves allocated (0 unless something leaks). Gradients of the offload run are checked bit for bit against the save
run, under ``sac2.measure.determinism.deterministic_kernels`` (without it attention's backward differs from run to
run; its NaN-filling of ``torch.empty`` is off, see ``main``). Beside them, the machine's own floor for the same
bytes: one pinned device-to-host and one host-to-device copy of everything offload moves, and what allocating that
much pinned memory costs; then the top entries of torch's profiler over one offload step, to show where its time
goes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import sac2
from sac2.core.decisions import CheckpointPolicy
from sac2.measure.determinism import deterministic_kernels

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


def _step(blocks: nn.ModuleList, x: torch.Tensor, policy) -> tuple[int, float]:
    """One step; what forward keeps for backward, and forward's share of the step's seconds."""
    torch.cuda.synchronize()
    start, t0 = torch.cuda.memory_allocated(), time.perf_counter()
    h = x
    for block in blocks:
        h = sac2.checkpoint(block, h, context_fn=lambda: sac2.create_selective_checkpoint_contexts(policy))
    loss = h.float().square().mean()
    torch.cuda.synchronize()  # offload copies finish on the side stream before the memory reading below
    kept, forward_s = torch.cuda.memory_allocated() - start, time.perf_counter() - t0
    loss.backward()
    return kept, forward_s


def run(name: str, blocks: nn.ModuleList, x: torch.Tensor, policy) -> tuple[dict, list[torch.Tensor]]:
    times, forwards, bases = [], [], []
    for i in range(WARMUP + STEPS):
        blocks.zero_grad(set_to_none=True)
        x.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        bases.append(base)
        t0 = time.perf_counter()
        kept, forward_s = _step(blocks, x, policy)
        torch.cuda.synchronize()
        if i >= WARMUP:
            times.append(time.perf_counter() - t0)
            forwards.append(forward_s)
    peak = torch.cuda.max_memory_allocated() - base
    grads = [x.grad.clone(), *(p.grad.clone() for p in blocks.parameters())]
    return {"policy": name, "kept_MiB": kept / 2**20, "peak_MiB": peak / 2**20,
            "step_ms": 1e3 * statistics.median(times), "forward_ms": 1e3 * statistics.median(forwards),
            "left_per_step_MiB": (bases[-1] - bases[WARMUP]) / (STEPS - 1) / 2**20}, grads


def copy_floor(nbytes: int) -> dict:
    """The host link's floor for moving ``nbytes`` each way (one pinned buffer, one copy each way, after a warm-up
    copy), and the time to allocate that much fresh pinned memory (``cudaHostAlloc`` behind torch's pinned
    allocator)."""
    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    alloc_s = time.perf_counter() - t0
    host.copy_(device, non_blocking=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    host.copy_(device, non_blocking=True)
    torch.cuda.synchronize()
    d2h_s = time.perf_counter() - t0
    device.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    h2d_s = time.perf_counter() - t0 - d2h_s
    return {"MiB": nbytes / 2**20, "pinned_alloc_ms": 1e3 * alloc_s, "d2h_ms": 1e3 * d2h_s, "h2d_ms": 1e3 * h2d_s,
            "d2h_GBps": nbytes / d2h_s / 1e9, "h2d_GBps": nbytes / h2d_s / 1e9}


def profile_step(blocks: nn.ModuleList, x: torch.Tensor, policy) -> str:
    """torch's profiler over one step: the entries that took the most CPU time of their own."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        _step(blocks, x, policy)
        torch.cuda.synchronize()
    return str(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=48))


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
    policies = (("save", CheckpointPolicy.MUST_SAVE), ("cpu offload", CheckpointPolicy.MUST_CPU_OFFLOAD),
                ("recompute all", None))
    # Deterministic mode fills every torch.empty with NaN; offload's pinned buffers are written in full by their
    # copy, and filling them first would time a CPU memset of everything offloaded (about 0.1 s per step here).
    deterministic: Any = torch.utils.deterministic  # its one setting is a module property the stubs do not know
    fill, deterministic.fill_uninitialized_memory = deterministic.fill_uninitialized_memory, False
    with deterministic_kernels(torch.device("cuda")):
        for name, keep in policies:
            row, grads[name] = run(name, blocks, x, _policy(keep))
            rows.append(row)
        save, off = rows[0], rows[1]
        floor = copy_floor(int((save["kept_MiB"] - off["kept_MiB"]) * 2**20))
        table = profile_step(blocks, x, _policy(CheckpointPolicy.MUST_CPU_OFFLOAD))
    deterministic.fill_uninitialized_memory = fill
    same = all(torch.equal(a, b) for a, b in zip(grads["save"], grads["cpu offload"], strict=True))
    print(f"{'policy':<14} {'kept MiB':>10} {'peak MiB':>10} {'step ms':>9} {'forward ms':>11} {'left/step MiB':>14}")
    for r in rows:
        print(f"{r['policy']:<14} {r['kept_MiB']:>10.1f} {r['peak_MiB']:>10.1f} {r['step_ms']:>9.1f} "
              f"{r['forward_ms']:>11.1f} {r['left_per_step_MiB']:>14.1f}")
    print("left/step: device memory still allocated after a step, per step (a step that frees what it made: 0)")
    print(f"offload keeps {save['kept_MiB'] - off['kept_MiB']:.1f} MiB less than save, "
          f"step time x{off['step_ms'] / save['step_ms']:.2f}; gradients bit-equal to save: {same}")
    print(f"floor for {floor['MiB']:.0f} MiB: device-to-host {floor['d2h_ms']:.1f} ms ({floor['d2h_GBps']:.1f} GB/s), "
          f"host-to-device {floor['h2d_ms']:.1f} ms ({floor['h2d_GBps']:.1f} GB/s); allocating it pinned "
          f"{floor['pinned_alloc_ms']:.1f} ms")
    print("one offload step under torch's profiler:")
    print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows, "grads_equal_to_save": same,
                       "copy_floor": floor}, f, indent=2)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
