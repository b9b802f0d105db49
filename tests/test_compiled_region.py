"""``sac2.compiled_region()`` and ``sac2.region()``: compiled code inside selective checkpointing.

compiled_region: inside a sac2 forward or recompute its body runs with sac2's modes off the stack and torch's
dispatch-mode flags cleared, and everything is restored afterwards, by exception too, nested, and across threads.
region: each call is one op for the policy; saved, it never runs in backward; recomputed, it runs once.
"""

from __future__ import annotations

import threading
import warnings
from functools import partial
from typing import Any, Callable

import pytest
import torch
from expecttest import assert_expected_inline
from torch.utils._python_dispatch import TorchDispatchMode

import sac2
from sac2 import _compat

from helpers import contexts, counted_op, randn

DTYPE = torch.float64
NO_FLAGS = (False, False, False)
#: An identity op that counts its executions: how a test sees whether a region ran again in backward.
counted, counted_runs = counted_op("test_compiled_region")


def _recompute_all(_ctx, _op, *args, **kwargs) -> bool:
    return False


def _grad_and_backward_runs(fn: Callable, x: torch.Tensor, policy: Any) -> tuple[torch.Tensor, int]:
    out = sac2.checkpoint(fn, x, context_fn=contexts(policy))
    before = counted_runs()
    grad = torch.autograd.grad(out, x)[0]
    return grad, counted_runs() - before


class _Foreign(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def test_body_runs_with_no_sac2_mode_on_stack_and_flags_cleared():
    seen: dict[str, Any] = {}

    def fn(x):
        y = x.sin()
        with sac2.compiled_region():
            seen["stack"] = _compat.dispatch_mode_stack()
            seen["flags"] = _compat.dispatch_flags()
            y = y.cos().exp()
        return y.sum()

    sac2.checkpoint(fn, randn(5, dtype=DTYPE), context_fn=contexts(_recompute_all))
    assert seen == {"stack": [], "flags": NO_FLAGS}


def test_sac2_sees_no_dispatch_of_the_body():
    seen = []

    def policy(_ctx, op, *args, **kwargs):
        seen.append(str(op))
        return False

    def fn(x):
        y = x.sin()
        with sac2.compiled_region():
            y = y.cos().exp().tanh()
        return y.sum()

    x = randn(5, dtype=DTYPE)
    grad = torch.autograd.grad(sac2.checkpoint(fn, x, context_fn=contexts(policy)), x)[0]
    assert seen == ["aten.sin.default", "aten.sum.default"]  # forward only: recompute asks nothing
    assert torch.equal(grad, torch.autograd.grad(fn(x), x)[0])  # the body ran again in recompute


def test_restores_stack_and_flags_on_exit():
    seen: dict[str, Any] = {}

    def fn(x):
        before = (_compat.dispatch_mode_stack(), _compat.dispatch_flags())
        with sac2.compiled_region():
            pass
        seen["same"] = before == (_compat.dispatch_mode_stack(), _compat.dispatch_flags())
        seen["in_mode"] = _compat.dispatch_flags()
        return x.sin().sum()

    sac2.checkpoint(fn, randn(5, dtype=DTYPE), context_fn=contexts(_recompute_all))
    assert seen == {"same": True, "in_mode": (True, True, False)}
    assert (_compat.dispatch_mode_stack(), _compat.dispatch_flags()) == ([], NO_FLAGS)


def test_restores_stack_and_flags_when_the_body_raises():
    seen: dict[str, Any] = {}

    def fn(x):
        before = (_compat.dispatch_mode_stack(), _compat.dispatch_flags())
        try:
            with sac2.compiled_region():
                raise KeyError("boom")
        except KeyError:
            seen["same"] = before == (_compat.dispatch_mode_stack(), _compat.dispatch_flags())
        return x.sin().sum()

    sac2.checkpoint(fn, randn(5, dtype=DTYPE), context_fn=contexts(_recompute_all))
    assert seen == {"same": True}


def test_nests():
    seen: dict[str, Any] = {}

    def fn(x):
        stack = _compat.dispatch_mode_stack()
        with sac2.compiled_region():
            with sac2.compiled_region():
                seen["inner"] = _compat.dispatch_mode_stack()
            seen["after_inner"] = _compat.dispatch_mode_stack()
        seen["restored"] = _compat.dispatch_mode_stack() == stack
        return x.sin().sum()

    sac2.checkpoint(fn, randn(5, dtype=DTYPE), context_fn=contexts(_recompute_all))
    assert seen == {"inner": [], "after_inner": [], "restored": True}


def test_is_a_no_op_outside_sac():
    with _Foreign() as foreign:
        flags = _compat.dispatch_flags()
        with sac2.compiled_region():
            assert (_compat.dispatch_mode_stack(), _compat.dispatch_flags()) == ([foreign], flags)


def test_raises_naming_a_foreign_mode_above_sac2s():
    def fn(x):
        with _Foreign():
            with sac2.compiled_region():
                pass
        return x.sum()

    with pytest.raises(RuntimeError) as err:
        sac2.checkpoint(fn, randn(5, dtype=DTYPE), context_fn=contexts(_recompute_all))
    assert_expected_inline(
        str(err.value),
        """sac2.compiled_region: test_compiled_region._Foreign is on the dispatch-mode stack above sac2's modes; sac2 pops only its own modes, which must be innermost. Enter that mode outside the checkpointed function, or inside the region's body.""",  # noqa: E501
    )
    assert (_compat.dispatch_mode_stack(), _compat.dispatch_flags()) == ([], NO_FLAGS)


def test_in_place_write_in_the_body_to_a_saved_output_is_seen():
    def fn(x):
        y = x * 2  # saved
        with sac2.compiled_region():
            y.add_(1)  # makes the saved value stale: sac2 must notice although it does not see this op
        return (y * x).sum()

    x = randn(5, dtype=DTYPE)
    ref = torch.autograd.grad(fn(x), x)[0]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = sac2.checkpoint(fn, x, context_fn=contexts([torch.ops.aten.mul.Tensor]))
    assert any("modified in place" in str(w.message) for w in caught)
    assert torch.equal(torch.autograd.grad(out, x)[0], ref)


def test_compiled_code_in_the_body_compiles_with_gradients_of_the_uncheckpointed_run():
    compiled = torch.compile(lambda y: (y.sin() * y).cos(), backend="aot_eager")

    def fn(x):
        with sac2.compiled_region():
            y = compiled(x.exp())
        return y.sum()

    x = randn(5, dtype=DTYPE)
    torch._dynamo.utils.counters.clear()
    grad, _ = _grad_and_backward_runs(fn, x, [torch.ops.aten.exp.default])  # compiles under sac2
    assert dict(torch._dynamo.utils.counters["frames"]) == {"total": 1, "ok": 1}
    assert torch.equal(grad, torch.autograd.grad(fn(x), x)[0])


def test_overlapping_threads_leave_the_flags_cleared():
    # A enters, B enters, A exits, B exits: torch's own save/restore leaves the flags stuck True here.
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()
    seen: dict[str, Any] = {}

    def forward_a(x):
        a_in.set()
        b_in.wait(10)
        return x.sin()

    def forward_b(x):
        b_in.set()
        a_out.wait(10)
        seen["b_inside"] = _compat.dispatch_flags()
        return x.sin()

    def a():
        sac2.checkpoint(forward_a, randn(5, dtype=DTYPE), context_fn=contexts(_recompute_all))
        a_out.set()

    def b():
        a_in.wait(10)
        sac2.checkpoint(forward_b, randn(5, dtype=DTYPE), context_fn=contexts(_recompute_all))

    threads = [threading.Thread(target=a), threading.Thread(target=b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen == {"b_inside": (True, True, False)}
    assert _compat.dispatch_flags() == NO_FLAGS


def test_four_concurrent_threads_restore_stack_and_flags():
    barrier = threading.Barrier(4, timeout=20)
    inside, grads = [], []

    def fn(x):
        y = x.sin()
        with sac2.compiled_region():
            barrier.wait()  # all four threads are inside a region body at once, in forward and in recompute
            inside.append(_compat.dispatch_mode_stack())
            y = y.cos()
        return y.exp().sum()

    x = randn(5, dtype=DTYPE)
    ref = torch.autograd.grad(_plain(x), x)[0]

    def work():
        out = sac2.checkpoint(fn, x, context_fn=contexts([torch.ops.aten.sin.default]))
        grads.append(torch.autograd.grad(out, x)[0])

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert inside == [[]] * 8
    assert all(torch.equal(g, ref) for g in grads) and len(grads) == 4
    assert (_compat.dispatch_mode_stack(), _compat.dispatch_flags()) == ([], NO_FLAGS)


def _plain(x: torch.Tensor) -> torch.Tensor:
    return x.sin().cos().exp().sum()


@sac2.region(name="attn")
def _attn(x: torch.Tensor) -> torch.Tensor:
    return counted(x).sin()


def _block(x: torch.Tensor) -> torch.Tensor:
    return (_attn(x.cos()) * x).exp().sum()


def _saving_regions(_ctx, op, *args, **kwargs) -> bool:
    return isinstance(op, sac2.Region)


@pytest.fixture
def x() -> torch.Tensor:
    return randn(5, dtype=DTYPE)


@pytest.fixture
def ref(x) -> torch.Tensor:
    """``_block``'s gradient without checkpointing."""
    return torch.autograd.grad(_block(x), x)[0]


def test_saved_region_does_not_run_in_backward(x, ref):
    grad, backward_runs = _grad_and_backward_runs(_block, x, _saving_regions)
    assert backward_runs == 0
    assert torch.equal(grad, ref)


def test_recomputed_region_runs_once_in_backward(x, ref):
    grad, backward_runs = _grad_and_backward_runs(_block, x, _recompute_all)
    assert backward_runs == 1
    assert torch.equal(grad, ref)


def test_policy_sees_one_op_named_as_given_before_the_body_runs(x):
    seen = []

    def policy(ctx, op, *args, **kwargs):
        seen.append((op, ctx.op_output, len(args)))
        return False

    sac2.checkpoint(_block, x, context_fn=contexts(policy))
    assert [s for s in seen if isinstance(s[0], sac2.Region)] == [(sac2.Region("attn"), None, 1)]


def test_default_name_is_the_qualname(x):
    assert _region_names(x, sac2.region(_plain)) == ["_plain"]


def test_decorator_with_name_and_call_form_name_the_region(x):
    @sac2.region(name="mlp")
    def decorated(x):
        return x.sin()

    assert _region_names(x, decorated) + _region_names(x, sac2.region(torch.cos, name="c")) == ["mlp", "c"]


def _region_names(x: torch.Tensor, fn: Callable) -> list[str]:
    seen = []

    def policy(_ctx, op, *args, **kwargs):
        seen.append(op)
        return False

    sac2.checkpoint(lambda x: fn(x).sum(), x, context_fn=contexts(policy))
    return [op.name for op in seen if isinstance(op, sac2.Region)]


def test_region_in_a_save_list_is_saved(x, ref):
    grad, backward_runs = _grad_and_backward_runs(_block, x, [sac2.Region("attn")])
    assert backward_runs == 0
    assert torch.equal(grad, ref)


def test_outside_sac_a_region_just_calls_fn(x):
    before = counted_runs()
    assert torch.equal(_attn(x), counted(x).sin())
    assert counted_runs() - before == 2


def test_saved_region_keeps_later_random_ops_in_step(x):
    @sac2.region(name="noisy")
    def noisy(x):
        return torch.nn.functional.dropout(x, 0.5).sin()

    def fn(x):
        return torch.nn.functional.dropout(noisy(x), 0.5).sum()

    torch.manual_seed(0)
    ref = torch.autograd.grad(fn(x), x)[0]
    torch.manual_seed(0)
    grad, _ = _grad_and_backward_runs(fn, x, _saving_regions)
    assert torch.equal(grad, ref)


def test_saved_region_modified_later_runs_again_with_a_warning(x):
    def fn(x):
        y = _attn(x)
        y.mul_(2)
        return (y * x).sum()

    ref = torch.autograd.grad(fn(x), x)[0]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        grad, backward_runs = _grad_and_backward_runs(fn, x, _saving_regions)
    assert_expected_inline(
        "\n".join(str(w.message) for w in caught),
        """sac2: the policy saves region 'attn' (call 0 of that op, op 0 of the region), but a tensor it returned or wrote was modified in place after it ran, so the saved value is stale; sac2 runs the region again in backward instead. Have the policy recompute it to silence this warning.""",  # noqa: E501
    )
    assert backward_runs == 1
    assert torch.equal(grad, ref)


@sac2.region(name="write_exp")
def _write_exp(x: torch.Tensor, out: torch.Tensor) -> None:
    out.data.copy_(x.exp())  # through .data: no version bump, a write sac2 cannot see


def test_saved_region_returning_nothing_runs_again_in_backward_with_a_warning():
    def fn(x):
        out = torch.empty_like(x)
        _write_exp(x.detach(), out)
        return (out * x).sum()

    x = torch.randn(8, dtype=torch.float64, requires_grad=True)
    context_fn = partial(sac2.create_selective_checkpoint_contexts, [sac2.Region("write_exp")])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        grad = torch.autograd.grad(sac2.checkpoint(fn, x, context_fn=context_fn), x)[0]
    assert_expected_inline("\n".join(str(w.message) for w in caught), """sac2: the policy saves region 'write_exp', which returns nothing yet takes tensors, so it can only have written into them in ways sac2 cannot see or write back; it is recomputed in backward instead of saved.""")  # noqa: E501
    assert torch.equal(grad, torch.autograd.grad(fn(x), x)[0])
