"""torch.compile over sac2's entry points called the way users call torch's: without a ``context_fn``.

Dynamo's checkpoint handler takes any ``context_fn`` it is handed as a selective policy and rejects torch's own
default when passed explicitly, so sac2 must forward only what the user gave; and it accepts only plain functions
and partials, so sac2 hands it the user's ``context_fn`` itself (saved-tensor hooks are skipped under compile).
"""

from __future__ import annotations

from functools import partial
from typing import Callable

import torch
from torch import nn
from torch._dynamo.utils import counters
from torch.autograd.graph import saved_tensors_hooks

import sac2

from helpers import assert_same_as_without_checkpointing


class _Block(nn.Module):
    """A bias-free linear layer and an RMSNorm-like scaling: the shape of a transformer block's first half."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 16, bias=False)
        self.scale = nn.Parameter(torch.ones(16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * self.scale


X = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(0), requires_grad=True)


def _compiled(forward: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[nn.Module, torch.Tensor], torch.Tensor]:
    compiled = torch.compile(forward, backend="aot_eager")
    return lambda _block, x: compiled(x)


def test_compiled_checkpoint_without_context_fn_matches_compiled_no_checkpoint() -> None:
    torch._dynamo.reset()
    block = _Block()
    assert_same_as_without_checkpointing(_compiled(lambda x: sac2.checkpoint(block, x)), block, X,
                                         reference=_compiled(lambda x: block(x)), rtol=1e-5, atol=1e-6)


def test_compiled_decorated_checkpoint_matches_compiled_no_checkpoint() -> None:
    torch._dynamo.reset()
    block = _Block()
    checkpointed = sac2.checkpoint(use_reentrant=False)(block)
    assert_same_as_without_checkpointing(_compiled(lambda x: checkpointed(x)), block, X,
                                         reference=_compiled(lambda x: block(x)), rtol=1e-5, atol=1e-6)


def test_compiled_checkpoint_under_user_hooks_compiles_without_graph_breaks() -> None:
    torch._dynamo.reset()
    counters.clear()
    block = _Block()
    context_fn = partial(sac2.create_selective_checkpoint_contexts, [torch.ops.aten.mm.default])
    compiled = _compiled(lambda x: sac2.checkpoint(block, x, context_fn=context_fn, respect_saved_tensors_hooks=True))

    def under_hooks(b: nn.Module, x: torch.Tensor) -> torch.Tensor:
        with saved_tensors_hooks(lambda t: t, lambda t: t):
            return compiled(b, x)

    assert_same_as_without_checkpointing(under_hooks, block, X, reference=_compiled(lambda x: block(x)),
                                         rtol=1e-5, atol=1e-6)
    assert not counters["graph_break"]
