"""Every sac2 error, pinned: it names the op, the call index and the fix, and leaves no global state behind."""

from __future__ import annotations

import warnings
from functools import partial
from typing import Any, Callable

import pytest
import torch
import torch.utils.checkpoint as tuc
from expecttest import assert_expected_inline
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack, is_in_torch_dispatch_mode

import sac2

from helpers import contexts, randn

aten = torch.ops.aten


def _returning(value: Any) -> Callable:
    return lambda _ctx, _op, *args, **kwargs: value


# Flipped between forward and backward to make recompute run other ops than forward did.
_in_forward = True


def _other_op_in_recompute(a: torch.Tensor) -> torch.Tensor:
    h = a.sin() if _in_forward else a.cos()
    return h.exp()


def _extra_call_in_recompute(a: torch.Tensor) -> torch.Tensor:
    y = a.sin().exp()
    return y if _in_forward else y.mul(2)


def _missing_call_in_recompute(a: torch.Tensor) -> torch.Tensor:
    y = a.sin().exp()
    return y.mul(2) if _in_forward else y


def _returns_saved_mm(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    h = torch.mm(a, a)  # saved; autograd itself keeps no reference to h (mul by 2 saves nothing)
    return h, (h * 2).sin()


def _assert_no_mode_left() -> None:
    assert _get_current_dispatch_mode_stack() == []
    assert not is_in_torch_dispatch_mode()


def test_op_overload_packet_in_list_names_the_default_overload() -> None:
    with pytest.raises(ValueError) as cm:
        sac2.create_selective_checkpoint_contexts([aten.mm.default, aten.mm])  # type: ignore[list-item]  # on purpose
    assert_expected_inline(str(cm.value), """Expected op in `op_list` to be an OpOverload but got aten.mm of type <class 'torch._ops.OpOverloadPacket'>. Please update the OpOverloadPacket to a specific OpOverload: an OpOverloadPacket names every overload of the op; list the overload the op runs as, e.g. aten.mm.default.""")  # noqa: E501


def test_non_op_in_list() -> None:
    with pytest.raises(ValueError) as cm:
        sac2.create_selective_checkpoint_contexts([aten.mm.default, "mm"])  # type: ignore[list-item]  # on purpose
    assert_expected_inline(str(cm.value), """Expected op in `op_list` to be an OpOverload, a higher-order op or a sac2.Region, but got 'mm' (type str); list OpOverloads such as torch.ops.aten.mm.default, higher-order ops such as torch.ops.higher_order.flex_attention, or regions such as sac2.Region('attn').""")  # noqa: E501


def test_non_callable_non_list_policy() -> None:
    with pytest.raises(TypeError) as cm:
        sac2.create_selective_checkpoint_contexts(aten.mm.default.name())
    assert_expected_inline(str(cm.value), """policy_fn_or_list must be either a function or a list of ops. Got str: pass a policy function, a sac2 policy or a list such as [torch.ops.aten.mm.default].""")  # noqa: E501


def _forward_error(value: Any) -> str:
    x = randn(3, 3, dtype=torch.float64)
    with pytest.raises(TypeError) as cm:
        sac2.checkpoint(lambda a: torch.mm(a, a).sin(), x, context_fn=contexts(_returning(value)))
    _assert_no_mode_left()
    return str(cm.value)


def test_policy_returning_int_raises_in_forward() -> None:
    assert_expected_inline(_forward_error(1), """sac2: the policy returned 1 (type int) for aten.mm.default (call 0); a policy must return a CheckpointPolicy member or a bool (True saves).""")  # noqa: E501


def test_policy_returning_str_raises_in_forward() -> None:
    assert_expected_inline(_forward_error("save"), """sac2: the policy returned 'save' (type str) for aten.mm.default (call 0); a policy must return a CheckpointPolicy member or a bool (True saves).""")  # noqa: E501


def test_policy_returning_none_raises_in_forward() -> None:
    assert_expected_inline(_forward_error(None), """sac2: the policy returned None (type NoneType) for aten.mm.default (call 0); a policy must return a CheckpointPolicy member or a bool (True saves).""")  # noqa: E501


def test_bad_policy_value_error_survives_tensor_operators() -> None:
    with pytest.raises(TypeError) as info:
        sac2.checkpoint(lambda a: a * a, randn(3, 3, dtype=torch.float64), context_fn=contexts(_returning(None)))
    assert "the policy returned None" in str(info.value)


def _backward_error(fn: Callable, **checkpoint_kwargs: Any) -> str:
    global _in_forward
    _in_forward = True
    y = sac2.checkpoint(fn, randn(3, 3, dtype=torch.float64), context_fn=contexts([]), **checkpoint_kwargs)
    _in_forward = False
    try:
        with pytest.raises(RuntimeError) as cm:
            y.sum().backward()
    finally:
        _in_forward = True
    _assert_no_mode_left()
    return str(cm.value)


def test_other_op() -> None:
    assert_expected_inline(_backward_error(_other_op_in_recompute), """sac2: recompute diverged from forward at op 0 of the region: forward ran aten.sin.default (call 0 of that op, op 0 of the region), recompute ran aten.cos.default. The checkpointed function must run the same ops in backward as in forward: look for control flow that depends on global state, on data that changed since forward, or on whether a tensor requires grad, and for state the function updates as it runs, such as a KV cache (Hugging Face models: pass use_cache=False when training with checkpointing).""")  # noqa: E501


def test_extra_call() -> None:
    assert_expected_inline(_backward_error(_extra_call_in_recompute, early_stop=False), """sac2: recompute ran aten.mul.Tensor as op 2 of the region, but the forward ran only 2 ops. The checkpointed function must run the same ops in backward as in forward: look for control flow that depends on global state, on data that changed since forward, or on whether a tensor requires grad, and for state the function updates as it runs, such as a KV cache (Hugging Face models: pass use_cache=False when training with checkpointing).""")  # noqa: E501


def test_missing_call() -> None:
    assert_expected_inline(_backward_error(_missing_call_in_recompute, early_stop=False), """sac2: recompute ended after 2 ops, but the forward ran 3; the first op missing is aten.mul.Tensor (call 0 of that op, op 2 of the region). The checkpointed function must run the same ops in backward as in forward: look for control flow that depends on global state, on data that changed since forward, or on whether a tensor requires grad, and for state the function updates as it runs, such as a KV cache (Hugging Face models: pass use_cache=False when training with checkpointing).""")  # noqa: E501


def _mm_sin(a: torch.Tensor) -> torch.Tensor:
    return torch.mm(a, a).sin()


def test_without_retain_graph_raises_torch_error() -> None:
    y = sac2.checkpoint(_mm_sin, randn(3, 3, dtype=torch.float64), context_fn=contexts([aten.mm.default]))
    y.sum().backward()
    with pytest.raises(RuntimeError) as cm:
        y.sum().backward()
    assert_expected_inline(str(cm.value), """Trying to backward through the graph a second time (or directly access saved tensors after they have already been freed). Saved intermediate values of the graph are freed when you call .backward() or autograd.grad(). Specify retain_graph=True if you need to backward through the graph a second time or if you need to access saved tensors after calling backward.""")  # noqa: E501


def test_with_retain_graph_accumulates_gradients() -> None:
    x_ref, x = randn(3, 3, dtype=torch.float64), randn(3, 3, dtype=torch.float64)
    y_ref = _mm_sin(x_ref)
    y = sac2.checkpoint(_mm_sin, x, context_fn=contexts([aten.mm.default]))
    for _ in range(2):
        y_ref.sum().backward(retain_graph=True)
        y.sum().backward(retain_graph=True)
    assert torch.equal(x.grad, x_ref.grad)


@pytest.mark.xfail(strict=True, raises=RuntimeError, reason="stock SAC allows only one backward per region")
def test_stock_sac_cannot_backward_twice_with_retain_graph() -> None:
    context_fn = partial(tuc.create_selective_checkpoint_contexts, [aten.mm.default])
    y = tuc.checkpoint(_mm_sin, randn(3, 3, dtype=torch.float64), use_reentrant=False, context_fn=context_fn)
    y.sum().backward(retain_graph=True)
    y.sum().backward()


def _backward_after_caller_mutates_output(**context_kwargs: Any) -> torch.Tensor:
    x = randn(3, 3, dtype=torch.float64)
    h, s = sac2.checkpoint(_returns_saved_mm, x, context_fn=contexts([aten.mm.default], **context_kwargs))
    h.add_(1)
    (h.sum() + s.sum()).backward()
    return x.grad


def test_mutated_after_forward_raises() -> None:
    with pytest.raises(RuntimeError) as cm:
        _backward_after_caller_mutates_output()
    _assert_no_mode_left()
    assert_expected_inline(str(cm.value), """one of the variables needed for gradient computation has been modified by an inplace operation: sac2: the output of aten.mm.default (call 0 of that op, op 0 of the region) that selective checkpointing saved was modified in place after the checkpointed forward ended, so serving it would give wrong gradients. Don't modify the region's outputs in place, have the policy recompute this op, or pass allow_cache_entry_mutation=True to recompute it in backward.""")  # noqa: E501


def test_mutated_after_forward_recomputed_when_allowed() -> None:
    x = randn(3, 3, dtype=torch.float64)
    h, s = _returns_saved_mm(x)
    h.add_(1)
    (h.sum() + s.sum()).backward()
    assert torch.equal(_backward_after_caller_mutates_output(allow_cache_entry_mutation=True), x.grad)


def test_mutated_later_in_forward_warns_once_and_recomputes() -> None:
    def fn(a: torch.Tensor) -> torch.Tensor:
        y = a * 2
        y.add_(1)
        return y.sin()

    x_ref = randn(3, 3, dtype=torch.float64)
    fn(x_ref).sum().backward()
    x = randn(3, 3, dtype=torch.float64)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            sac2.checkpoint(fn, x, context_fn=contexts(_returning(True))).sum().backward()
    assert [w.category for w in caught] == [UserWarning]
    assert_expected_inline(str(caught[0].message), """sac2: the policy saves aten.mul.Tensor (call 0 of that op, op 0 of the region), but a tensor it returned was modified in place later in the forward, so the saved value is stale; sac2 recomputes this op in backward instead. Have the policy recompute it to silence this warning.""")  # noqa: E501
    assert torch.equal(x.grad, 2 * x_ref.grad)


def test_no_mode_left_after_exception_in_forward() -> None:
    def fn(a: torch.Tensor) -> torch.Tensor:
        a.sin()
        raise KeyError("user error")

    with pytest.raises(KeyError):
        sac2.checkpoint(fn, randn(3, 3, dtype=torch.float64), context_fn=contexts([aten.sin.default]))
    _assert_no_mode_left()
