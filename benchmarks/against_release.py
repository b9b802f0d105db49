"""One-line regions in this checkout against a released sac2, side by side in one process: step time and bitwise grads.

The release is the ``sac2`` package of a git commit (default: 0.3.0's, the baseline issue 24 compares with),
unpacked from this repository with ``git archive`` into a temporary folder and imported as ``sac2_ref`` (every
``sac2`` name in its sources renamed), so both run in one process on copies of one model and take turns step by
step in a rotating order (medians of per-turn medians; this thread's CPU time, one thread). Rows, for each save list
of ``benchmarks/clients_regions.py``'s region rows (``attention``; ``attention`` + ``linear`` + ``experts``, which
is ``apply_ac``'s default):

- ``ref``: ``sac2_ref.apply_ac(model, "regions", save=...)``;
- ``now``: ``sac2.apply_ac(model, "regions", save=...)`` (inputs rebuilt in recompute, the default);
- ``now, inputs kept``: the same with ``keep_inputs=True`` (as the release kept them);
- ``now, experts modules`` (MoE models): ``"experts"`` replaced by the experts module classes, which makes each
  experts call one region as the release's ``"experts"`` did (now it names their matmul calls, whose routing
  recompute runs again);
- ``now, no in-place check``: ``now`` with the frame's in-place check of saved tensors switched off (autograd's
  error for a write into a tensor saved for backward, which the release's frame did not make), to tell its cost
  apart from the rest of the difference. Attribution only: sac2 has no switch for it.

Memory: one untimed step per row under ``sac2.measure.memory.measure_step`` (kept = allocated by forward and alive
when backward starts): a row the release runs differently (a call it did not make a region) shows there.

Models: the bench's ``tiny`` and ``small`` (``sac2.bench.models``), and the client models of
``benchmarks/clients_regions.py`` where transformers / torchtitan are installed. Every row's loss and gradients are
compared with no checkpointing, bitwise. Numbers only: nothing here is asserted.

    python benchmarks/against_release.py [--ref COMMIT] [--models tiny,small,hf-llama,...] [--rounds 30]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import copyreg
import functools
import importlib
import importlib.util
import pathlib
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Callable, Iterator

import torch
from torch import nn

import sac2
from sac2.bench.models import CONFIGS, Transformer, random_tokens
from sac2.measure.memory import measure_step
from sac2.measure.rotation import turns
from sac2.measure.step import grads_equal

#: 0.3.0's commit: the release the issues compare step times with.
RELEASE = "7f4cc5b"
#: The bench's configs, then ``benchmarks/clients_regions.py``'s client models.
MODELS = ["tiny", "small", "hf-llama", "hf-qwen3-moe", "tt-llama3"]


@contextlib.contextmanager
def release(commit: str) -> Iterator[ModuleType]:
    """The ``sac2`` package of ``commit``, unpacked into a temporary folder and imported as ``sac2_ref``; on exit
    its modules, its folder and the pickle reducers it registered are gone."""
    root = pathlib.Path(__file__).resolve().parent.parent
    archive = subprocess.run(["git", "-C", str(root), "archive", commit, "sac2"], check=True, capture_output=True)
    reducers = dict(copyreg.dispatch_table)
    with tempfile.TemporaryDirectory() as tmp:
        into = pathlib.Path(tmp)
        subprocess.run(["tar", "-x", "-C", tmp], input=archive.stdout, check=True)
        (into / "sac2").rename(into / "sac2_ref")
        for path in (into / "sac2_ref").rglob("*.py"):
            path.write_text(re.sub(r"\bsac2\b", "sac2_ref", path.read_text()))
        sys.path.insert(0, tmp)
        try:
            yield importlib.import_module("sac2_ref")
        finally:
            sys.path.remove(tmp)
            for name in [m for m in sys.modules if m == "sac2_ref" or m.startswith("sac2_ref.")]:
                del sys.modules[name]
            copyreg.dispatch_table.clear()
            copyreg.dispatch_table.update(reducers)


@functools.cache
def _clients_regions() -> Any:
    """``benchmarks/clients_regions.py``, a sibling script (not a package): its client models and the save lists of
    its region rows (``SAVES``), the rows compared here."""
    path = pathlib.Path(__file__).with_name("clients_regions.py")
    spec = importlib.util.spec_from_file_location("clients_regions", path)
    if spec is None or spec.loader is None:
        raise ImportError("benchmarks/clients_regions.py is missing")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@dataclass
class Case:
    """A model to compare on: how to build it (same weights every call), its blocks, a loss."""

    name: str
    build: Callable[[], nn.Module]
    blocks: Callable[[Any], nn.Module]
    loss: Callable[[nn.Module], torch.Tensor]


def _bench_case(name: str) -> Case:
    """The bench's model of config ``name`` and its fixed batch."""
    cfg = CONFIGS[name]
    tokens = random_tokens(cfg, torch.Generator().manual_seed(0), torch.device("cpu"))

    def build() -> nn.Module:
        torch.manual_seed(0)
        return Transformer(cfg)

    def loss(model: nn.Module) -> torch.Tensor:
        out: torch.Tensor = model(*tokens)
        return out

    return Case(name, build, lambda m: m.blocks, loss)


def cases(names: list[str]) -> list[Case]:
    out = []
    for name in names:
        if name in CONFIGS:
            out.append(_bench_case(name))
        else:
            specs, notes = _clients_regions().models([name], smoke=False)
            for note in notes:
                print(f"note: {note}")
            out += [Case(s.name, s.build, s.blocks, s.loss) for s in specs]
    return out


@contextlib.contextmanager
def _without_inplace_check(off: bool) -> Iterator[None]:
    """When ``off``, sac2's frame keeps no version per saved position, as where torch allows writes into saved
    tensors (``sac2._compat.mutation_on_saved_tensors_allowed`` answers yes while inside)."""
    if not off:
        yield
        return
    allowed = sac2._compat.mutation_on_saved_tensors_allowed
    sac2._compat.mutation_on_saved_tensors_allowed = lambda: True
    try:
        yield
    finally:
        sac2._compat.mutation_on_saved_tensors_allowed = allowed


@dataclass
class Row:
    name: str
    label: str  # its save list's name in ``clients_regions.SAVES``
    model: nn.Module
    release: bool = False  # the release's row, the others' baseline
    unchecked: bool = False  # runs without the in-place check of saved tensors
    times: list[float] = field(default_factory=list)
    kept: int = 0
    equal: bool = False


def _experts_classes(model: nn.Module) -> list[type]:
    """The MoE experts module classes in ``model`` as the release's ``"experts"`` matched them: class name ending in
    ``Experts``, the innermost where experts hold experts (torchtitan's ``RoutedExperts``)."""

    def experts(m: nn.Module) -> bool:
        return type(m).__name__.endswith("Experts")

    inner = {type(m) for m in model.modules() if experts(m) and not any(experts(c) for c in list(m.modules())[1:])}
    return sorted(inner, key=str)


def _now_row(base: nn.Module, case: Case, name: str, label: str, save: list[Any] | None, keep: bool,
             unchecked: bool = False) -> Row:
    model = copy.deepcopy(base)
    sac2.apply_ac(model, "regions", save=save, blocks=case.blocks(model), keep_inputs=keep)
    return Row(name, label, model, unchecked=unchecked)


def _rows(case: Case, ref: ModuleType) -> list[Row]:
    base = case.build()
    rows = []
    experts = _experts_classes(base)
    for label, save in _clients_regions().SAVES.items():
        model = copy.deepcopy(base)
        ref.apply_ac(model, "regions", save=save, blocks=case.blocks(model))
        rows.append(Row(f"ref regions {label}", label, model, release=True))
        for keep in (False, True):
            rows.append(_now_row(base, case, f"now regions {label}{', inputs kept' if keep else ''}", label, save,
                                 keep))
        rows.append(_now_row(base, case, f"now regions {label}, no in-place check", label, save, False,
                             unchecked=True))
        if save is not None and "experts" in save and experts:
            # The release's "experts" made each experts module one region; now it names their matmul calls.
            modules = [t for t in save if t != "experts"] + experts
            rows.append(_now_row(base, case, f"now regions {label}, experts modules", label, modules, False))
    reference = copy.deepcopy(base)
    want = case.loss(reference)
    want.backward()
    for row in rows:
        with _without_inplace_check(row.unchecked):
            memory, loss = measure_step(functools.partial(case.loss, row.model), "cpu")
        row.kept = memory.kept
        row.equal = grads_equal(row.model, loss, reference, want, bitwise=True)
    return rows


def measure(case: Case, ref: ModuleType, rounds: int, steps: int) -> list[Row]:
    rows = _rows(case, ref)
    for r in range(rounds):
        for i in turns(r, len(rows)):
            row = rows[i]
            turn = []
            with _without_inplace_check(row.unchecked):
                for _ in range(steps):
                    row.model.zero_grad(set_to_none=True)
                    start = time.thread_time()
                    case.loss(row.model).backward()
                    turn.append(time.thread_time() - start)
            row.times.append(statistics.median(turn))
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ref", default=RELEASE, help=f"the release's commit (default {RELEASE}, 0.3.0)")
    parser.add_argument("--models", default="tiny,small,hf-llama,hf-qwen3-moe,tt-llama3",
                        help=f"comma-separated, of {', '.join(MODELS)}")
    parser.add_argument("--rounds", type=int, default=30, help="rounds (each row takes one turn per round)")
    parser.add_argument("--steps", type=int, default=3, help="steps per turn (their median is the turn's time)")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.models.split(",") if n.strip()]
    unknown = sorted(set(names) - set(MODELS))
    if unknown:
        parser.error(f"--models: unknown {unknown}; choose from {', '.join(MODELS)}")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with release(args.ref) as ref:
            _compare(names, ref, args)
    finally:
        torch.set_num_threads(threads)


def _compare(names: list[str], ref: ModuleType, args: argparse.Namespace) -> None:
    """Print one table per model: every row's step time against the release's row for the same save list."""
    for case in cases(names):
        rows = measure(case, ref, args.rounds, args.steps)
        print(f"\n{case.name}: sac2 now vs {args.ref}; torch {torch.__version__}, 1 thread, "
              f"median of {args.rounds} rounds of {args.steps} steps")
        print(f"  {'row':44s} {'step ms':>8s} {'vs ref':>7s} {'kept MiB':>9s}  grads equal to none")
        released = {row.label: statistics.median(row.times) for row in rows if row.release}
        for row in rows:
            ms = statistics.median(row.times)
            print(f"  {row.name:44s} {ms * 1e3:8.2f} {ms / released[row.label]:6.3f}x {row.kept / 2**20:9.2f}  "
                  f"{'yes' if row.equal else 'NO'}")


if __name__ == "__main__":
    main()
