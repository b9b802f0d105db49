"""The checkpointing modes the bench compares, one ``Row`` each, built in one place (``rows()``, plain code).

No checkpointing, full checkpointing, torch's stock SAC and sac2's SAC under the default LLM policy
(``sac2.policies.llm()``), other sac2 policies (every other matmul), memory budgets (``sac2.apply_ac(model,
memory_budget=f)``: full AC, saved regions or an op-level budget, as the plan finds), sac2's one-line regions on the
unmodified model (``sac2.apply_ac(model, "regions", save=...)``: the blocks' ``nn.Linear``s and attention kernel
become regions and each block is checkpointed with a policy that names only ``sac2.Region``s, so no dispatch mode
runs), and torch_remat (the region-based peer, when it is installed) keeping the same calls, annotated by hand in
``remat.region(..., recompute=False)`` (``Transformer(cfg, region=...)``).
"""

from __future__ import annotations

import importlib.util
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.utils.checkpoint as tuc
from torch import nn

import sac2
from sac2.bench.length_curve import sac2_sac, stock_sac
from sac2.bench.models import REGION_NAMES, RegionWrap, Transformer, random_tokens
from sac2.policies import every_other_matmul, llm

__all__ = ["RunBlock", "Prepare", "Row", "rows", "remat_available", "remat_region", "REGION_SAVES"]

#: How a mode runs one block: ``run_block(block, x)`` returns the block's output.
RunBlock = Callable[[nn.Module, torch.Tensor], torch.Tensor]
#: What a mode does to its own copy of the model before training it (in place), e.g. ``sac2.apply_ac``; it returns
#: what to do before each of the row's steps, or None.
Prepare = Callable[[Transformer], Callable[[], None] | None]

#: The one-line region rows: row name -> (``save`` of ``sac2.apply_ac(model, "regions", save=...)``, its
#: ``keep_inputs``). The twin with inputs kept measures what rebuilding them costs (0.3 kept them).
REGION_SAVES = {
    "sac2 regions": (["attention", "linear"], False),
    "sac2 regions, inputs kept": (["attention", "linear"], True),
    "sac2 regions attn": (["attention"], False),
}


def _no_checkpoint(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    out: torch.Tensor = block(x)
    return out


def _full(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    out: torch.Tensor = tuc.checkpoint(block, x, use_reentrant=False)
    return out


def _sac2_full(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    out: torch.Tensor = sac2.checkpoint(block, x)
    return out


def remat_region(fn: Callable[..., torch.Tensor], name: str) -> Callable[..., torch.Tensor]:
    """torch_remat's saved region around ``fn``; its outputs persist, since bare ops read them in recompute."""
    import torch_remat as remat

    saved = remat.region(fn, name, recompute=False)

    def call(*args: Any) -> torch.Tensor:
        out: torch.Tensor = saved(*args)
        remat.recompute_needs_tensor(out)  # torch_remat's rule for an output a bare op (view, add) consumes
        return out

    return call


def _remat(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    import torch_remat as remat

    out: torch.Tensor = remat.checkpoint(region_name="block")(block)(x)
    return out


def remat_available() -> bool:
    """Whether the optional peer ``torch_remat`` is installed (it needs torch 2.15)."""
    return importlib.util.find_spec("torch_remat") is not None


def _apply_regions(save: list[str], keep_inputs: bool) -> Prepare:
    """``sac2.apply_ac(model, "regions", save=save, keep_inputs=keep_inputs)`` on a row's copy: its blocks wrap
    themselves (the setting is the copy's own, whatever the other region rows ask)."""

    def prepare(model: Transformer) -> None:
        sac2.apply_ac(model, "regions", save=save, blocks=model.blocks, keep_inputs=keep_inputs)

    return prepare


def _apply_budget(fraction: float) -> Prepare:
    """``sac2.apply_ac(model, memory_budget=fraction)`` on a row's copy, profiled on a batch of the config's shape
    (the one line chooses full AC, saved regions or an op-level budget per kind of block)."""

    def prepare(model: Transformer) -> None:
        device = next(model.parameters()).device
        batch = random_tokens(model.cfg, torch.Generator().manual_seed(0), device)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*nothing a budget could keep pays")  # the row shows it
            sac2.apply_ac(model, memory_budget=fraction, example_inputs=batch, blocks=model.blocks)

    return prepare


@dataclass(frozen=True)
class Row:
    """One mode of the bench: its name, its policy in words, how it runs a block, how the model is built with its
    calls wrapped in regions by hand (``region``; None: the default model), and what is done to the row's copy
    of the model before training (``prepare``; None: nothing; it returns what to do before each step)."""

    name: str
    policy: str
    run_block: RunBlock
    region: RegionWrap | None = None
    prepare: Prepare | None = None


def rows() -> list[Row]:
    """Every mode the bench runs, no checkpointing first; ``--compile`` runs the same rows compiled."""
    default = llm()
    out = [
        Row("none", "-", _no_checkpoint),
        Row("full", "recompute all, torch's frame", _full),
        Row("stock SAC", repr(default), stock_sac(default)),
        Row("sac2 SAC", repr(default), sac2_sac(default)),
        Row("sac2 full", "recompute all, sac2's frame", _sac2_full),
    ]
    every_other = every_other_matmul()
    out.append(Row("sac2 every_other_matmul", repr(every_other), sac2_sac(every_other)))
    for fraction in (0.3, 0.5, 0.7):
        out.append(Row(f"sac2 budget {fraction}", f"apply_ac(model, memory_budget={fraction})", _no_checkpoint,
                       prepare=_apply_budget(fraction)))
    # One line on the unmodified model: apply_ac wraps the blocks themselves, so run_block just calls the block.
    # Under compile a region is traced through and each of its nodes gets the policy's answer for the region.
    for name, (save, keep) in REGION_SAVES.items():
        policy = f'apply_ac(model, "regions", save={save}{", keep_inputs=True" if keep else ""})'
        out.append(Row(name, policy, _no_checkpoint, prepare=_apply_regions(save, keep)))
    if remat_available():
        out.append(Row("torch_remat", f"remat.region(recompute=False): {list(REGION_NAMES)}", _remat, remat_region))
    return out
