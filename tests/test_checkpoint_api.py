"""The drop-in API: sac2's checkpoint and contexts accept what torch's accept and mean the same."""

from __future__ import annotations

import inspect
import warnings
from functools import partial
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint as tuc
from expecttest import assert_expected_inline

import sac2

from helpers import assert_same_as_without_checkpointing, contexts, randn

aten = torch.ops.aten
_executions = {"counted_neg": 0}


@torch.library.custom_op("sac2_test_api::counted_neg", mutates_args=())
def counted_neg(x: torch.Tensor) -> torch.Tensor:
    """-x that counts how often it really runs; its backward needs no saved tensor."""
    _executions["counted_neg"] += 1
    return -x


counted_neg.register_autograd(lambda _ctx, grad: -grad)
COUNTED = torch.ops.sac2_test_api.counted_neg.default


def _neg_then_exp(a: torch.Tensor) -> torch.Tensor:
    return counted_neg(torch.mm(a, a)).exp()  # exp keeps its output: counted_neg must run again or be served


def _exp_then_neg(a: torch.Tensor) -> torch.Tensor:
    return counted_neg(torch.mm(a, a).exp())  # nothing after exp is needed in backward


def _runs(fn: Callable, **checkpoint_kwargs: Any) -> int:
    """How often counted_neg runs in a checkpointed forward + backward of ``fn``."""
    _executions["counted_neg"] = 0
    sac2.checkpoint(fn, randn(3, 3, dtype=torch.float64), **checkpoint_kwargs).sum().backward()
    return _executions["counted_neg"]


def _grad(call: Callable, fn: Callable, x: torch.Tensor) -> torch.Tensor:
    call(fn, x).sum().backward()
    return x.grad


def _plain(fn: Callable, x: torch.Tensor) -> torch.Tensor:
    return fn(x)


def test_checkpoint_policy_is_torchs() -> None:
    assert sac2.CheckpointPolicy is tuc.CheckpointPolicy
    assert sac2.SelectiveCheckpointContext is tuc.SelectiveCheckpointContext


SAVING = [
    tuc.CheckpointPolicy.MUST_SAVE,
    tuc.CheckpointPolicy.PREFER_SAVE,
    tuc.CheckpointPolicy.MUST_CPU_OFFLOAD,
    tuc.CheckpointPolicy.PREFER_CPU_OFFLOAD,
    True,
]
RECOMPUTING = [tuc.CheckpointPolicy.MUST_RECOMPUTE, tuc.CheckpointPolicy.PREFER_RECOMPUTE, False]


def _answer_for_counted(value: Any) -> Callable:
    def policy(_ctx, op, *args, **kwargs):
        return value if op is COUNTED else tuc.CheckpointPolicy.PREFER_RECOMPUTE

    return policy


@pytest.mark.parametrize("value", SAVING, ids=str)
def test_saving_policy_value_serves_op_in_recompute(value: Any) -> None:
    assert _runs(_neg_then_exp, context_fn=contexts(_answer_for_counted(value))) == 1


@pytest.mark.parametrize("value", RECOMPUTING, ids=str)
def test_recomputing_policy_value_reruns_op(value: Any) -> None:
    assert _runs(_neg_then_exp, context_fn=contexts(_answer_for_counted(value))) == 2


def test_list_policy_given_as_tuple_saves_its_ops() -> None:
    assert _runs(_neg_then_exp, context_fn=contexts((COUNTED,))) == 1


def test_ctx_op_output_is_the_ops_output() -> None:
    seen: list[tuple[Any, Any]] = []

    def policy(ctx, op, *args, **kwargs):
        seen.append((op, ctx.op_output))
        return False

    x = randn(3, 3, dtype=torch.float64)
    sac2.checkpoint(lambda a: torch.mm(a, a).sin(), x, context_fn=contexts(policy))
    with torch.no_grad():
        mm = torch.mm(x, x)
    assert [op for op, _ in seen] == [aten.mm.default, aten.sin.default]
    assert torch.equal(seen[0][1], mm)
    assert torch.equal(seen[1][1], mm.sin())


def test_policy_is_called_in_forward_only() -> None:
    calls: list[bool] = []

    def policy(ctx, _op, *args, **kwargs):
        calls.append(ctx.is_recompute)
        return False

    y = sac2.checkpoint(_neg_then_exp, randn(3, 3, dtype=torch.float64), context_fn=contexts(policy))
    assert calls == [False] * 3  # mm, counted_neg, exp
    y.sum().backward()
    assert calls == [False] * 3


def test_use_reentrant_none_means_false_without_warning() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _runs(_neg_then_exp, use_reentrant=None, context_fn=contexts([COUNTED])) == 1


def test_with_context_fn_raises() -> None:
    with pytest.raises(ValueError) as cm:
        sac2.checkpoint(
            _neg_then_exp, randn(3, 3, dtype=torch.float64), use_reentrant=True, context_fn=contexts([COUNTED])
        )
    assert_expected_inline(str(cm.value), """sac2.checkpoint: use_reentrant=True recomputes the whole function and cannot apply a selective policy; drop use_reentrant (sac2 defaults to False) to use context_fn.""")  # noqa: E501


def test_without_context_fn_gives_equal_gradients() -> None:
    assert_same_as_without_checkpointing(
        partial(sac2.checkpoint, use_reentrant=True), _neg_then_exp, randn(3, 3, dtype=torch.float64)
    )


def _dropout(a: torch.Tensor) -> torch.Tensor:
    return F.dropout(torch.mm(a, a), p=0.5, training=True).sin()


def _seeded_grad(call: Callable) -> torch.Tensor:
    torch.manual_seed(0)
    return _grad(call, _dropout, randn(3, 3, dtype=torch.float64))


def test_preserve_rng_state_true_replays_dropout_mask() -> None:
    call = partial(sac2.checkpoint, preserve_rng_state=True, context_fn=contexts([]))
    assert_same_as_without_checkpointing(call, _dropout, randn(3, 3, dtype=torch.float64))


def test_preserve_rng_state_false_draws_a_new_dropout_mask() -> None:
    call = partial(sac2.checkpoint, preserve_rng_state=False, context_fn=contexts([]))
    assert not torch.equal(_seeded_grad(call), _seeded_grad(_plain))


def test_determinism_check_none_gives_equal_gradients() -> None:
    call = partial(sac2.checkpoint, determinism_check="none", context_fn=contexts([aten.mm.default]))
    assert_same_as_without_checkpointing(call, _neg_then_exp, randn(3, 3, dtype=torch.float64))


def test_early_stop_skips_ops_after_the_last_needed_one() -> None:
    assert _runs(_exp_then_neg, context_fn=contexts([])) == 1


def test_early_stop_false_recomputes_the_whole_function() -> None:
    assert _runs(_exp_then_neg, early_stop=False, context_fn=contexts([])) == 2


def test_debug_without_context_fn_gives_equal_gradients() -> None:
    assert_same_as_without_checkpointing(
        partial(sac2.checkpoint, debug=True), _neg_then_exp, randn(3, 3, dtype=torch.float64)
    )


def test_debug_with_context_fn_gives_equal_gradients_on_sac2s_frame() -> None:
    # torch's frame refuses debug=True with a context_fn; sac2's traces the policy's decisions too
    call = partial(sac2.checkpoint, debug=True, context_fn=contexts([COUNTED]))
    assert_same_as_without_checkpointing(call, _neg_then_exp, randn(3, 3, dtype=torch.float64))


@pytest.mark.parametrize("policy", [[], [aten.mm.default]], ids=["save_nothing", "save_mm"])
def test_autocast_state_is_kept_in_recompute(policy: list) -> None:
    def fn(a: torch.Tensor) -> torch.Tensor:
        return torch.mm(torch.mm(a, a).sin(), a).float().exp()

    def autocast(call: Callable) -> Callable:
        def run(f: Callable, x: torch.Tensor) -> torch.Tensor:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return call(f, x)

        return run

    x = randn(3, 3, dtype=torch.float64).float().detach().requires_grad_()
    assert_same_as_without_checkpointing(
        autocast(partial(sac2.checkpoint, context_fn=contexts(policy))), fn, x, reference=autocast(_plain)
    )


def test_modes_do_not_subclass_torchs_private_sac_modes() -> None:
    caching, replay = sac2.create_selective_checkpoint_contexts([])
    for mode in (caching, replay):
        assert not isinstance(mode, (tuc._CachingTorchDispatchMode, tuc._CachedTorchDispatchMode))


def _two_outputs(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    h = torch.mm(x, x)
    return h.sin(), h.cos()


def test_backward_releases_the_saved_outputs_it_served() -> None:
    caching, replay = sac2.create_selective_checkpoint_contexts([aten.mm.default])
    a, b = sac2.checkpoint(_two_outputs, randn(3, 3, dtype=torch.float64), context_fn=lambda: (caching, replay))
    assert aten.mm.default not in caching.record.log  # saved: a Saved entry, not the bare op
    (a.sum() + b.sum()).backward()
    assert aten.mm.default in caching.record.log  # served once, forgotten: its memory went with the backward


def _disjoint(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    a = torch.mm(counted_neg(x), x).sin()
    return a, torch.mm(x.t(), x).cos()


def test_a_second_backward_recomputes_what_the_first_released() -> None:
    x = randn(3, 3, dtype=torch.float64)
    before = _executions["counted_neg"]
    a, b = sac2.checkpoint(_disjoint, x, context_fn=contexts([aten.mm.default, COUNTED]))
    (got_a,) = torch.autograd.grad(a.sum(), x)  # serves counted_neg, then forgets it
    (got_b,) = torch.autograd.grad(b.sum(), x)  # a new recompute: runs counted_neg again instead
    assert _executions["counted_neg"] - before == 2  # forward, then the second backward's recompute
    ref_a, ref_b = _disjoint(x)
    assert torch.equal(got_a, torch.autograd.grad(ref_a.sum(), x)[0])
    assert torch.equal(got_b, torch.autograd.grad(ref_b.sum(), x)[0])


def test_the_context_holds_no_output_once_the_forward_ends() -> None:
    seen = []

    def policy(ctx, _op, *args, **kwargs):
        seen.append(ctx)
        return False

    sac2.checkpoint(lambda t: t.sin().cos(), randn(3, 3, dtype=torch.float64), context_fn=contexts(policy))
    assert seen and seen[-1].op_output is None  # a policy keeping ctx as a per-forward key keeps no tensor alive


def test_decorator_form_checkpoints_with_its_options() -> None:
    checkpointed = sac2.checkpoint(use_reentrant=False, context_fn=contexts([COUNTED]))(_neg_then_exp)
    _executions["counted_neg"] = 0
    x = randn(3, 3, dtype=torch.float64)
    checkpointed(x).sum().backward()
    assert _executions["counted_neg"] == 1  # saved: the options reached the checkpoint
    assert torch.equal(x.grad, _grad(_plain, _neg_then_exp, randn(3, 3, dtype=torch.float64)))


class _Layer:
    def __init__(self, scale: float) -> None:
        self.scale = scale

    @sac2.checkpoint(use_reentrant=False, context_fn=contexts([COUNTED]))
    def forward(self, a: torch.Tensor) -> torch.Tensor:
        return _neg_then_exp(a) * self.scale


def test_decorator_form_on_a_method_binds_the_instance() -> None:
    _executions["counted_neg"] = 0
    x = randn(3, 3, dtype=torch.float64)
    _Layer(3.0).forward(x).sum().backward()
    assert _executions["counted_neg"] == 1
    assert torch.equal(x.grad, _grad(_plain, lambda a: _neg_then_exp(a) * 3.0, randn(3, 3, dtype=torch.float64)))


def test_decorator_form_keeps_the_functions_name() -> None:
    assert sac2.checkpoint()(_neg_then_exp).__name__ == "_neg_then_exp"


def test_decorator_form_passes_keyword_arguments_named_like_options_to_the_function() -> None:
    seen = {}

    def fn(a: torch.Tensor, debug: str = "") -> torch.Tensor:
        seen["debug"] = debug
        return a.sin()

    sac2.checkpoint(use_reentrant=False)(fn)(randn(3, 3, dtype=torch.float64), debug="the function's")
    assert seen == {"debug": "the function's"}


def test_keyword_arguments_without_a_function_raise() -> None:
    with pytest.raises(ValueError) as cm:
        sac2.checkpoint(use_reentrant=False, scale=2)  # type: ignore[call-overload]  # misuse, on purpose
    assert_expected_inline(str(cm.value), """Unexpected keyword arguments: scale""")


def _forwarded(monkeypatch: pytest.MonkeyPatch, **options: Any) -> dict:
    """The options sac2.checkpoint hands torch's checkpoint under torch.compile (dynamo turns that call into its
    checkpoint HOP; in eager sac2 runs its own frame)."""
    calls: list[dict] = []

    def spy(function: Callable, *args: Any, **kwargs: Any) -> Any:
        calls.append(kwargs)
        return function(*args)

    monkeypatch.setattr(tuc, "checkpoint", spy)
    monkeypatch.setattr("sac2.frame.entry.is_compiling", lambda: True)
    sac2.checkpoint(torch.sin, randn(3, 3, dtype=torch.float64), **options)
    (kwargs,) = calls
    return kwargs


DEFAULTS = dict(use_reentrant=False, preserve_rng_state=True, determinism_check="default", debug=False, early_stop=True)
TORCH_TAKES_HOOKS_FLAG = "respect_saved_tensors_hooks" in inspect.signature(tuc.checkpoint).parameters


def test_no_context_fn_is_forwarded_when_none_is_given(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _forwarded(monkeypatch) == DEFAULTS  # dynamo rejects torch's default context_fn passed explicitly


def test_every_option_given_is_forwarded(monkeypatch: pytest.MonkeyPatch) -> None:
    context_fn = contexts([])
    options = dict(preserve_rng_state=False, determinism_check="none", early_stop=False, context_fn=context_fn)
    assert _forwarded(monkeypatch, **options) == {**DEFAULTS, **options}


def test_respect_saved_tensors_hooks_is_forwarded_only_to_a_torch_that_takes_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    forwarded = _forwarded(monkeypatch, respect_saved_tensors_hooks=True)
    assert ("respect_saved_tensors_hooks" in forwarded) == TORCH_TAKES_HOOKS_FLAG  # 2.13 would pass it to fn


def test_respect_saved_tensors_hooks_with_use_reentrant_raises() -> None:
    with pytest.raises(ValueError) as cm:
        sac2.checkpoint(
            _neg_then_exp, randn(3, 3, dtype=torch.float64), use_reentrant=True, respect_saved_tensors_hooks=True
        )
    assert_expected_inline(str(cm.value), """Passing `context_fn`, `debug`, or `respect_saved_tensors_hooks` is only supported when use_reentrant=False.""")  # noqa: E501


def test_use_reentrant_forwards_preserve_rng_state_false() -> None:
    call = partial(sac2.checkpoint, use_reentrant=True, preserve_rng_state=False)
    assert not torch.equal(_seeded_grad(call), _seeded_grad(_plain))
