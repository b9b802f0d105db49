"""The small llama-style language models the bench trains: embedded configs, random weights, no downloads.

A block is pre-norm attention (RMSNorm, fused QKV projection, causal SDPA) and a pre-norm SwiGLU MLP, each with a
residual: the op mix (mm, SDPA, pointwise) of the models that selective checkpointing is tuned for.
``Transformer.forward`` runs each block through ``run_block(block, x)`` so the caller decides how blocks are
checkpointed.

``Transformer(cfg, region=wrap)`` builds the same model (same parameters, same ops in the same order) with each
block's matmuls and attention called through ``wrap(fn, name)`` (names in ``REGION_NAMES``): with
``wrap = lambda fn, name: sac2.region(fn, name=name)`` a policy that saves only ``sac2.Region``s keeps what an op
list of matmuls + attention keeps, and a peer's region API (torch_remat) plugs in the same way. The wrapped
functions are built from ``F.linear`` and SDPA, never from a module, so ``copy.deepcopy`` of the model stays
self-contained.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "ModelConfig", "CONFIGS", "REGION_NAMES", "RegionWrap", "ScaledDotProductAttention", "Block", "Transformer",
    "random_tokens",
]

#: How a region-wrapped model wraps one call: ``wrap(fn, name)`` returns a callable with ``fn``'s signature.
RegionWrap = Callable[[Callable[..., torch.Tensor], str], Callable[..., torch.Tensor]]

#: The calls of a block that ``Transformer(cfg, region=...)`` wraps, one region each, in forward order.
REGION_NAMES = ("attn.qkv", "attn.sdpa", "attn.proj", "mlp.gate_up", "mlp.down")


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
    # Compute-bound on a GPU (with --dtype bfloat16): a block's kernels outlast the modes' Python per op.
    "large": ModelConfig(dim=2048, n_layers=4, n_heads=16, seq_len=2048, batch=1, vocab=8192, ffn_dim=5632),
}


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def _causal_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class ScaledDotProductAttention(nn.Module):
    """Causal SDPA as a module without parameters (torchtitan's blocks hold their attention kernel this way), so
    ``sac2.apply_ac(model, mode="regions")`` can make attention calls regions without editing the model."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return _causal_sdpa(q, k, v)


class Block(nn.Module):
    """One transformer block: ``x + attn(norm(x))``, then ``h + mlp(norm(h))``.

    With ``region``, the four matmuls and the attention run through ``region(fn, name)`` (see the module doc).
    """

    def __init__(self, cfg: ModelConfig, region: RegionWrap | None = None) -> None:
        super().__init__()
        self.calls: dict[str, Callable[..., torch.Tensor]] | None = None
        if region is not None:
            fns: tuple[Callable[..., torch.Tensor], ...] = (F.linear, _causal_sdpa, F.linear, F.linear, F.linear)
            self.calls = {name: region(fn, name) for name, fn in zip(REGION_NAMES, fns, strict=True)}
        self.n_heads = cfg.n_heads
        self.attention = ScaledDotProductAttention()
        self.attn_norm = RMSNorm(cfg.dim)
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim, bias=False)
        self.proj = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.mlp_norm = RMSNorm(cfg.dim)
        self.gate_up = nn.Linear(cfg.dim, 2 * cfg.ffn_dim, bias=False)
        self.down = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.calls is not None:
            return self._forward_regions(x, self.calls)
        b, s, d = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).view(b, s, 3, self.n_heads, d // self.n_heads).unbind(2)
        a = self.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        h = x + self.proj(a.transpose(1, 2).reshape(b, s, d))
        gate, up = self.gate_up(self.mlp_norm(h)).chunk(2, dim=-1)
        out: torch.Tensor = h + self.down(F.silu(gate) * up)
        return out

    def _forward_regions(self, x: torch.Tensor, calls: dict[str, Callable[..., torch.Tensor]]) -> torch.Tensor:
        """``forward`` with the matmuls and attention called through their regions: the same ops, in order."""
        b, s, d = x.shape
        qkv = calls["attn.qkv"](self.attn_norm(x), self.qkv.weight)
        q, k, v = qkv.view(b, s, 3, self.n_heads, d // self.n_heads).unbind(2)
        a = calls["attn.sdpa"](q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        h = x + calls["attn.proj"](a.transpose(1, 2).reshape(b, s, d), self.proj.weight)
        gate, up = calls["mlp.gate_up"](self.mlp_norm(h), self.gate_up.weight).chunk(2, dim=-1)
        return h + calls["mlp.down"](F.silu(gate) * up, self.down.weight)


class Transformer(nn.Module):
    """Token embedding, ``n_layers`` blocks, final norm and LM head; ``forward`` returns the mean LM loss.

    ``region`` wraps each block's matmuls and attention (see the module doc); the parameters are the same.
    """

    def __init__(self, cfg: ModelConfig, region: RegionWrap | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg, region) for _ in range(cfg.n_layers))
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
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())  # in float32 for bf16 models too


def random_tokens(
    cfg: ModelConfig, generator: torch.Generator, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of random (tokens, next-token targets) of the config's shape."""
    seq = torch.randint(cfg.vocab, (cfg.batch, cfg.seq_len + 1), generator=generator).to(device)
    return seq[:, :-1], seq[:, 1:]
