"""What several test files share: input makers, a llama-style block, op-run counters, the
"exp into a buffer" autograd.Function factory and the docs' code-block extraction.

Imported as ``from helpers import ...`` (tests/conftest.py puts this folder on ``sys.path``). Custom ops are
registered here once per process, under the ``sac2_test_helpers`` namespace.
"""

from __future__ import annotations

import contextlib
import functools
import io
import re
from collections import Counter
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import sac2
from sac2.__main__ import main

__all__ = [
    "ROOT",
    "cli_error",
    "COUNTED",
    "randn",
    "grads",
    "outputs_and_grads",
    "assert_same_as_without_checkpointing",
    "STYLES",
    "backward_in_style",
    "bitwise_equal",
    "contexts",
    "WrittenRMSNorm",
    "Block",
    "OpRuns",
    "counted_op",
    "scaling_op",
    "exp_function",
    "into_buffer",
    "python_blocks",
    "inplace_chain",
]

ROOT = Path(__file__).resolve().parent.parent


# ---- inputs ----


def randn(*shape: int, seed: int = 0, dtype: torch.dtype = torch.float32, grad: bool = True) -> torch.Tensor:
    """A seeded ``randn`` leaf (requiring grad unless ``grad=False``): the same numbers in every run."""
    t = torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)
    return t.requires_grad_(grad)


def grads(out: torch.Tensor, inputs: tuple[torch.Tensor, ...] | list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """Gradients of ``out.sum()`` with respect to ``inputs``."""
    return torch.autograd.grad(out.sum(), tuple(inputs))


#: The seam matrix's backward styles: once, twice with ``retain_graph``, double backward, ``backward(inputs=...)``.
STYLES = ("once", "retain_graph", "double", "inputs")


def backward_in_style(style: str, loss: torch.Tensor, leaves: list[torch.Tensor],
                      inputs: list[torch.Tensor]) -> list[torch.Tensor | None]:
    """Backward of ``loss`` in ``style`` (one of ``STYLES``); the ``.grad`` of ``leaves`` after it (of ``inputs``,
    the only ones it reaches, for ``"inputs"``; ``"double"`` backpropagates the sum of the squared gradients)."""
    if style == "once":
        loss.backward()
    elif style == "retain_graph":
        loss.backward(retain_graph=True)
        loss.backward()
    elif style == "inputs":
        loss.backward(inputs=inputs)
        return [t.grad for t in inputs]
    elif style == "double":
        firsts = torch.autograd.grad(loss, leaves, create_graph=True, allow_unused=True)
        squares = [g.square().sum() for g in firsts if g is not None]
        sum(squares[1:], squares[0]).backward()  # a tensor's sum: no int 0 to start from
    else:
        raise ValueError(f"unknown backward style {style!r}")
    return [t.grad for t in leaves]


def _leaf(t: Any) -> Any:
    return t.detach().clone().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) else t


def outputs_and_grads(
    run: Callable[..., Any], fn: Callable[..., Any], *inputs: Any, loss: Callable[[Any], torch.Tensor] | None = None
) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
    """``run(fn, *inputs)`` on fresh copies of ``inputs`` (leaves requiring grad as theirs do), then
    ``loss(out).backward()`` (default: the sum of every output's sum): the outputs, and the gradients of the
    inputs that require grad and of ``fn``'s parameters if it is a module (None where none reached it)."""
    leaves = [_leaf(t) for t in inputs]
    params = list(fn.parameters()) if isinstance(fn, nn.Module) else []
    for q in params:
        q.grad = None
    out = run(fn, *leaves)
    outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
    if loss is not None:
        loss(out).backward()
    else:
        sums = [o.sum() for o in outs if o.requires_grad]
        functools.reduce(lambda a, b: a + b, sums[1:], sums[0]).backward()
    wrt = [t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad] + params
    return [o.detach() for o in outs], [t.grad for t in wrt]


def _plain_call(fn: Callable[..., Any], *inputs: Any) -> Any:
    return fn(*inputs)


def assert_same_as_without_checkpointing(
    run: Callable[..., Any],
    fn: Callable[..., Any],
    *inputs: Any,
    reference: Callable[..., Any] = _plain_call,
    loss: Callable[[Any], torch.Tensor] | None = None,
    rtol: float | None = None,
    atol: float | None = None,
) -> None:
    """The oracle: ``run(fn, *inputs)`` (a checkpointed run) gives the outputs and gradients of ``reference(fn,
    *inputs)`` (default: ``fn(*inputs)``, no checkpointing), bit for bit, or within ``rtol``/``atol`` when given
    (compiled code, which may fuse a recomputed graph differently). Both start from the same global RNG state."""
    state = torch.get_rng_state()
    want = outputs_and_grads(reference, fn, *inputs, loss=loss)
    torch.set_rng_state(state)
    got = outputs_and_grads(run, fn, *inputs, loss=loss)
    for g, w in zip([*got[0], *got[1]], [*want[0], *want[1]], strict=True):
        if g is None or w is None:
            assert g is None and w is None, "a gradient reached one run and not the other"
        elif rtol is None and atol is None:
            assert torch.equal(g, w), f"differs from no checkpointing: max |diff| {(g - w).abs().max()}"
        else:
            torch.testing.assert_close(g, w, rtol=rtol, atol=atol)


def bitwise_equal(got: list[torch.Tensor | None], reference: list[torch.Tensor | None]) -> bool:
    """Whether two lists of gradients are the same bit for bit (None where the other is None)."""
    return all((g is None and r is None) or (g is not None and r is not None and torch.equal(g, r))
               for g, r in zip(got, reference, strict=True))


def contexts(policy: Any, *, factory: bool = False, **kwargs: Any) -> Callable[[], tuple[Any, Any]]:
    """A ``context_fn`` giving sac2's (forward, recompute) modes for ``policy``, fresh for each forward.

    ``kwargs`` go to ``create_selective_checkpoint_contexts``. With ``factory=True``, ``policy`` is a function
    making the policy, called for each forward: a policy with state (a counter) starts afresh every time. The
    result is a ``functools.partial`` of sac2's function, so it pickles where the policy does.
    """
    if factory:
        return lambda: sac2.create_selective_checkpoint_contexts(policy(), **kwargs)
    return functools.partial(sac2.create_selective_checkpoint_contexts, policy, **kwargs)


# ---- a model ----


class WrittenRMSNorm(nn.Module):
    """An RMSNorm written out (pow, mean, rsqrt), as users write theirs: dynamo compiles its forward (torch's own
    ``nn.RMSNorm`` it runs as is), and it has a double backward on every torch."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class Block(nn.Module):
    """A tiny llama-style block: RMSNorm, fused QKV, causal SDPA, SwiGLU MLP, residuals, optional dropout."""

    def __init__(self, d: int = 32, heads: int = 4, p: float = 0.0) -> None:
        super().__init__()
        self.heads, self.p = heads, p
        self.n1, self.n2 = nn.RMSNorm(d), nn.RMSNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.o = nn.Linear(d, d, bias=False)
        self.gate, self.up = nn.Linear(d, 2 * d, bias=False), nn.Linear(d, 2 * d, bias=False)
        self.down = nn.Linear(2 * d, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.n1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + F.dropout(self.o(a), self.p)
        h = self.n2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


# ---- what really ran ----


class OpRuns(TorchDispatchMode):
    """Counts each op (aten op or HOP) that reaches it, by op.

    Entered around ``sac2.checkpoint`` and backward, it sits below sac2's modes: it sees every op sac2 runs (in
    forward and in recompute) and none that sac2 serves from what it saved. Compiled code still compiles under
    it, as under sac2's modes.
    """

    supports_higher_order_operators = True

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter = Counter()
        self.out_bytes: Counter = Counter()  # per op, the bytes of the storages its runs returned

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        self.counts[func] += 1
        out = func(*args, **(kwargs or {}))
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in _tensors(out)}
        self.out_bytes[func] += sum(storages.values())
        return out


def _tensors(out: Any) -> list[torch.Tensor]:
    return [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]


_counts: Counter = Counter()


@torch.library.custom_op("sac2_test_helpers::counted", mutates_args=())
def _counted(x: torch.Tensor, name: str) -> torch.Tensor:
    _counts[name] += 1
    return x.clone()


_counted.register_fake(lambda x, _name: torch.empty_like(x))
_counted.register_autograd(lambda _ctx, grad: (grad, None))


def counted_op(name: str) -> tuple[Callable[[torch.Tensor], torch.Tensor], Callable[[], int]]:
    """(an identity custom op that counts its runs under ``name``, a function returning that count so far).

    Put it into the body of a region, a HOP or compiled code to see how often that body really runs; it is
    an ordinary op for the policy (``torch.ops.sac2_test_helpers.counted.default``) where sac2 sees it.
    """
    return (lambda x: _counted(x, name)), (lambda: _counts[name])


COUNTED = torch.ops.sac2_test_helpers.counted.default


def scaling_op(qualname: str, runs: dict[str, int], scale: float) -> Callable[[torch.Tensor], torch.Tensor]:
    """A custom op ``qualname`` computing ``x * scale`` that counts its runs in ``runs[its name]``: a distinct op
    a policy can save or recompute, whose count shows what ran again (in eager and in compiled code alike)."""
    name = qualname.split("::")[1]

    @torch.library.custom_op(qualname, mutates_args=())
    def op(x: torch.Tensor) -> torch.Tensor:
        runs[name] += 1
        return x * scale

    op.register_fake(lambda x: torch.empty_like(x))
    op.register_autograd(lambda _ctx, grad: grad * scale)
    return op


# ---- exp through a buffer ----


def exp_function(compute: Callable[[torch.Tensor], torch.Tensor]) -> type[torch.autograd.Function]:
    """exp as an autograd.Function computed by ``compute(x)`` (into a buffer, by a kernel, ...); its backward reads
    that output, so a saved writer that lost what it wrote gives a wrong gradient."""

    class Exp(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            out = compute(x)
            ctx.save_for_backward(out)
            return out

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
            (out,) = ctx.saved_tensors
            return grad * out

    return Exp


def into_buffer(write: Callable[[torch.Tensor, torch.Tensor], object]) -> Callable[[torch.Tensor], torch.Tensor]:
    """``compute`` for ``exp_function``: ``write(x, out)`` fills an ``empty_like(x)`` buffer."""

    def compute(x: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(x)
        write(x, out)
        return out

    return compute


# ---- docs ----


def python_blocks(doc: str | Path) -> list[str]:
    """The ```python code blocks of a Markdown file (a path relative to the repository root), in order."""
    return re.findall(r"```python\n(.*?)```", (ROOT / doc).read_text(), flags=re.S)


def inplace_chain(x: torch.Tensor) -> torch.Tensor:
    """Two ops whose outputs are modified in place before anything else reads them (a save-everything policy
    saves them stale), then exp."""
    a = x * 2
    a.add_(1)
    b = a.sin()
    b.mul_(3)
    return b.exp()


def cli_error(argv: list[str]) -> str:
    """Run ``sac2 ARGV...``, which must exit 2 after its usage line and one error line; return the error line."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as exit:
        main(argv)
    assert exit.value.code == 2, err.getvalue()
    lines = err.getvalue().splitlines()
    assert lines[0].startswith("usage: sac2"), err.getvalue()
    assert [line for line in lines if "error:" in line] == lines[-1:], err.getvalue()
    return lines[-1]
