"""The small llama-style language models the bench trains: embedded configs, random weights, no downloads.

A block is pre-norm attention (RMSNorm, fused QKV projection, causal SDPA) and a pre-norm SwiGLU MLP, each with a
residual: the op mix (mm, SDPA, pointwise) of the models that selective checkpointing is tuned for.
``Transformer.forward`` runs each block through ``run_block(block, x)`` so the caller decides how blocks are
checkpointed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["ModelConfig", "CONFIGS", "Block", "Transformer", "random_tokens"]


@dataclass(frozen=True)
class ModelConfig:
    """Model shape and batch shape of one bench configuration."""

    dim: int
    n_layers: int
    n_heads: int
    seq_len: int
    batch: int
    vocab: int
    ffn_dim: int


CONFIGS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(dim=64, n_layers=2, n_heads=4, seq_len=32, batch=2, vocab=256, ffn_dim=176),
    "small": ModelConfig(dim=512, n_layers=4, n_heads=8, seq_len=256, batch=2, vocab=2048, ffn_dim=1376),
    "medium": ModelConfig(dim=1024, n_layers=8, n_heads=16, seq_len=512, batch=2, vocab=8192, ffn_dim=2752),
}


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Block(nn.Module):
    """One transformer block: ``x + attn(norm(x))``, then ``h + mlp(norm(h))``."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.attn_norm = RMSNorm(cfg.dim)
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim, bias=False)
        self.proj = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.mlp_norm = RMSNorm(cfg.dim)
        self.gate_up = nn.Linear(cfg.dim, 2 * cfg.ffn_dim, bias=False)
        self.down = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).view(b, s, 3, self.n_heads, d // self.n_heads).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        h = x + self.proj(a.transpose(1, 2).reshape(b, s, d))
        gate, up = self.gate_up(self.mlp_norm(h)).chunk(2, dim=-1)
        return h + self.down(F.silu(gate) * up)


class Transformer(nn.Module):
    """Token embedding, ``n_layers`` blocks, final norm and LM head; ``forward`` returns the mean LM loss."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)

    def forward(
        self,
        tokens: torch.Tensor,
        targets: torch.Tensor,
        run_block: Callable[[nn.Module, torch.Tensor], torch.Tensor] = lambda block, x: block(x),
    ) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = run_block(block, x)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def random_tokens(
    cfg: ModelConfig, generator: torch.Generator, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of random (tokens, next-token targets) of the config's shape."""
    seq = torch.randint(cfg.vocab, (cfg.batch, cfg.seq_len + 1), generator=generator).to(device)
    return seq[:, :-1], seq[:, 1:]
