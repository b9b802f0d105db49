"""``python -m sac2 bench``: train a small llama-style model under each checkpointing mode and compare them.

Rows (``rows()``, plain code in one place): no checkpointing, full checkpointing, torch's stock SAC and sac2's
SAC under the default LLM policy (``sac2.policies.llm()``), other sac2 policies (every other matmul, memory
budgets), sac2 region-only policies (the model's matmuls and attention wrapped in ``sac2.region``s, a policy that
names only ``sac2.Region``s), and torch_remat (the region-based peer, when it is installed) keeping the same calls
in ``remat.region(..., recompute=False)``. ``--compile`` runs every row under ``torch.compile``
with the default inductor backend.

Every mode trains its own copy of one model on the same batches; the modes take turns step by step in one process
(in a rotating order), so drift in machine speed hits all of them alike. Step 0 of each mode measures memory
(``sac2.memory``) and is not timed (under ``--compile`` an untimed compile step comes first). After every step,
each mode's loss and gradients are compared to the no-checkpointing run's: bit for bit (``torch.equal``) in eager,
``torch.allclose`` under compile, where inductor may fuse a recomputed graph differently.

The per-op curve times a chain of N tiny pointwise ops (N = 16 ... 4,096) as one checkpointed region under none,
full AC, stock SAC and sac2 SAC with the same save list, single thread: the cost of one op against region length.
"""

from __future__ import annotations

import argparse
import copy
import functools
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
from sac2.length_curve import CURVE_LENGTHS, curve, format_curve, sac2_sac, stock_sac
from sac2.memory import measure_step
from sac2.models import CONFIGS, REGION_NAMES, RegionWrap, Transformer, random_tokens
from sac2.policies import every_other_matmul, llm
from sac2.policies.budget import memory_budget

__all__ = ["Row", "Result", "rows", "run", "format_table", "main", "COMPILE_BACKEND"]

RunBlock = Callable[[nn.Module, torch.Tensor], torch.Tensor]

#: The backend ``--compile`` uses unless ``--backend`` says otherwise: torch.compile's default.
COMPILE_BACKEND = "inductor"
#: Tolerances of the correctness check under compile (eager is bitwise).
ATOL, RTOL = 1e-5, 1e-4


def _no_checkpoint(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return block(x)


def _full(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return tuc.checkpoint(block, x, use_reentrant=False)


def _sac2_region(fn: Callable[..., torch.Tensor], name: str) -> Callable[..., torch.Tensor]:
    return sac2.region(fn, name=name)


def _remat_region(fn: Callable[..., torch.Tensor], name: str) -> Callable[..., torch.Tensor]:
    """torch_remat's saved region around ``fn``; its outputs persist, since bare ops read them in recompute."""
    import torch_remat as remat

    saved = remat.region(fn, name, recompute=False)

    def call(*args: Any) -> torch.Tensor:
        out = saved(*args)
        remat.recompute_needs_tensor(out)  # torch_remat's rule for an output a bare op (view, add) consumes
        return out

    return call


def _remat(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    import torch_remat as remat

    return remat.checkpoint(region_name="block")(block)(x)


def remat_available() -> bool:
    """Whether the optional peer ``torch_remat`` is installed (it needs torch 2.15)."""
    return importlib.util.find_spec("torch_remat") is not None


@dataclass(frozen=True)
class Row:
    """One mode of the bench: its name, its policy in words, how it runs a block, and how the model wraps regions
    (None: the default model)."""

    name: str
    policy: str
    run_block: RunBlock
    region: RegionWrap | None = None


def rows(model: Transformer, example: torch.Tensor) -> list[Row]:
    """Every mode the bench runs, no checkpointing first; ``--compile`` runs the same rows compiled."""
    default = llm()
    out = [
        Row("none", "-", _no_checkpoint),
        Row("full", "recompute all", _full),
        Row("stock SAC", repr(default), stock_sac(default)),
        Row("sac2 SAC", repr(default), sac2_sac(default)),
    ]
    every_other = every_other_matmul()
    out.append(Row("sac2 every_other_matmul", repr(every_other), sac2_sac(every_other)))
    for fraction in (0.3, 0.5, 0.7):
        budget = memory_budget(model.blocks[0], (example,), fraction)
        out.append(Row(f"sac2 budget {fraction}", repr(budget), sac2_sac(budget)))
    # Under compile a region is traced through and each of its nodes gets the policy's answer for the region.
    regions = [sac2.Region(name) for name in REGION_NAMES]
    attn = [r for r in regions if r.name.startswith("attn.")]
    out.append(Row("sac2 regions", f"save {[r.name for r in regions]}", sac2_sac(regions), _sac2_region))
    out.append(Row("sac2 regions attn", f"save {[r.name for r in attn]}", sac2_sac(attn), _sac2_region))
    if remat_available():
        out.append(Row("torch_remat", f"remat.region(recompute=False): {list(REGION_NAMES)}", _remat, _remat_region))
    return out


@dataclass
class Result:
    """One row of the table: a mode's step times, memory and whether it matched no checkpointing (``check`` says
    how: "bitwise" or "allclose")."""

    name: str
    policy: str
    step_s: list[float] = field(default_factory=list)
    kept_bytes: int = 0
    peak_bytes: int = 0
    equal: bool = True
    check: str = "bitwise"

    @property
    def median_s(self) -> float:
        return statistics.median(self.step_s)


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


def _same(a: torch.Tensor, b: torch.Tensor, bitwise: bool) -> bool:
    return torch.equal(a, b) if bitwise else torch.allclose(a, b, atol=ATOL, rtol=RTOL)


def _equal(model: nn.Module, loss: torch.Tensor, ref_model: nn.Module, ref_loss: torch.Tensor, bitwise: bool) -> bool:
    if not _same(loss, ref_loss, bitwise):
        return False
    return all(_same(p.grad, q.grad, bitwise) for p, q in zip(model.parameters(), ref_model.parameters()))


def _model(base: Transformer, row: Row) -> Transformer:
    """The row's own copy of ``base``: the same parameters, its calls wrapped in regions if the row says so."""
    if row.region is None:
        return copy.deepcopy(base)
    model = Transformer(base.cfg, region=row.region).to(next(base.parameters()).device)
    model.load_state_dict(base.state_dict())
    return model


def _forward(model: Transformer, row: Row, backend: str | None) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    forward = functools.partial(model, run_block=row.run_block)
    return torch.compile(forward, backend=backend) if backend else forward


def run(
    config: str = "small", steps: int = 5, device: str = "cpu", seed: int = 0, compile: bool = False,
    backend: str = COMPILE_BACKEND,
) -> tuple[list[Result], list[str]]:
    """Train ``config`` for 1 + ``steps`` steps under every mode (each under ``torch.compile(backend=backend)`` if
    ``compile``); return the rows and notes on the run."""
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
    if not remat_available():
        notes.append("torch_remat is not installed (pip install torch-remat; it needs torch 2.15): no torch_remat row")
    modes = rows(base, example)
    models = [_model(base, row) for row in modes]
    forwards = [_forward(m, row, backend if compile else None) for m, row in zip(models, modes)]
    optims = [torch.optim.SGD(m.parameters(), lr=1e-3) for m in models]
    check = "allclose" if compile else "bitwise"
    results = [Result(row.name, row.policy, check=check) for row in modes]
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    if compile:  # compile every mode once, outside the measured and timed steps; its gradients are dropped
        tokens, targets = random_tokens(cfg, torch.Generator().manual_seed(seed + 1), dev)
        for forward, model in zip(forwards, models):
            forward(tokens, targets).backward()
            model.zero_grad(set_to_none=True)
    progress = _Progress((steps + 1) * len(modes))
    for step in range(steps + 1):
        tokens, targets = random_tokens(cfg, gen, dev)
        losses: list[torch.Tensor] = [torch.empty(0)] * len(modes)
        shift = step % len(modes)
        for i in [*range(shift, len(modes)), *range(shift)]:
            forward = functools.partial(forwards[i], tokens, targets)
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
            results[i].equal &= _equal(models[i], losses[i], models[0], losses[0], bitwise=not compile)
        if step == 0:
            for opt in optims:
                opt.step()
    return results, notes


def format_table(results: Sequence[Result]) -> str:
    """The results as an aligned text table, ratios relative to the first row (no checkpointing)."""
    base = results[0].median_s
    header = ("mode", "step ms", "vs none", "kept MiB", "peak MiB", "equal", "policy")
    rows_ = [
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
    widths = [max(len(row[c]) for row in (header, *rows_)) for c in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in (header, *rows_))


def _plot(results: Sequence[Result], curve_data: dict[str, Any] | None, path: str, title: str) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(13 if curve_data else 7, 5))  # no pyplot: the caller's backend and figures stay untouched
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 2 if curve_data else 1, 1)
    markers = "os^vD<>pP*Xh"
    for i, r in enumerate(results):  # a legend, not labels next to points: modes often land on top of each other
        ax.scatter(r.median_s * 1e3, r.kept_bytes / 2**20, label=r.name, marker=markers[i % len(markers)])
    ax.legend(fontsize="small")
    ax.set_xlabel("median step time (ms)")
    ax.set_ylabel("activation memory kept for backward (MiB)")
    ax.set_title(title)
    if curve_data:
        cx = fig.add_subplot(1, 2, 2)
        for i, (name, us) in enumerate(curve_data["us_per_op"].items()):
            cx.plot(curve_data["lengths"], us, marker=markers[i % len(markers)], label=name)
        cx.set_xscale("log", base=2)
        cx.set_xlabel("ops in the checkpointed region")
        cx.set_ylabel("us per op, forward+backward, 1 thread")
        cx.set_title(f"per-op cost vs region length ({curve_data['policy']})")
        cx.legend(fontsize="small")
    fig.savefig(path, bbox_inches="tight")


def _lengths(text: str) -> list[int]:
    return [int(n) for n in text.split(",") if n.strip()]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sac2 bench", description=__doc__.splitlines()[0])
    parser.add_argument("--config", choices=sorted(CONFIGS), default="small", help="model and batch shape")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per mode (after one memory step)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--compile", action="store_true",
                        help="run every row under torch.compile")
    parser.add_argument("--backend", default=COMPILE_BACKEND, help="torch.compile backend (default %(default)s)")
    parser.add_argument("--curve", type=_lengths, default=list(CURVE_LENGTHS), metavar="N,N,...",
                        help="region lengths of the per-op curve ('' skips it; default %(default)s)")
    parser.add_argument("--curve-repeat", type=int, default=5, help="samples per point of the per-op curve")
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    parser.add_argument("--plot", metavar="FILE", help="also plot memory against step time and the curve")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        parser.error("--plot needs matplotlib: pip install 'sac2[plot]'")
    results, notes = run(args.config, args.steps, args.device, compile=args.compile, backend=args.backend)
    mode = f"torch.compile (backend {args.backend})" if args.compile else "eager"
    title = f"sac2 bench: config {args.config}, {args.device}, {mode}, {args.steps} steps"
    print(title)
    print(format_table(results))
    check = ("torch.allclose(atol=%g, rtol=%g)" % (ATOL, RTOL)) if args.compile else "bitwise (torch.equal)"
    print(f"equal: loss and every gradient vs none, {check}")
    print("memory: kept = allocated by forward and alive when backward starts; peak = forward+backward; "
          "both above the step's start (sac2.memory)")
    curve_data = curve(args.curve, args.curve_repeat) if args.curve else None
    if curve_data:
        print(f"\nper-op cost vs region length, eager, {curve_data['policy']} ('!': gradient not bitwise equal)")
        print(format_curve(curve_data))
    for note in notes:
        print(f"note: {note}")
    if args.json:
        base = results[0].median_s
        rows_ = [{**asdict(r), "median_s": r.median_s, "ratio_to_none": r.median_s / base} for r in results]
        payload = {"config": {"name": args.config, **asdict(CONFIGS[args.config])}, "device": args.device,
                   "steps": args.steps, "torch": torch.__version__, "compile": args.compile,
                   "backend": args.backend if args.compile else None, "check": check, "modes": rows_,
                   "curve": curve_data, "notes": notes}
        with open(args.json, "w") as f:
            json.dump(payload, f, indent=2)
    if args.plot:
        _plot(results, curve_data, args.plot, title)
    return 0
