"""Factories for ``python -m sac2 advise --factory``: the bench's llama-style models (``sac2.bench.models``) with a
batch of random tokens, so advise's CUDA path (deterministic kernels, memory, the bitwise check, the offload rows
and the host link's bandwidth) runs on a GPU machine without transformers.

    python -m sac2 advise --factory benchmarks.gpu_advise:medium --device cuda --steps 5    # GPU, under a minute
    python -m sac2 advise --factory benchmarks.gpu_advise:tiny --steps 1                    # CPU: what the tests run
"""

from __future__ import annotations

import torch

from sac2.bench.models import CONFIGS, Transformer, random_tokens

__all__ = ["tiny", "medium"]


def _made(config: str) -> tuple[Transformer, tuple[torch.Tensor, torch.Tensor]]:
    cfg = CONFIGS[config]
    torch.manual_seed(0)
    return Transformer(cfg), random_tokens(cfg, torch.Generator().manual_seed(0), torch.device("cpu"))


def tiny() -> tuple[Transformer, tuple[torch.Tensor, torch.Tensor]]:
    """The bench's ``tiny`` model and one batch (on the CPU; advise moves both to its device)."""
    return _made("tiny")


def medium() -> tuple[Transformer, tuple[torch.Tensor, torch.Tensor]]:
    """The bench's ``medium`` model and one batch (on the CPU; advise moves both to its device)."""
    return _made("medium")
