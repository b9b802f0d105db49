"""``python -m sac2 bench``: train a small llama-style model under each checkpointing mode and compare them.

Modes: no checkpointing, full checkpointing, torch's stock SAC and sac2's SAC under the default LLM policy
(``sac2.policies.llm()``), and every other sac2 policy in ``SAC2_POLICIES`` whose module is present. Every mode
trains its own copy of one model on the same batches; the modes take turns step by step in one process (in a rotating order), so drift in machine
speed hits all of them alike. Step 0 of each mode measures memory (``sac2.memory``) and is not timed. After every
step, each mode's loss and gradients are compared with ``torch.equal`` to the no-checkpointing run's.
"""

from __future__ import annotations

import argparse
import copy
import functools
import importlib
import importlib.util
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.utils.checkpoint as tuc
from torch import nn

import sac2
from sac2.memory import measure_step
from sac2.models import CONFIGS, Transformer, random_tokens
from sac2.policies import llm

__all__ = ["SAC2_POLICIES", "Result", "run", "format_table", "main"]

RunBlock = Callable[[nn.Module, torch.Tensor], torch.Tensor]


def _call(*args: Any) -> Callable[..., Any]:
    return lambda make, model, x: make(*args)


def _budget(fraction: float) -> Callable[..., Any]:
    return lambda make, model, x: make(model.blocks[0], (x,), fraction)


#: The sac2 policies the bench runs besides the default, by row name: (module, function, how to call the function
#: given the model and an example block input). A row whose module or function is absent is skipped with a note.
SAC2_POLICIES: dict[str, tuple[str, str, Callable[[Callable[..., Any], nn.Module, torch.Tensor], Any]]] = {
    "sac2 every_other_matmul": ("sac2.policies", "every_other_matmul", _call()),
    "sac2 budget 0.3": ("sac2.policies.budget", "memory_budget", _budget(0.3)),
    "sac2 budget 0.5": ("sac2.policies.budget", "memory_budget", _budget(0.5)),
    "sac2 budget 0.7": ("sac2.policies.budget", "memory_budget", _budget(0.7)),
}


def _no_checkpoint(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return block(x)


def _full(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return tuc.checkpoint(block, x, use_reentrant=False)


def _stock(policy: Any) -> RunBlock:
    context_fn = functools.partial(tuc.create_selective_checkpoint_contexts, policy)
    return lambda block, x: tuc.checkpoint(block, x, use_reentrant=False, context_fn=context_fn)


def _sac2(policy: Any) -> RunBlock:
    context_fn = functools.partial(sac2.create_selective_checkpoint_contexts, policy)
    return lambda block, x: sac2.checkpoint(block, x, context_fn=context_fn)


@dataclass
class Result:
    """One row of the table: a mode's step times, memory and whether it matched no checkpointing."""

    name: str
    policy: str
    step_s: list[float] = field(default_factory=list)
    kept_bytes: int = 0
    peak_bytes: int = 0
    equal: bool = True

    @property
    def median_s(self) -> float:
        return statistics.median(self.step_s)


def _modes(model: Transformer, x: torch.Tensor, notes: list[str]) -> list[tuple[str, str, RunBlock]]:
    """(row name, policy description, how to run a block) for every mode, no checkpointing first."""
    default = llm()
    modes = [
        ("none", "-", _no_checkpoint),
        ("full", "recompute all", _full),
        ("stock SAC", repr(default), _stock(default)),
        ("sac2 SAC", repr(default), _sac2(default)),
    ]
    for name, (module, function, call) in SAC2_POLICIES.items():
        try:
            make = getattr(importlib.import_module(module), function)
        except (ImportError, AttributeError) as e:
            notes.append(f"skipped {name!r}: {e}")
            continue
        policy = call(make, model, x)
        modes.append((name, repr(policy), _sac2(policy)))
    return modes


class _Progress:
    """A one-line progress bar on stderr, drawn only when stderr is a terminal."""

    def __init__(self, total: int) -> None:
        self.total, self.done, self.on = total, 0, sys.stderr.isatty()

    def step(self) -> None:
        self.done += 1
        if self.on:
            filled = 30 * self.done // self.total
            sys.stderr.write(f"\r[{'#' * filled}{'.' * (30 - filled)}] {self.done}/{self.total}")
            if self.done == self.total:
                sys.stderr.write("\n")
            sys.stderr.flush()


def _equal(model: nn.Module, loss: torch.Tensor, ref_model: nn.Module, ref_loss: torch.Tensor) -> bool:
    if not torch.equal(loss, ref_loss):
        return False
    return all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), ref_model.parameters()))


def run(config: str = "small", steps: int = 5, device: str = "cpu", seed: int = 0) -> tuple[list[Result], list[str]]:
    """Train ``config`` for 1 + ``steps`` steps under every mode; return the rows and notes on skipped modes."""
    cfg = CONFIGS[config]
    dev = torch.device(device)
    torch.manual_seed(seed)
    base = Transformer(cfg).to(dev)
    gen = torch.Generator().manual_seed(seed)
    example = torch.randn(cfg.batch, cfg.seq_len, cfg.dim, device=dev, requires_grad=True)
    notes: list[str] = []
    if dev.type != "cuda":
        notes.append(
            "torch's own estimator-based greedy policy (torch.distributed._tools.sac_estimator) is not compared: "
            "in torch 2.13 its runtime estimates need CUDA"
        )
    modes = _modes(base, example, notes)
    models = [copy.deepcopy(base) for _ in modes]
    optims = [torch.optim.SGD(m.parameters(), lr=1e-3) for m in models]
    results = [Result(name, policy) for name, policy, _ in modes]
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    progress = _Progress((steps + 1) * len(modes))
    for step in range(steps + 1):
        tokens, targets = random_tokens(cfg, gen, dev)
        losses: list[torch.Tensor] = [torch.empty(0)] * len(modes)
        shift = step % len(modes)
        for i in [*range(shift, len(modes)), *range(shift)]:
            model, run_block = models[i], modes[i][2]
            forward = functools.partial(model, tokens, targets, run_block)
            optims[i].zero_grad(set_to_none=True)
            if step == 0:
                memory, losses[i] = measure_step(forward, dev)
                results[i].kept_bytes, results[i].peak_bytes = memory.kept, memory.peak
            else:
                sync()
                start = time.perf_counter()
                losses[i] = forward()
                losses[i].backward()
                optims[i].step()
                sync()
                results[i].step_s.append(time.perf_counter() - start)
            progress.step()
        for i in range(1, len(modes)):
            results[i].equal &= _equal(models[i], losses[i], models[0], losses[0])
        if step == 0:
            for opt in optims:
                opt.step()
    return results, notes


def format_table(results: Sequence[Result]) -> str:
    """The results as an aligned text table, ratios relative to the first row (no checkpointing)."""
    base = results[0].median_s
    header = ("mode", "step ms", "vs none", "kept MiB", "peak MiB", "equal", "policy")
    rows = [
        (
            r.name,
            f"{r.median_s * 1e3:.1f}",
            f"{r.median_s / base:.2f}x",
            f"{r.kept_bytes / 2**20:.1f}",
            f"{r.peak_bytes / 2**20:.1f}",
            "yes" if r.equal else "NO",
            r.policy,
        )
        for r in results
    ]
    widths = [max(len(row[c]) for row in (header, *rows)) for c in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in (header, *rows))


def _plot(results: Sequence[Result], path: str, title: str) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 5))  # no pyplot: the caller's matplotlib backend and figures stay untouched
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    markers = "os^vD<>pP*Xh"
    for i, r in enumerate(results):  # a legend, not labels next to points: modes often land on top of each other
        ax.scatter(r.median_s * 1e3, r.kept_bytes / 2**20, label=r.name, marker=markers[i % len(markers)])
    ax.legend(fontsize="small")
    ax.set_xlabel("median step time (ms)")
    ax.set_ylabel("activation memory kept for backward (MiB)")
    ax.set_title(title)
    fig.savefig(path, bbox_inches="tight")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sac2 bench", description=__doc__.splitlines()[0])
    parser.add_argument("--config", choices=sorted(CONFIGS), default="small", help="model and batch shape")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per mode (after one memory step)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    parser.add_argument("--plot", metavar="FILE", help="also plot memory against step time (PNG, SVG, PDF)")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        parser.error("--plot needs matplotlib: pip install 'sac2[plot]'")
    results, notes = run(args.config, args.steps, args.device)
    title = f"sac2 bench: config {args.config}, {args.device}, {args.steps} steps"
    print(title)
    print(format_table(results))
    print("memory: kept = allocated by forward and alive when backward starts; peak = forward+backward; "
          "both above the step's start (sac2.memory)")
    for note in notes:
        print(f"note: {note}")
    if args.json:
        base = results[0].median_s
        rows = [{**asdict(r), "median_s": r.median_s, "ratio_to_none": r.median_s / base} for r in results]
        payload = {"config": {"name": args.config, **asdict(CONFIGS[args.config])}, "device": args.device,
                   "steps": args.steps, "torch": torch.__version__, "modes": rows, "notes": notes}
        with open(args.json, "w") as f:
            json.dump(payload, f, indent=2)
    if args.plot:
        _plot(results, args.plot, title)
    return 0
