"""The bench's job: train a small llama-style model under every checkpointing mode and measure each one.

Every mode (``sac2.bench.checkpoint_modes``) trains its own copy of one model on the same batches; the modes take
turns step by step in one process (in a rotating order), so drift in machine speed hits all of them alike. Step 0
of each mode measures memory (``sac2.measure.memory``) and is not timed (under ``compile`` an untimed compile step
comes first). After every step, each mode's loss and gradients are compared to the no-checkpointing run's: bit for
bit (``torch.equal``) in eager, ``torch.allclose`` under compile, where inductor may fuse a recomputed graph
differently. On CUDA in eager, step 0 runs under deterministic algorithms and is the one compared (attention's
backward otherwise differs from run to run); the timed steps run as people train, without them.
"""

from __future__ import annotations

import contextlib
import copy
import functools
from typing import Callable

import torch

from sac2.bench.checkpoint_modes import Row, remat_available, rows
from sac2.bench.models import CONFIGS, Transformer, random_tokens
from sac2.measure.determinism import deterministic_kernels
from sac2.measure.rotation import turns
from sac2.measure.step import Progress, Result, grads_equal, take_step

__all__ = ["run", "COMPILE_BACKEND"]

#: The backend ``compile`` uses unless ``backend`` says otherwise: torch.compile's default.
COMPILE_BACKEND = "inductor"


def _model(base: Transformer, row: Row) -> Transformer:
    """The row's own copy of ``base`` (``_prepared``)."""
    return _prepared(base, row)[0]


def _prepared(base: Transformer, row: Row) -> tuple[Transformer, Callable[[], None]]:
    """The row's own copy of ``base``: the same parameters, built with its calls wrapped in regions by hand if the
    row says so (``row.region``), then prepared by the row (``row.prepare``: e.g. ``sac2.apply_ac`` in place); and
    what to do before each of its steps."""
    if row.region is None:
        model = copy.deepcopy(base)
    else:
        model = Transformer(base.cfg, region=row.region).to(next(base.parameters()).device)
        model.load_state_dict(base.state_dict())
    before = row.prepare(model) if row.prepare is not None else None
    return model, before if before is not None else _nothing


def _nothing() -> None:
    """Nothing to do before a step."""


def _forward(
    model: Transformer, row: Row, backend: str | None, index: int = 0
) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    forward = functools.partial(model, run_block=row.run_block)
    return torch.compile(_own_frame(forward, index), backend=backend) if backend else forward


def _own_frame(
    forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], index: int
) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """``forward`` called from a function with a code object of its own (named ``bench_row_<index>``).

    Dynamo keeps compiled code and its guards per code object. Compiled directly, every row's forward is the same
    code (dynamo's wrapper of a ``functools.partial``), so each row after the first fails the guards on
    ``run_block`` and recompiles that one frame; from the 9th row on ``torch._dynamo.config.recompile_limit`` (8)
    is hit and the row runs uncompiled. With a frame per row each row compiles once, as it would alone.
    """

    def step(tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return forward(tokens, targets)

    step.__code__ = step.__code__.replace(co_name=f"bench_row_{index}")
    return step


def _notes(dev: torch.device) -> list[str]:
    """Notes on what this run cannot compare on this machine."""
    notes: list[str] = [
        "torch's own estimator-based greedy policy (torch.distributed._tools.sac_estimator) is not a row: "
        "in torch 2.13 its runtime estimates need CUDA, and the bench has no CUDA-only rows"
    ]
    if dev.type == "cuda":
        notes.append(
            "cuda: step 0 (memory, the gradient check) ran under torch.use_deterministic_algorithms(True) "
            "(sac2.measure.determinism), without which attention's backward differs from run to run and no row "
            "could be bitwise equal; the timed steps ran without it, as people train (under --compile: with it, "
            "so that no step compiles again)"
        )
    if not remat_available():
        notes.append("torch_remat is not installed (pip install torch-remat; it needs torch 2.15): no torch_remat row")
    return notes


def run(
    config: str = "small", steps: int = 5, device: str = "cpu", seed: int = 0, compile: bool = False,
    backend: str = COMPILE_BACKEND, dtype: torch.dtype = torch.float32,
) -> tuple[list[Result], list[str]]:
    """Train ``config`` for 1 + ``steps`` steps under every mode (each under ``torch.compile(backend=backend)`` if
    ``compile``), its parameters and activations in ``dtype``; return the rows and notes on the run."""
    cfg = CONFIGS[config]
    dev = torch.device(device)
    torch.manual_seed(seed)
    base = Transformer(cfg).to(dev, dtype)
    gen = torch.Generator().manual_seed(seed)
    notes = _notes(dev)
    modes = rows()
    prepared = [_prepared(base, row) for row in modes]
    models, befores = [model for model, _ in prepared], [before for _, before in prepared]
    backend_ = backend if compile else None
    forwards = [_forward(m, row, backend_, i) for i, (m, row) in enumerate(zip(models, modes, strict=True))]
    optims = [torch.optim.SGD(m.parameters(), lr=1e-3) for m in models]
    check = "allclose" if compile else "bitwise"
    results = [Result(row.name, row.policy, check=check) for row in modes]
    # On CUDA, so that the bitwise check can hold at all: every step under compile, else step 0 only (``_timed``).
    with deterministic_kernels(dev) if compile else contextlib.nullcontext():
        if compile:  # compile every mode once, outside the measured and timed steps; its gradients are dropped
            tokens, targets = random_tokens(cfg, torch.Generator().manual_seed(seed + 1), dev)
            for forward, model, before in zip(forwards, models, befores, strict=True):
                before()
                forward(tokens, targets).backward()
                model.zero_grad(set_to_none=True)
        progress = Progress((steps + 1) * len(modes), "sac2 bench")
        for step in range(steps + 1):
            tokens, targets = random_tokens(cfg, gen, dev)
            losses: list[torch.Tensor] = [torch.empty(0)] * len(modes)
            checked = compile or step == 0 or dev.type != "cuda"
            with deterministic_kernels(dev) if checked and not compile else contextlib.nullcontext():
                for i in turns(step, len(modes)):
                    forward = functools.partial(forwards[i], tokens, targets)
                    optims[i].zero_grad(set_to_none=True)
                    befores[i]()
                    losses[i] = take_step(forward, results[i], dev, step == 0, optims[i].step)
                    progress.step()
            for i in range(1, len(modes) if checked else 1):
                results[i].equal &= grads_equal(models[i], losses[i], models[0], losses[0], bitwise=not compile)
            if step == 0:
                for opt in optims:
                    opt.step()
    return results, notes
