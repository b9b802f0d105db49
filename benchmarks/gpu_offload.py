"""GPU check of CPU offload: does it hide its copies behind compute, at sizes people train, beside the floor?

Two configs of a bf16 llama-style stack (d=2048, 8 blocks), each block checkpointed with sac2's frame:

- ``exposed``: seq 2048, batch 4; matmul and attention outputs offloaded (the stack of issue #43's table). A block's
  copy outlasts its compute, so no schedule can hide it: offload should run at its floor.
- ``hidden``: seq 8192, batch 1; each block's checkpoint input and attention output offloaded, the rest recomputed
  (DeepSpeed's and Megatron's case, long context). A block's compute outlasts its copy: offload should cost
  almost nothing over saving the same tensors on the device.

Rows per config, each its own turn of every step (rotated): ``save`` keeps the tensors offload moves on the device,
``offload`` moves them (``SaveList(..., offload=..., offload_inputs=...)``, what ``apply_ac(offload=...)`` builds),
``recompute all`` is full AC. Timed as people train: no deterministic algorithms, a synchronize at the end of each
step only; medians. The floor is ``max(forward, copy to host) + max(backward, copy back)``: save's forward and
backward (timed apart, with a synchronize between), each copy the bytes offload moves (save's kept memory less
offload's) at the bandwidth of one pinned copy of that size measured beside it. Memory (kept after forward, peak) is
measured in an untimed step; flat means 20 offload steps leave the same device memory allocated and the same
pinned pool. Bitwise equality of offload's gradients with save's is checked in a separate pass under
``sac2.measure.determinism.deterministic_kernels``. The verdicts the GPU check asks for are printed per config:
offload's step within 1.10x the larger of save's step and the floor (1.05x save's where compute hides the copy),
its peak within recompute-all's plus one block's offloaded bytes, its memory flat, its gradients bitwise.

    python benchmarks/gpu_offload.py --json offload.json    # one GPU, about a minute on an H200
    python benchmarks/gpu_offload.py --smoke                # CPU, tiny, through sac2.offload.standin: the tests' run
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

import sac2
from sac2.core.decisions import SaveList
from sac2.measure.determinism import deterministic_kernels
from sac2.measure.rotation import turns
from sac2.offload import link as links
from sac2.offload import schedule
from sac2.offload.standin import stand_in

aten = torch.ops.aten
SDPA = (aten._scaled_dot_product_flash_attention.default, aten._scaled_dot_product_efficient_attention.default,
        aten._scaled_dot_product_cudnn_attention.default, aten._scaled_dot_product_flash_attention_for_cpu.default)
MATMULS = (aten.mm.default,)
ROWS = ("save", "offload", "recompute all")


@dataclass(frozen=True)
class Config:
    dim: int
    heads: int
    ffn: int
    layers: int
    seq: int
    batch: int
    offload: str  # "ops": matmul and attention outputs; "inputs+attention": checkpoint inputs and attention outputs
    steps: int = 10
    warmup: int = 3
    flat_steps: int = 20


CONFIGS = {
    "exposed": Config(2048, 16, 5632, 8, 2048, 4, "ops"),
    "hidden": Config(2048, 16, 5632, 8, 8192, 1, "inputs+attention"),
}
SMOKE = {
    "exposed": Config(32, 4, 64, 3, 16, 2, "ops", steps=2, warmup=1, flat_steps=3),
    "hidden": Config(32, 4, 64, 3, 32, 1, "inputs+attention", steps=2, warmup=1, flat_steps=3),
}


class Block(nn.Module):
    def __init__(self, c: Config) -> None:
        super().__init__()
        self.heads = c.heads
        self.n1, self.n2 = nn.RMSNorm(c.dim), nn.RMSNorm(c.dim)
        self.qkv, self.o = nn.Linear(c.dim, 3 * c.dim, bias=False), nn.Linear(c.dim, c.dim, bias=False)
        self.gate, self.up = nn.Linear(c.dim, c.ffn, bias=False), nn.Linear(c.dim, c.ffn, bias=False)
        self.down = nn.Linear(c.ffn, c.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.n1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        x = x + self.o(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d))
        h = self.n2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


def _context_fn(c: Config, row: str) -> Callable[[], Any] | None:
    """The row's ``context_fn`` (None: full AC)."""
    if row == "recompute all":
        return None
    keep = [*MATMULS, *SDPA] if c.offload == "ops" else list(SDPA)
    moving = row == "offload"
    policy = SaveList(keep, offload=keep if moving else (), offload_inputs=moving and c.offload != "ops")
    return functools.partial(sac2.create_selective_checkpoint_contexts, policy)


class Device:
    """What the bench measures on its device: CUDA's allocator and clock, or nothing on the CPU (``--smoke``)."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.cuda = device, device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def allocated(self) -> int:
        return torch.cuda.memory_allocated(self.device) if self.cuda else 0

    def peak(self) -> int:
        return torch.cuda.max_memory_allocated(self.device) if self.cuda else 0

    def reset_peak(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)


@dataclass
class Row:
    name: str
    kept_MiB: float = 0.0
    peak_MiB: float = 0.0
    step_ms: float = 0.0
    forward_ms: float = 0.0
    backward_ms: float = 0.0


def _step(blocks: nn.ModuleList, x: torch.Tensor, context_fn: Callable[[], Any] | None,
          after_forward: Callable[[torch.Tensor], None] | None = None) -> None:
    kwargs: dict[str, Any] = {} if context_fn is None else {"context_fn": context_fn}
    h = x * 1.0  # an activation, as an embedding gives: the first block's input moves too
    for block in blocks:
        h = sac2.checkpoint(block, h, **kwargs)
    loss = h.float().square().mean()
    if after_forward is not None:
        after_forward(loss)
    loss.backward()


def _memory(dev: Device, blocks: nn.ModuleList, x: torch.Tensor, context_fn: Any) -> tuple[int, int]:
    """(bytes forward keeps for backward, the step's peak over what was allocated before it)."""
    blocks.zero_grad(set_to_none=True)
    dev.sync()
    dev.reset_peak()
    base, kept = dev.allocated(), [0]

    def measure(_loss: torch.Tensor) -> None:
        dev.sync()  # the copies to the host have run: what stays is what forward keeps
        kept[0] = dev.allocated() - base

    _step(blocks, x, context_fn, measure)
    dev.sync()
    return kept[0], dev.peak() - base


def _split(dev: Device, blocks: nn.ModuleList, x: torch.Tensor, context_fn: Any, n: int) -> tuple[float, float]:
    """Median (forward, backward) seconds of ``n`` steps with a synchronize between them: the floor's compute."""
    forwards, backwards, marks = [], [], []

    def mark(_loss: torch.Tensor) -> None:
        dev.sync()
        marks.append(time.perf_counter())

    for _ in range(n):
        blocks.zero_grad(set_to_none=True)
        dev.sync()
        t0 = time.perf_counter()
        _step(blocks, x, context_fn, mark)
        dev.sync()
        forwards.append(marks[-1] - t0)
        backwards.append(time.perf_counter() - marks[-1])
    return statistics.median(forwards), statistics.median(backwards)


def copy_floor(dev: Device, nbytes: int) -> dict[str, float]:
    """One copy each way of ``nbytes`` between a pinned host buffer and the device, after a warm-up copy."""
    nbytes = max(nbytes, 1)
    src = torch.empty(nbytes, dtype=torch.uint8, device=dev.device)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=dev.cuda)
    host.copy_(src, non_blocking=True)
    dev.sync()
    t0 = time.perf_counter()
    host.copy_(src, non_blocking=True)
    dev.sync()
    d2h = time.perf_counter() - t0
    t0 = time.perf_counter()
    src.copy_(host, non_blocking=True)
    dev.sync()
    h2d = time.perf_counter() - t0
    return {"MiB": nbytes / 2**20, "d2h_ms": 1e3 * d2h, "h2d_ms": 1e3 * h2d,
            "d2h_GBps": nbytes / d2h / 1e9, "h2d_GBps": nbytes / h2d / 1e9}


def _flat(dev: Device, blocks: nn.ModuleList, x: torch.Tensor, context_fn: Any, n: int) -> dict[str, Any]:
    """Device memory allocated and pinned bytes the pool holds after each of ``n`` offload steps."""
    allocated, pooled = [], []
    for _ in range(n):
        blocks.zero_grad(set_to_none=True)
        _step(blocks, x, context_fn)
        dev.sync()
        allocated.append(dev.allocated())
        pooled.append(schedule.pool(links.current()).held)
    flat = len(set(allocated[1:])) == 1 and len(set(pooled[1:])) == 1
    return {"flat": flat, "allocated_MiB": [a / 2**20 for a in allocated], "pinned_MiB": [p / 2**20 for p in pooled]}


def _grads(blocks: nn.ModuleList, x: torch.Tensor) -> list[torch.Tensor]:
    return [x.grad.clone(), *(p.grad.clone() for p in blocks.parameters())]


def _bitwise(dev: Device, blocks: nn.ModuleList, x: torch.Tensor, c: Config) -> bool:
    """offload's gradients against save's, one step each under deterministic kernels (NaN-filling of torch.empty
    off: offload's buffers are written in full by their copies, and filling them would time nothing here)."""
    grads = {}
    deterministic: Any = torch.utils.deterministic  # its one setting is a module property the stubs do not know
    fill, deterministic.fill_uninitialized_memory = deterministic.fill_uninitialized_memory, False
    try:
        with deterministic_kernels(dev.device):
            for row in ("save", "offload"):
                blocks.zero_grad(set_to_none=True)
                x.grad = None
                _step(blocks, x, _context_fn(c, row))
                grads[row] = _grads(blocks, x)
    finally:
        deterministic.fill_uninitialized_memory = fill
    return all(torch.equal(a, b) for a, b in zip(grads["save"], grads["offload"], strict=True))


def run_config(name: str, c: Config, dev: Device, dtype: torch.dtype) -> dict[str, Any]:
    torch.manual_seed(0)
    blocks = nn.ModuleList(Block(c) for _ in range(c.layers)).to(dev.device, dtype)
    x = torch.randn(c.batch, c.seq, c.dim, device=dev.device, dtype=dtype, requires_grad=True)
    contexts = {row: _context_fn(c, row) for row in ROWS}
    rows = {row: Row(row) for row in ROWS}
    for row in ROWS:
        kept, peak = _memory(dev, blocks, x, contexts[row])
        rows[row].kept_MiB, rows[row].peak_MiB = kept / 2**20, peak / 2**20
    times: dict[str, list[float]] = {row: [] for row in ROWS}
    for step in range(c.warmup + c.steps):
        for i in turns(step, len(ROWS)):
            row = ROWS[i]
            blocks.zero_grad(set_to_none=True)
            dev.sync()
            t0 = time.perf_counter()
            _step(blocks, x, contexts[row])
            dev.sync()
            if step >= c.warmup:
                times[row].append(time.perf_counter() - t0)
    for row in ROWS:
        rows[row].step_ms = 1e3 * statistics.median(times[row])
    forward, backward = _split(dev, blocks, x, contexts["save"], c.steps)
    rows["save"].forward_ms, rows["save"].backward_ms = 1e3 * forward, 1e3 * backward
    save, off, full = rows["save"], rows["offload"], rows["recompute all"]
    moved = int((save.kept_MiB - off.kept_MiB) * 2**20)
    floor = copy_floor(dev, moved)
    floor_ms = max(save.forward_ms, floor["d2h_ms"]) + max(save.backward_ms, floor["h2d_ms"])
    block_MiB = (save.kept_MiB - full.kept_MiB) / c.layers
    flat = _flat(dev, blocks, x, contexts["offload"], c.flat_steps)
    equal = _bitwise(dev, blocks, x, c)
    hidden = save.forward_ms >= floor["d2h_ms"] and save.backward_ms >= floor["h2d_ms"]
    verdicts = {
        "step_vs_max_of_save_and_floor": off.step_ms / max(save.step_ms, floor_ms),
        "step_vs_save": off.step_ms / save.step_ms,
        "compute_hides_the_copy": hidden,
        "peak_within_recompute_all_plus_one_block": off.peak_MiB <= full.peak_MiB + block_MiB,
        "memory_flat_over_steps": flat["flat"],
        "grads_bitwise_equal_to_save": equal,
    }
    return {"config": name, **asdict(c), "rows": [asdict(r) for r in rows.values()], "copy": floor,
            "floor_ms": floor_ms, "one_block_MiB": block_MiB, "flat": flat, "verdicts": verdicts}


def report(result: dict[str, Any]) -> str:
    c, v, copy = result, result["verdicts"], result["copy"]
    lines = [f"== {c['config']}: d={c['dim']}, {c['layers']} blocks, seq {c['seq']}, batch {c['batch']}, "
             f"offloading {c['offload']}",
             f"{'row':<14} {'kept MiB':>9} {'peak MiB':>9} {'step ms':>8} {'fwd ms':>7} {'bwd ms':>7}"]
    for r in c["rows"]:
        lines.append(f"{r['name']:<14} {r['kept_MiB']:>9.1f} {r['peak_MiB']:>9.1f} {r['step_ms']:>8.1f} "
                     f"{r['forward_ms']:>7.1f} {r['backward_ms']:>7.1f}")
    lines += [
        f"moved {copy['MiB']:.0f} MiB each way: to host {copy['d2h_ms']:.1f} ms ({copy['d2h_GBps']:.1f} GB/s), back "
        f"{copy['h2d_ms']:.1f} ms ({copy['h2d_GBps']:.1f} GB/s); floor max(fwd, to host) + max(bwd, back) = "
        f"{c['floor_ms']:.1f} ms; compute hides the copy: {v['compute_hides_the_copy']}",
        f"offload step / max(save step, floor) = {v['step_vs_max_of_save_and_floor']:.3f} (target <= 1.10); "
        f"/ save step = {v['step_vs_save']:.3f}"
        + (" (target <= 1.05: compute hides the copy)" if v["compute_hides_the_copy"] else ""),
        f"peak within recompute all's + one block's offloaded bytes ({c['one_block_MiB']:.1f} MiB): "
        f"{v['peak_within_recompute_all_plus_one_block']}; memory flat over {c['flat_steps']} steps: "
        f"{v['memory_flat_over_steps']}; gradients bitwise equal to save (deterministic pass): "
        f"{v['grads_bitwise_equal_to_save']}",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", metavar="FILE", help="also write the results to this JSON file")
    parser.add_argument("--smoke", action="store_true", help="tiny configs on the CPU, through the stand-in")
    parser.add_argument("--config", choices=sorted(CONFIGS), action="append", help="only these configs")
    args = parser.parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        print("gpu_offload: needs a CUDA device (or --smoke)", file=sys.stderr)
        return 2
    configs = SMOKE if args.smoke else CONFIGS
    dev = Device(torch.device("cpu" if args.smoke else "cuda"))
    dtype = torch.float32 if args.smoke else torch.bfloat16
    results = []
    with stand_in() if args.smoke else contextlib.nullcontext() as link:
        if link is not None:
            print("--smoke: the CPU stand-in for a device (sac2.offload.standin): times and memory mean nothing here")
        for name in args.config or list(configs):
            before = len(link.log) if link is not None else 0
            results.append(run_config(name, configs[name], dev, dtype))
            if link is not None:  # what crossed the stand-in's host link, each way
                results[-1]["standin_copies"] = {kind: sum(1 for k, _ in link.log[before:] if k == kind)
                                                 for kind in ("to_host", "to_device")}
            print(report(results[-1]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            device = torch.cuda.get_device_name() if dev.cuda else "cpu (sac2.offload.standin)"
            json.dump({"device": device, "torch": torch.__version__, "results": results}, f, indent=2)
    return 0 if all(r["verdicts"]["grads_bitwise_equal_to_save"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
