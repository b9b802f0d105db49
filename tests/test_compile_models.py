"""torch.compile over sac2 on realistic blocks, through every entry point.

A pre-norm block as LLMs have it (RMSNorm, bias-free ``nn.Linear`` on [batch, seq, dim] input, causal SDPA,
SwiGLU), with two counting custom ops inside: one the policy saves, one it must recompute. Under
``torch.compile`` every entry point gives the gradients of the compiled un-checkpointed block, and the policy is
really applied: the saved op does not run again in backward, the recomputed one runs exactly once more (full AC
runs both again).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import sac2
from sac2.bench.models import CONFIGS, Transformer, random_tokens

from helpers import scaling_op

runs = {"saved": 0, "recomputed": 0}


saved_op = scaling_op("sac2_test_compile_models::saved", runs, 2)
recomputed_op = scaling_op("sac2_test_compile_models::recomputed", runs, 2)
SAVED = torch.ops.sac2_test_compile_models.saved.default
RECOMPUTED = torch.ops.sac2_test_compile_models.recomputed.default


class Block(nn.Module):
    def __init__(self, dim: int = 32, heads: int = 4, attention: Callable | None = None) -> None:
        super().__init__()
        self.heads = heads
        self.attn_norm, self.mlp_norm = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.out = nn.Linear(dim, dim, bias=False)
        self.gate, self.up = nn.Linear(dim, 2 * dim, bias=False), nn.Linear(dim, 2 * dim, bias=False)
        self.down = nn.Linear(2 * dim, dim, bias=False)
        self.attention = attention or _attention

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).view(b, s, 3, self.heads, d // self.heads).unbind(2)
        a = self.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        x = x + self.out(saved_op(a.transpose(1, 2).reshape(b, s, d)))
        h = self.mlp_norm(x)
        return x + self.down(recomputed_op(F.silu(self.gate(h)) * self.up(h)))


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def _policy(_ctx, op, *args, **kwargs) -> sac2.CheckpointPolicy:
    if op is SAVED or isinstance(op, sac2.Region):
        return sac2.CheckpointPolicy.MUST_SAVE
    if op is RECOMPUTED:
        return sac2.CheckpointPolicy.MUST_RECOMPUTE
    if op in (torch.ops.aten.mm.default, torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default):
        return sac2.CheckpointPolicy.PREFER_SAVE
    return sac2.CheckpointPolicy.PREFER_RECOMPUTE


CONTEXT_FN = functools.partial(sac2.create_selective_checkpoint_contexts, _policy)
SELECTIVE, FULL = {"saved": 0, "recomputed": 1}, {"saved": 1, "recomputed": 1}


class Stack(nn.Module):
    def __init__(self, **block_kwargs) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block(**block_kwargs) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _checkpoint_call(context: bool) -> Callable[[nn.Module], Callable]:
    kwargs: dict[str, Any] = {"context_fn": CONTEXT_FN} if context else {}
    return lambda block: lambda x: sac2.checkpoint(block, x, **kwargs)


def _wrapper(context: bool) -> Callable[[nn.Module], Callable]:
    kwargs: dict[str, Any] = {"context_fn": CONTEXT_FN} if context else {}
    return lambda block: sac2.checkpoint_wrapper(block, **kwargs)


def _module(block: nn.Module) -> Callable:
    return sac2.checkpoint_module(block, context_fn=CONTEXT_FN)


def _apply_ac(mode: str) -> Callable[[nn.Module], Callable]:
    def build(block: nn.Module) -> Callable:
        stack = nn.Sequential()
        stack.layers = nn.ModuleList([block])
        kwargs: dict[str, Any] = {"policy": _policy} if mode == "selective" else {}
        sac2.apply_ac(stack, mode, **kwargs)
        return stack.layers[0]

    return build


ENTRY_POINTS = {
    "checkpoint_selective": (_checkpoint_call(True), SELECTIVE),
    "checkpoint_full": (_checkpoint_call(False), FULL),
    "checkpoint_wrapper_selective": (_wrapper(True), SELECTIVE),
    "checkpoint_wrapper_full": (_wrapper(False), FULL),
    "checkpoint_module": (_module, SELECTIVE),
    "apply_ac_selective": (_apply_ac("selective"), SELECTIVE),
    "apply_ac_full": (_apply_ac("full"), FULL),
}


def _input() -> torch.Tensor:
    return torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(1)).requires_grad_()


def _block(**kwargs) -> Block:
    torch.manual_seed(0)
    return Block(**kwargs)


def _grads_and_backward_runs(fn: Callable, module: nn.Module) -> tuple[list[torch.Tensor], dict]:
    x = _input()
    out = fn(x).pow(2).mean()
    runs.update(saved=0, recomputed=0)
    grads = torch.autograd.grad(out, [x, *module.parameters()])
    return list(grads), dict(runs)


def _compiled_reference(backend: str, **block_kwargs) -> list[torch.Tensor]:
    torch._dynamo.reset()
    block = _block(**block_kwargs)
    return _grads_and_backward_runs(torch.compile(block, backend=backend), block)[0]


def _assert_close(actual: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    for a, e in zip(actual, expected, strict=True):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def aot_eager_reference() -> list[torch.Tensor]:
    return _compiled_reference("aot_eager")


@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
def test_entry_point_under_compile_matches_compiled_no_checkpoint_and_applies_the_policy(entry, aot_eager_reference):
    build, expected_runs = ENTRY_POINTS[entry]
    torch._dynamo.reset()
    block = _block()
    grads, backward_runs = _grads_and_backward_runs(torch.compile(build(block), backend="aot_eager"), block)
    assert backward_runs == expected_runs
    _assert_close(grads, aot_eager_reference)


def test_fullgraph_compile_of_a_selective_checkpoint(aot_eager_reference):
    torch._dynamo.reset()
    block = _block()
    compiled = torch.compile(_checkpoint_call(True)(block), backend="aot_eager", fullgraph=True)
    grads, backward_runs = _grads_and_backward_runs(compiled, block)
    assert backward_runs == SELECTIVE
    _assert_close(grads, aot_eager_reference)


def test_saved_region_under_compile_is_decided_as_one_op():
    # The region holds an op the policy would recompute on its own: saved as a region, it does not run again.
    def attention(q, k, v):
        return recomputed_op(_attention(q, k, v))

    region = sac2.region(attention, name="compile_models.attn")
    reference = _compiled_reference("aot_eager", attention=region)
    torch._dynamo.reset()
    block = _block(attention=region)
    fn = torch.compile(_checkpoint_call(True)(block), backend="aot_eager")
    grads, backward_runs = _grads_and_backward_runs(fn, block)
    assert backward_runs == SELECTIVE  # only the MLP's recomputed op runs again
    _assert_close(grads, reference)


def test_inductor_compiled_selective_checkpoint_matches_compiled_no_checkpoint():
    reference = _compiled_reference("inductor")
    torch._dynamo.reset()
    block = _block()
    grads, backward_runs = _grads_and_backward_runs(torch.compile(_checkpoint_call(True)(block)), block)
    assert backward_runs == SELECTIVE
    _assert_close(grads, reference)


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_the_bench_transformer_trains_under_compile_as_without_checkpointing(mode):
    cfg = CONFIGS["tiny"]
    tokens, targets = random_tokens(cfg, torch.Generator().manual_seed(0), torch.device("cpu"))

    def train(ac: str) -> list[float]:
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = Transformer(cfg)
        if ac != "none":
            sac2.apply_ac(model, ac)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        step = torch.compile(model, backend="aot_eager")
        losses = []
        for _ in range(2):
            loss = step(tokens, targets)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses

    torch.testing.assert_close(train(mode), train("none"), rtol=1e-5, atol=1e-6)
