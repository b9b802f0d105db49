"""The model and the checkpointing entry points the FSDP2, DDP and DCP workers of tests/distributed share.

A small llama-like stack: 3 blocks of (RMS-style norm, attention by ``scaled_dot_product_attention``, MLP) under
``model.layers`` (where ``sac2.apply_ac`` looks), a head and an unused ``spare`` Linear (DDP's
``find_unused_parameters`` has something to find; ``spare=False`` leaves it out).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.utils.checkpoint as tuc
from torch import nn
from torch.distributed.algorithms._checkpoint import checkpoint_wrapper as torch_cw

import sac2

__all__ = ["D", "MODES", "Model", "batch", "checkpoint", "sac2_mode"]

D = 16
MATMULS = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default)


class CoreAttention(nn.Module):
    """The attention kernel as a module without parameters (torchtitan's layout: apply_ac's "attention" finds it)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention = CoreAttention()
        self.norm = nn.RMSNorm(D)
        self.qkv = nn.Linear(D, 3 * D)
        self.up = nn.Linear(D, 2 * D)
        self.down = nn.Linear(2 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.norm(x)).unflatten(-1, (2, 3 * D // 2)).transpose(1, 2).chunk(3, dim=-1)
        x = x + self.attention(q, k, v).transpose(1, 2).flatten(-2)
        return x + self.down(torch.nn.functional.silu(self.up(x)))


class Model(nn.Module):
    def __init__(self, seed: int = 0, spare: bool = True) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.layers = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Linear(D, 1)
        if spare:
            self.spare = nn.Linear(D, D)  # never called

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x).pow(2).mean()


def batch(rank: int, step: int) -> torch.Tensor:
    """Rank- and step-dependent data: (batch 2, sequence 4, D)."""
    return torch.randn(2, 4, D, generator=torch.Generator().manual_seed(1000 * rank + step))


def save_matmuls(_ctx, op, *args, **kwargs):
    """A policy in torch's terms: save the matmuls, recompute the rest."""
    return tuc.CheckpointPolicy.MUST_SAVE if op in MATMULS else tuc.CheckpointPolicy.PREFER_RECOMPUTE


#: mode -> what it does to the model's blocks. "stock" is torch's checkpoint_wrapper with torch's own SAC contexts
#: (no sac2 anywhere); the others are sac2's entry points.
MODES: dict[str, Callable[[Any], object]] = {  # the models: Any, as torch types submodules Tensor | Module
    "none": lambda _model: None,
    "wrapper": lambda model: [
        model.layers.__setitem__(i, sac2.checkpoint_wrapper(b, context_fn=functools.partial(
            sac2.create_selective_checkpoint_contexts, sac2.policies.llm())))
        for i, b in enumerate(model.layers)
    ],
    "selective": lambda model: sac2.apply_ac(model, "selective"),
    "regions": lambda model: sac2.apply_ac(model, "regions", save=["linear", "attention"]),
    "stock": lambda model: [
        model.layers.__setitem__(i, torch_cw.checkpoint_wrapper(b, context_fn=functools.partial(
            tuc.create_selective_checkpoint_contexts, save_matmuls)))
        for i, b in enumerate(model.layers)
    ],
}


def checkpoint(model: nn.Module, mode: str) -> Any:
    """Put ``model``'s blocks under ``mode`` (a key of ``MODES``) in place; return the model."""
    MODES[mode](model)
    return model


def sac2_mode(mode: str) -> bool:
    return mode not in ("none", "stock")
