"""Per-op cost of selective checkpointing: sac2's modes against torch's stock SAC, full checkpointing and none.

Single thread. Two workloads: a chain of 100 tiny pointwise ops (alternating sin and cos on 16 floats), where
dispatch overhead is everything, and the tiny llama-style model of ``sac2.bench.models`` (each block checkpointed).
Two policies: "save nothing" and a save list (cos for the chain; ``sac2.policies.llm_save_list()`` for the
model). The modes take turns sample by sample in one process. Time is this thread's CPU time, so other processes
competing for the cores do not count. Prints the median forward+backward time per op (ops counted in forward)
and, per workload and policy, how much of stock SAC's extra cost over full checkpointing sac2 pays:
``(sac2 - full) / (stock - full)``; lower is better, the target is <= 0.5.

Beside each ratio it prints the floor: the same for a pair of do-nothing Python TorchDispatchModes (one for
forward, one for recompute, each just calling the op) in full checkpointing's ``context_fn``. No SAC built on
Python dispatch modes can cost less than that.

Then, from ``sac2.bench.length_curve.curve``, the per-op cost of a 16-op and a 1,024-op region (the same chain, the
same save list) under sac2 and stock SAC side by side, and how sac2's long-region cost compares with its
short-region cost: ``sac2(1024) / sac2(16)``; the target is <= 1.15 (per-op cost does not grow with region length).

    python benchmarks/overhead.py [--repeat 30] [--lengths 16,1024]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from typing import Any, Callable

import torch
import torch.utils.checkpoint as tuc
from torch.utils._python_dispatch import TorchDispatchMode

import sac2
from sac2.bench.length_curve import curve
from sac2.bench.models import CONFIGS, Transformer, random_tokens
from sac2.measure.rotation import turns
from sac2.policies import llm_save_list

CHAIN_LEN = 100


def _chain(x: torch.Tensor) -> torch.Tensor:
    for i in range(CHAIN_LEN):
        x = x.sin() if i % 2 == 0 else x.cos()
    return x


def _save_nothing(_ctx: Any, _op: Any, *args: Any, **kwargs: Any) -> tuc.CheckpointPolicy:
    return tuc.CheckpointPolicy.PREFER_RECOMPUTE


class _Nothing(TorchDispatchMode):
    """The cheapest Python dispatch mode there is: call the op."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **kwargs) if kwargs else func(*args)


def _nothing_pair() -> tuple[_Nothing, _Nothing]:
    return _Nothing(), _Nothing()


class _CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


def _wrap(kind: str, policy: Any) -> Callable[[Callable, torch.Tensor], torch.Tensor]:
    """How to run a region ``fn(x)`` under one mode."""
    if kind == "none":
        return lambda fn, x: fn(x)
    if kind == "full":
        return lambda fn, x: tuc.checkpoint(fn, x, use_reentrant=False)
    if kind == "floor":
        return lambda fn, x: tuc.checkpoint(fn, x, use_reentrant=False, context_fn=_nothing_pair)
    if kind == "stock":
        ctx = functools.partial(tuc.create_selective_checkpoint_contexts, policy)
        return lambda fn, x: tuc.checkpoint(fn, x, use_reentrant=False, context_fn=ctx)
    ctx = functools.partial(sac2.create_selective_checkpoint_contexts, policy)
    return lambda fn, x: sac2.checkpoint(fn, x, context_fn=ctx)


def _workloads() -> dict[str, tuple[Callable[[Callable], None], int, int]]:
    """name -> (one forward+backward under a region runner, ops in its forward, iterations per sample)."""
    x = torch.randn(16, requires_grad=True)

    def chain_step(run: Callable) -> None:
        run(_chain, x).sum().backward()

    cfg = CONFIGS["tiny"]
    torch.manual_seed(0)
    model = Transformer(cfg)
    tokens, targets = random_tokens(cfg, torch.Generator().manual_seed(0), torch.device("cpu"))

    def model_step(run: Callable) -> None:
        model(tokens, targets, run).backward()

    out: dict[str, tuple[Callable[[Callable], None], int, int]] = {}
    for name, step, iters in (("chain", chain_step, 20), ("tiny model", model_step, 3)):
        counter = _CountOps()
        with counter:
            if name == "chain":
                _chain(x)
            else:
                model(tokens, targets)
        out[name] = (step, counter.n, iters)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=30, help="timed samples per mode and workload")
    parser.add_argument("--lengths", default="16,1024", help="short and long region length of the length check")
    args = parser.parse_args(argv)
    short, long = (int(n) for n in args.lengths.split(","))
    torch.set_num_threads(1)
    policies = {"chain": {"save nothing": _save_nothing, "save list": [torch.ops.aten.cos.default]},
                "tiny model": {"save nothing": _save_nothing, "save list": list(llm_save_list())}}
    print(f"us/op, forward+backward, median of {args.repeat} samples, 1 thread")
    for workload, (step, n_ops, iters) in _workloads().items():
        modes = {"none": _wrap("none", None), "full": _wrap("full", None), "floor": _wrap("floor", None)}
        for pname, policy in policies[workload].items():
            modes[f"stock SAC ({pname})"] = _wrap("stock", policy)
            modes[f"sac2 ({pname})"] = _wrap("sac2", policy)
        samples: dict[str, list[float]] = {name: [] for name in modes}
        names = list(modes)
        for run in modes.values():  # warm up every path once
            step(run)
        for r in range(args.repeat):
            for name in (names[i] for i in turns(r, len(names))):
                start = time.thread_time()
                for _ in range(iters):
                    step(modes[name])
                samples[name].append((time.thread_time() - start) / iters / n_ops * 1e6)
        med = {name: statistics.median(s) for name, s in samples.items()}
        print(f"\n{workload} ({n_ops} ops in forward)")
        for name, us in med.items():
            label = "floor (2 do-nothing modes)" if name == "floor" else name
            print(f"  {label:<26} {us:7.2f} us/op")
        for pname in policies[workload]:
            stock = med[f"stock SAC ({pname})"] - med["full"]
            ratio = (med[f"sac2 ({pname})"] - med["full"]) / stock
            floor = (med["floor"] - med["full"]) / stock
            print(f"  ratio (sac2 - full)/(stock - full), {pname}: {ratio:.2f}   "
                  f"floor (do-nothing - full)/(stock - full): {floor:.2f}")
    data = curve((short, long), args.repeat)
    us = data["us_per_op"]
    print(f"\nregion length, {data['ops']}, {data['policy']}, us/op, median of {args.repeat}")
    print(f"  {'ops':>6} {'sac2':>8} {'stock SAC':>10} {'full':>8} {'none':>8}")
    for i, n in enumerate(data["lengths"]):
        print(f"  {n:>6} {us['sac2 SAC'][i]:8.2f} {us['stock SAC'][i]:10.2f} {us['full'][i]:8.2f} {us['none'][i]:8.2f}")
    growth = us["sac2 SAC"][1] / us["sac2 SAC"][0]
    stock_growth = us["stock SAC"][1] / us["stock SAC"][0]
    print(f"  length ratio sac2({long})/sac2({short}): {growth:.2f} (target <= 1.15; stock: {stock_growth:.2f})")


if __name__ == "__main__":
    main()
