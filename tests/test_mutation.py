"""Saving an op that writes into its arguments keeps what it wrote, and replay writes it into the replayed buffers.

Covers aten in-place and ``out=`` ops, custom ops with ``mutates_args`` and HOPs that write into (nested)
arguments. Where a saved write cannot be served safely (modified again later, or invisible to sac2) the op is
recomputed with one warning naming it. In every case gradients are bit-for-bit those of the un-checkpointed run.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Callable

import torch
from expecttest import assert_expected_inline
from torch._C import DispatchKey
from torch._ops import HigherOrderOperator

import sac2

from helpers import OpRuns, contexts, exp_function, grads, inplace_chain, into_buffer, randn

aten = torch.ops.aten


def checkpoint_and_compare(
    fn: Callable[[torch.Tensor], torch.Tensor], policy: Any, ops: list[Any]
) -> tuple[dict[Any, int], list[str]]:
    """Checkpoint ``fn`` under ``policy``; assert output and gradient are bit-equal to the plain run and that each
    of ``ops`` ran in forward.

    Returns how often each of ``ops`` ran again in backward (0: served from what forward saved) and the sac2
    warnings raised."""
    x = randn(32)
    expected = fn(x)
    (expected_grad,) = grads(expected, (x,))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with OpRuns() as forward:
            out = sac2.checkpoint(fn, x, context_fn=contexts(policy))
        with OpRuns() as backward:
            (grad,) = grads(out, (x,))
    assert torch.equal(out, expected)
    assert torch.equal(grad, expected_grad)
    assert all(forward.counts[op] for op in ops), "an op under test did not run in forward"
    warned = [str(w.message) for w in caught if str(w.message).startswith("sac2")]
    return {op: backward.counts[op] for op in ops}, warned


INPLACE = [aten.add_.Tensor, aten.mul_.Tensor]


def test_saved_inplace_ops_write_into_replayed_buffers():
    rerun, warned = checkpoint_and_compare(inplace_chain, INPLACE, INPLACE)
    assert rerun == {aten.add_.Tensor: 0, aten.mul_.Tensor: 0}
    assert warned == []


def test_save_all_with_inplace_ops_keeps_the_inplace_writes():
    rerun, _ = checkpoint_and_compare(inplace_chain, lambda _ctx, _op, *args, **kwargs: True, INPLACE)
    assert rerun == {aten.add_.Tensor: 0, aten.mul_.Tensor: 0}


OutExp = exp_function(into_buffer(lambda x, out: torch.exp(x, out=out)))


def test_saved_out_variant_writes_into_replayed_buffer():
    rerun, _ = checkpoint_and_compare(lambda x: OutExp.apply(x.cos()) * x, [aten.exp.out], [aten.exp.out])
    assert rerun == {aten.exp.out: 0}


@torch.library.custom_op("test_mutation::exp_into", mutates_args=("out",))
def exp_into(x: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(x.exp())


CustomExp = exp_function(into_buffer(exp_into))


def test_saved_custom_op_with_mutates_args_writes_into_replayed_buffer():
    op = torch.ops.test_mutation.exp_into.default
    rerun, _ = checkpoint_and_compare(lambda x: CustomExp.apply(x.cos()) * x, [op], [op])
    assert rerun == {op: 0}


class WriteExp(HigherOrderOperator):
    """A user HOP writing ``exp(x)`` into ``buffers[0]``, visibly (a tensor op) or not (through ``.data``)."""

    def __init__(self) -> None:
        super().__init__("test_mutation_write_exp")

    def __call__(self, buffers, x, visible):
        return super().__call__(buffers, x, visible)


write_exp = WriteExp()
write_exp.fallthrough(DispatchKey.AutogradCPU)  # no autograd of its own: HopExp below gives the backward


@write_exp.py_impl(DispatchKey.CompositeExplicitAutograd)
def _write_exp_dense(buffers, x, visible):
    (buffers[0] if visible else buffers[0].data).copy_(x.exp())


class HopExp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, visible):
        out = torch.empty_like(x)
        write_exp([out], x, visible)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.saved_tensors[0], None


def test_saved_hop_writing_into_nested_argument_writes_into_replayed_buffer():
    rerun, warned = checkpoint_and_compare(lambda x: HopExp.apply(x.cos(), True) * x, [write_exp], [write_exp])
    assert rerun == {write_exp: 0}
    assert warned == []


def test_saved_inplace_op_modified_again_later_is_recomputed_with_one_warning():
    def fn(x):
        a = x * 2
        a.add_(1)
        a.mul_(3)
        return a.exp()

    rerun, warned = checkpoint_and_compare(fn, [aten.add_.Tensor], [aten.add_.Tensor])
    assert rerun == {aten.add_.Tensor: 1}
    assert_expected_inline(
        "\n".join(warned),
        """sac2: the policy saves aten.add_.Tensor (call 0 of that op, op 1 of the region), but a tensor it wrote was modified in place later in the forward, so the saved value is stale; sac2 recomputes this op in backward instead. Have the policy recompute it to silence this warning.""",  # noqa: E501
    )


def test_saved_hop_writing_invisibly_is_recomputed_with_one_warning():
    rerun, warned = checkpoint_and_compare(lambda x: HopExp.apply(x.cos(), False) * x, [write_exp], [write_exp])
    assert rerun == {write_exp: 1}
    assert_expected_inline(
        "\n".join(warned),
        """sac2: the policy saves test_mutation_write_exp, which returns nothing yet takes tensors, so it can only have written into them in ways sac2 cannot see or write back; it is recomputed in backward instead of saved.""",  # noqa: E501
    )


@dataclasses.dataclass
class _Buffers:
    """A registered pytree node holding the buffer a region writes into (a positional argument, not a container
    sac2 indexes)."""

    out: torch.Tensor


torch.utils._pytree.register_dataclass(_Buffers)


@sac2.region(name="test_mutation_fill")
def _fill(x: torch.Tensor, buffers: _Buffers) -> torch.Tensor:
    buffers.out.copy_(x.sin())  # a write sac2 can only see by walking the argument as a pytree
    return x.cos()


def _fill_then_use(x: torch.Tensor) -> torch.Tensor:
    buffers = _Buffers(torch.full_like(x, 7.0))
    return (_fill(x, buffers) * buffers.out * x).sum()  # the product saves the written buffer for backward


def test_a_saved_region_writing_into_a_pytree_node_argument_gives_no_checkpointing_gradients():
    x = randn(32)
    (expected,) = grads(_fill_then_use(x), (x,))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the write is one sac2 cannot write back: it runs the region again
        out = sac2.checkpoint(_fill_then_use, x, context_fn=contexts([sac2.Region("test_mutation_fill")]))
        (grad,) = grads(out, (x,))
    assert torch.equal(grad, expected)
