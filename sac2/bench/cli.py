"""``python -m sac2 bench``: train a small llama-style model under each checkpointing mode and compare them.

The command line of the bench: it checks every argument before any work starts, so a misuse ends in one line
naming what is wrong (argparse's ``error``, exit code 2), then runs the job (``sac2.bench.job``), prints the table
and the per-op curve (``sac2.bench.length_curve``), and writes the JSON and the plot when asked.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
from dataclasses import asdict
from typing import Sequence

import torch

from sac2.bench.job import COMPILE_BACKEND, run
from sac2.bench.length_curve import CURVE_LENGTHS, curve, format_curve
from sac2.bench.models import CONFIGS
from sac2.bench.output import format_table, plot
from sac2.measure.arguments import device_arg, output_file, positive_int
from sac2.measure.pareto import pareto_front
from sac2.measure.step import ATOL, RTOL

__all__ = ["main", "DTYPES"]

#: ``--dtype``'s choices.
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _lengths(text: str) -> list[int]:
    """``--curve``: region lengths ``N,N,...``; an empty list skips the curve."""
    parts = [part for part in text.split(",") if part.strip()]
    if not all(part.strip().isdecimal() and int(part) > 0 for part in parts):
        raise argparse.ArgumentTypeError(f"must be positive integers separated by commas (e.g. 16,256), got {text!r}")
    return [int(part) for part in parts]


def _backend(text: str) -> str:
    """``--backend``: a backend ``torch.compile`` has (the default needs no look-up, which imports dynamo)."""
    if text != COMPILE_BACKEND and text not in torch.compiler.list_backends(exclude_tags=None):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a torch.compile backend (see torch.compiler.list_backends(exclude_tags=None))"
        )
    return text


#: What ``--help`` says the command does (plain text: argparse prints it as it is).
DESCRIPTION = "Train a small llama-style model under each checkpointing mode and compare them, side by side."


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sac2 bench", description=DESCRIPTION)
    parser.add_argument("--config", choices=sorted(CONFIGS), default="small", help="model and batch shape")
    parser.add_argument("--steps", type=positive_int, default=5, help="timed steps per mode (after one memory step)")
    parser.add_argument("--device", type=device_arg, default="cpu", help="cpu, cuda or cuda:N")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32",
                        help="the model's parameters and activations (bfloat16: as people train on GPUs)")
    parser.add_argument("--compile", action="store_true", help="run every row under torch.compile")
    parser.add_argument("--backend", type=_backend,
                        help=f"torch.compile backend, with --compile (default {COMPILE_BACKEND})")
    parser.add_argument("--curve", type=_lengths, default=list(CURVE_LENGTHS), metavar="N,N,...",
                        help="region lengths of the per-op curve ('' skips it; default %(default)s)")
    parser.add_argument("--curve-repeat", type=positive_int, default=5, help="samples per point of the per-op curve")
    parser.add_argument("--json", type=output_file, metavar="FILE", help="also write the results as JSON")
    parser.add_argument("--plot", type=output_file, metavar="FILE",
                        help="also plot memory against step time and the curve")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.backend is not None and not args.compile:
        parser.error("argument --backend: applies only with --compile")
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        parser.error("--plot needs matplotlib: pip install 'sac2[plot]'")
    backend = args.backend or COMPILE_BACKEND
    results, notes = run(args.config, args.steps, args.device, compile=args.compile, backend=backend,
                         dtype=DTYPES[args.dtype])
    mode = f"torch.compile (backend {backend})" if args.compile else "eager"
    title = f"sac2 bench: config {args.config}, {args.dtype}, {args.device}, {mode}, {args.steps} steps"
    print(title)
    print(format_table(results))
    front = [results[i].name for i in pareto_front([(r.median_s, r.kept_bytes) for r in results])]
    print(f"Pareto front (step time against kept memory; no other row is faster and keeps less): {', '.join(front)}")
    check = ("torch.allclose(atol=%g, rtol=%g)" % (ATOL, RTOL)) if args.compile else "bitwise (torch.equal)"
    print(f"equal: loss and every gradient vs none, {check}")
    print("memory: kept = allocated by forward and alive when backward starts; peak = forward+backward; "
          "both above the step's start (sac2.measure.memory)")
    curve_data = curve(args.curve, args.curve_repeat) if args.curve else None
    if curve_data:
        print(f"\nper-op cost vs region length, eager, {curve_data['policy']} ('!': gradient not bitwise equal)")
        print(format_curve(curve_data))
    for note in notes:
        print(f"note: {note}")
    if args.json:
        base = results[0].median_s
        rows_ = [{**asdict(r), "median_s": r.median_s, "ratio_to_none": r.median_s / base} for r in results]
        payload = {"config": {"name": args.config, **asdict(CONFIGS[args.config])}, "dtype": args.dtype,
                   "device": args.device,
                   "steps": args.steps, "torch": torch.__version__, "compile": args.compile,
                   "backend": backend if args.compile else None, "check": check, "modes": rows_,
                   "pareto_front": front, "curve": curve_data, "notes": notes}
        with open(args.json, "w") as f:
            json.dump(payload, f, indent=2)
    if args.plot:
        plot(results, curve_data, args.plot, title)
    return 0
