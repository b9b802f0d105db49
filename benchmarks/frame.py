"""What a step costs on sac2's checkpoint frame and on torch's: full AC, op-list SAC and regions-only SAC, side by side.

Two workloads, each a stack of ``sac2.bench.models.Block``s (each block checkpointed) trained on a random input:
``cpu-bound`` (4 blocks, d=64, seq 64, batch 2: per-op and per-tensor overhead dominates) and ``small`` (the bench's
``small`` config: matmuls dominate). Rows:

- none, and the grad-mode forward alone (``t_forward``: what one recompute costs at best);
- full AC: torch's non-reentrant and reentrant checkpoint, and ``sac2.checkpoint`` (sac2's frame);
- op-list SAC with ``sac2.policies.llm_save_list()``: torch's stock contexts on torch's checkpoint, sac2's contexts
  on sac2's frame, and sac2's contexts on torch's frame (``sac2.use_torch_frame``);
- regions-only SAC: the blocks built with ``sac2.region`` around their matmuls and attention and a save list of
  ``sac2.Region``s (``sac2.bench.models.REGION_NAMES``); and torch_remat's regions, when it is installed (2.15);
- DeepSpeed's full AC, when ``deepspeed`` is installed (the clients venv): ``deepspeed.checkpointing.checkpoint``
  (reentrant, an ``autograd.Function``) and ``non_reentrant_checkpoint`` (saved-tensor hooks), with DeepSpeed's
  default configuration (no partitioning, no CPU checkpointing); the header says when they are skipped.

One thread; time is this thread's CPU time, so other processes do not count. The modes take turns round by round in
one process (rotating order); each prints the median ms per forward+backward step (and the interquartile range
relative to it), its ratio to none, its extra
cost over none in forwards, ``(t - t_none) / t_forward`` (full AC's ideal is 1.0), and whether its gradients are
bitwise those of none. Then the sac2/torch ratios of each pair, with the targets the project aims at (printed,
never asserted).

    python benchmarks/frame.py [--rounds 30] [--config cpu-bound|small|both] [--json FILE] [--smoke]
    python benchmarks/frame.py --config cpu-bound --profile "sac2 full AC"   # cProfile one row, top functions
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import importlib.util
import io
import json
import pstats
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.utils.checkpoint as tuc
from torch import nn

import sac2
from sac2.bench.checkpoint_modes import remat_available
from sac2.bench.models import CONFIGS, REGION_NAMES, Block, ModelConfig, RegionWrap
from sac2.measure.rotation import turns
from sac2.policies import llm_save_list

#: The workloads: a stack of ``n_layers`` blocks of each config.
WORKLOADS: dict[str, ModelConfig] = {
    "cpu-bound": ModelConfig(dim=64, n_layers=4, n_heads=4, seq_len=64, batch=2, vocab=256, ffn_dim=176),
    "small": CONFIGS["small"],
}
#: ``--smoke``: the same rows on shapes that take milliseconds.
SMOKE: dict[str, ModelConfig] = {
    "cpu-bound": ModelConfig(dim=16, n_layers=2, n_heads=2, seq_len=8, batch=1, vocab=32, ffn_dim=32),
    "small": ModelConfig(dim=32, n_layers=2, n_heads=2, seq_len=16, batch=1, vocab=32, ffn_dim=64),
}

#: sac2/torch ratios printed per workload: (label, numerator row, denominator row, target or None).
PAIRS = (
    ("full AC: sac2 frame / torch non-reentrant", "sac2 full AC", "torch full AC", 0.80),
    ("full AC: sac2 frame / torch reentrant", "sac2 full AC", "torch reentrant full AC", None),
    ("op list: sac2 / stock SAC", "sac2 op-list SAC", "stock SAC", 0.75),
    ("op list: sac2 on torch's frame / stock SAC", "sac2 op-list SAC, torch frame", "stock SAC", None),
    ("op list: sac2 frame / torch frame (same modes)", "sac2 op-list SAC", "sac2 op-list SAC, torch frame", None),
    ("regions: sac2 regions / torch full AC", "sac2 regions SAC", "torch full AC", 0.75),
    ("regions: sac2 regions / torch_remat", "sac2 regions SAC", "torch_remat", 0.70),
    ("full AC: sac2 frame / deepspeed reentrant", "sac2 full AC", "deepspeed checkpoint", None),
    ("full AC: sac2 frame / deepspeed non-reentrant", "sac2 full AC", "deepspeed non-reentrant", None),
)
#: (t - t_none) / t_forward targets.
EXTRA_TARGETS = {"sac2 full AC": 1.25}

RunBlock = Callable[[nn.Module, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Mode:
    """One row: how each block runs, which blocks (plain, sac2 regions or torch_remat regions), and whether the
    step runs backward."""

    name: str
    run_block: RunBlock
    blocks: str = "plain"
    backward: bool = True


def _save_list() -> list:
    """``llm_save_list()``'s aten ops (torch's stock contexts take OpOverloads only), in a fixed order."""
    return sorted((op for op in llm_save_list() if isinstance(op, torch._ops.OpOverload)), key=str)


def _remat_block(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    import torch_remat as remat

    return remat.checkpoint(region_name="block")(block)(x)


def _remat_region(fn: Callable[..., torch.Tensor], name: str) -> Callable[..., torch.Tensor]:
    from sac2.bench.checkpoint_modes import remat_region as wrap  # the bench's own torch_remat region wrapper

    return wrap(fn, name)


def deepspeed_available() -> bool:
    """Whether ``deepspeed`` is installed (its rows run only then)."""
    return importlib.util.find_spec("deepspeed") is not None


def _deepspeed_modes() -> list[Mode]:
    """DeepSpeed's two full-AC functions, as configured by default (imported here: its import takes seconds)."""
    import deepspeed

    reentrant, non_reentrant = deepspeed.checkpointing.checkpoint, deepspeed.checkpointing.non_reentrant_checkpoint
    return [
        Mode("deepspeed checkpoint", lambda block, x: reentrant(block, x)),
        Mode("deepspeed non-reentrant", lambda block, x: non_reentrant(block, x)),
    ]


def _on_torch_frame(run: RunBlock) -> RunBlock:
    def call(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
        with sac2.use_torch_frame():
            return run(block, x)

    return call


def modes() -> list[Mode]:
    """Every row, none first."""
    ops = _save_list()
    stock = functools.partial(tuc.create_selective_checkpoint_contexts, ops)
    mine = functools.partial(sac2.create_selective_checkpoint_contexts, ops)
    regions = functools.partial(sac2.create_selective_checkpoint_contexts, [sac2.Region(n) for n in REGION_NAMES])

    def sac2_op_list(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return sac2.checkpoint(block, x, context_fn=mine)

    out = [
        Mode("none", lambda block, x: block(x)),
        Mode("forward alone", lambda block, x: block(x), backward=False),
        Mode("torch full AC", lambda block, x: tuc.checkpoint(block, x, use_reentrant=False)),
        Mode("torch reentrant full AC", lambda block, x: tuc.checkpoint(block, x, use_reentrant=True)),
        Mode("sac2 full AC", lambda block, x: sac2.checkpoint(block, x)),
        Mode("stock SAC", lambda block, x: tuc.checkpoint(block, x, use_reentrant=False, context_fn=stock)),
        Mode("sac2 op-list SAC", sac2_op_list),
        Mode("sac2 op-list SAC, torch frame", _on_torch_frame(sac2_op_list)),
        Mode("sac2 regions SAC", lambda block, x: sac2.checkpoint(block, x, context_fn=regions), blocks="sac2"),
    ]
    if remat_available():
        out.append(Mode("torch_remat", _remat_block, blocks="remat"))
    if deepspeed_available():
        out.extend(_deepspeed_modes())
    return out


class Stack(nn.Module):
    """``cfg.n_layers`` blocks; ``forward(x, run_block)`` runs each through ``run_block``; the loss is a mean square."""

    def __init__(self, cfg: ModelConfig, region: RegionWrap | None = None) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(cfg, region) for _ in range(cfg.n_layers))

    def forward(self, x: torch.Tensor, run_block: RunBlock) -> torch.Tensor:
        for block in self.blocks:
            x = run_block(block, x)
        return x.square().mean()


def _stacks(cfg: ModelConfig) -> dict[str, Stack]:
    """The plain stack and the same parameters in region-wrapped stacks (sac2's, and torch_remat's if installed)."""
    torch.manual_seed(0)
    plain = Stack(cfg)
    out = {"plain": plain, "sac2": Stack(cfg, lambda fn, name: sac2.region(fn, name=name))}
    if remat_available():
        out["remat"] = Stack(cfg, _remat_region)
    for stack in out.values():
        stack.load_state_dict(plain.state_dict())
    return out


def _step(stack: Stack, x: torch.Tensor, mode: Mode) -> None:
    loss = stack(x, mode.run_block)
    if mode.backward:
        loss.backward()


def _grads(stack: Stack, x: torch.Tensor, mode: Mode) -> list[torch.Tensor]:
    stack.zero_grad(set_to_none=True)
    x.grad = None
    _step(stack, x, mode)
    return [x.grad, *(p.grad for p in stack.parameters())]


def measure(cfg: ModelConfig, rounds: int, min_sample_s: float = 0.05) -> dict[str, Any]:
    """Median ms per step of each mode on ``cfg``'s stack, and whether its gradients are bitwise none's."""
    stacks = _stacks(cfg)
    x = torch.randn(cfg.batch, cfg.seq_len, cfg.dim, generator=torch.Generator().manual_seed(1), requires_grad=True)
    rows = modes()
    reference = _grads(stacks["plain"], x, rows[0])
    equal = {}
    for mode in rows:  # warm-up, and the gradient check
        if mode.backward:
            got = _grads(stacks[mode.blocks], x, mode)
            equal[mode.name] = all(torch.equal(a, b) for a, b in zip(reference, got, strict=True))
    start = time.thread_time()
    _step(stacks["plain"], x, rows[0])
    iters = max(1, round(min_sample_s / max(time.thread_time() - start, 1e-6))) if min_sample_s else 1
    samples: dict[str, list[float]] = {mode.name: [] for mode in rows}
    for r in range(rounds):
        for mode in (rows[i] for i in turns(r, len(rows))):
            stack = stacks[mode.blocks]
            start = time.thread_time()
            for _ in range(iters):
                _step(stack, x, mode)
            samples[mode.name].append((time.thread_time() - start) / iters * 1e3)
            stack.zero_grad(set_to_none=True)
            x.grad = None
    ms = {name: statistics.median(s) for name, s in samples.items()}
    spread = {name: _spread(s) for name, s in samples.items()}
    return {"config": cfg.__dict__, "rounds": rounds, "iters_per_sample": iters, "ms": ms, "spread": spread,
            "grads_equal": equal}


def _spread(samples: list[float]) -> float:
    """The interquartile range of ``samples`` relative to their median (0 for fewer than 4 samples)."""
    if len(samples) < 4:
        return 0.0
    q1, _, q3 = statistics.quantiles(samples, n=4)
    return (q3 - q1) / statistics.median(samples)


def summarise(result: dict[str, Any]) -> dict[str, Any]:
    """Ratios to none, extra cost in forwards, and the sac2/torch pairs of one workload's medians."""
    ms = result["ms"]
    none, forward = ms["none"], ms["forward alone"]
    rows = {
        name: {"ms": t, "iqr": result["spread"][name], "ratio_to_none": t / none,
               "extra_in_forwards": (t - none) / forward, "grads_equal": result["grads_equal"].get(name)}
        for name, t in ms.items()
    }
    pairs = {label: {"ratio": ms[a] / ms[b], "target": target}
             for label, a, b, target in PAIRS if a in ms and b in ms}
    return {**result, "rows": rows, "pairs": pairs}


def report(name: str, summary: dict[str, Any]) -> str:
    cfg = summary["config"]
    lines = [
        f"\n{name}: {cfg['n_layers']} blocks, d={cfg['dim']}, seq {cfg['seq_len']}, batch {cfg['batch']}, "
        f"ffn {cfg['ffn_dim']}; median of {summary['rounds']} rounds x {summary['iters_per_sample']} steps, 1 thread",
        f"  {'mode':<30} {'ms/step':>9} {'iqr':>5} {'x none':>7} {'(t-none)/fwd':>13}  same grads",
    ]
    for mode, row in summary["rows"].items():
        same = {None: "-", True: "yes", False: "NO"}[row["grads_equal"]]
        extra = "-" if mode in ("none", "forward alone") else f"{row['extra_in_forwards']:.2f}"
        target = EXTRA_TARGETS.get(mode)
        note = f"  (target <= {target:.2f})" if target is not None else ""
        lines.append(f"  {mode:<30} {row['ms']:9.2f} {row['iqr']:5.0%} {row['ratio_to_none']:7.2f} {extra:>13}"
                     f"  {same}{note}")
    for label, pair in summary["pairs"].items():
        pair_note = f"  (target <= {pair['target']:.2f})" if pair["target"] is not None else ""
        lines.append(f"  ratio {label}: {pair['ratio']:.2f}{pair_note}")
    return "\n".join(lines)


def profile(cfg: ModelConfig, row: str, steps: int, top: int = 30) -> str:
    """cProfile ``steps`` steps of one row; the top functions by own time."""
    (mode,) = [m for m in modes() if m.name == row]
    stacks = _stacks(cfg)
    x = torch.randn(cfg.batch, cfg.seq_len, cfg.dim, generator=torch.Generator().manual_seed(1), requires_grad=True)
    _step(stacks[mode.blocks], x, mode)
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        _step(stacks[mode.blocks], x, mode)
    profiler.disable()
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(top)
    return out.getvalue()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30, help="timed rounds (every mode once per round)")
    parser.add_argument("--config", choices=("cpu-bound", "small", "both"), default="both")
    parser.add_argument("--json", metavar="FILE", help="also write every median and ratio to FILE")
    parser.add_argument("--smoke", action="store_true", help="1 round on tiny shapes (for the test)")
    parser.add_argument("--profile", metavar="ROW", help="instead of timing, cProfile ROW (a mode's name)")
    parser.add_argument("--profile-steps", type=int, default=20)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    configs = SMOKE if args.smoke else WORKLOADS
    names = list(configs) if args.config == "both" else [args.config]
    if args.profile:
        for name in names:
            text = profile(configs[name], args.profile, args.profile_steps)
            print(f"{name}: {args.profile}, {args.profile_steps} steps\n{text}")
        return
    rounds = 1 if args.smoke else args.rounds
    deepspeed = "yes" if deepspeed_available() else "not installed, its rows skipped"
    print(f"torch {torch.__version__}, sac2 {sac2.__version__}, torch_remat {'yes' if remat_available() else 'no'}, "
          f"deepspeed {deepspeed}")
    results = {}
    for name in names:
        results[name] = summarise(measure(configs[name], rounds, min_sample_s=0.0 if args.smoke else 0.05))
        print(report(name, results[name]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"torch": torch.__version__, "workloads": results}, f, indent=2)


if __name__ == "__main__":
    main()
