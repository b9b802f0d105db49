"""sac2's eager checkpoint frame (``sac2.frame.frame``) against torch's non-reentrant frame, behaviour by behaviour.

Each test runs one scenario twice: through ``sac2.checkpoint`` on sac2's frame, and the same under
``sac2.use_torch_frame()`` (torch's ``_checkpoint_without_reentrant_generator``), and asserts that what can be
observed is the same: outputs and gradients (bitwise), the CPU generator's state afterwards, what ran again, errors
(type and message) and warnings. The frame must have torch's semantics exactly, so equality is the specification.

What ran again is seen twice over: ``ckpt`` wraps each checkpointed function so that every call logs whether it
is a forward or a recompute, and under which frame; the harness compares the logs and fails a run of sac2's frame
in which torch's frame ran (so no test passes by sac2 quietly delegating to torch). Ops are counted by a counting
custom op where a count inside one call matters (early stop).

sac2's two deliberate deviations are tested as such, in the last section.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import subprocess
import sys
import threading
import warnings
import weakref
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Iterator

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint as tuc
from expecttest import assert_expected_inline
from torch.utils._pytree import tree_flatten

import sac2
from sac2.bench.models import CONFIGS, Transformer, random_tokens
from sac2.measure.memory import Memory, measure_step

from helpers import Block, OpRuns, counted_op

aten = torch.ops.aten
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
DEBUG_TIP: str = getattr(tuc, "_debug_tip_msg", "")

# ---- the harness ----

#: What each call of a ``ckpt``-wrapped function saw: "<frame> forward", "<frame> recompute" or "no frame".
CALLS: list[str] = []


def _frame_now() -> str:
    """Which frame's saved-tensor hooks are innermost right now, and whether they are a forward's or a recompute's."""
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    if hooks is None:
        return "no frame"
    name = getattr(hooks[0], "__qualname__", "")
    for prefix, kind in (
        ("Frame.hooks.", "sac2 forward"),
        ("Frame._recompute_hook.", "sac2 recompute"),
        ("_checkpoint_hook.", "torch forward"),
        ("_recomputation_hook.", "torch recompute"),
    ):
        if name.startswith(prefix):
            return kind
    return "user hooks"


def logged(fn: Callable[..., Any], log: list[str] | None = None) -> Callable[..., Any]:
    """``fn``, logging the frame of each of its calls into ``log`` (``CALLS`` by default)."""

    def call(*args: Any, **kwargs: Any) -> Any:
        (CALLS if log is None else log).append(_frame_now())
        return fn(*args, **kwargs)

    return call


def ckpt(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``sac2.checkpoint(fn, *args, **kwargs)``, with ``fn``'s calls logged."""
    return sac2.checkpoint(logged(fn), *args, **kwargs)


@dataclass
class Seen:
    """What one run of a scenario showed."""

    value: Any
    error: tuple[type, str] | None
    warnings: list[tuple[type, str]]
    rng: torch.Tensor
    calls: list[str] = field(default_factory=list)


def observe(frame: str, scenario: Callable[[], Any]) -> Seen:
    """Run ``scenario`` from the same seed on ``frame`` ("sac2" or "torch"), catching its error and warnings."""
    CALLS.clear()
    torch.manual_seed(0)
    switch = sac2.use_torch_frame() if frame == "torch" else contextlib.nullcontext()
    with warnings.catch_warnings(record=True) as caught, switch:
        warnings.simplefilter("always")
        try:
            value, error = scenario(), None
        except Exception as e:  # noqa: BLE001 - the error is what is compared
            value, error = None, (type(e), str(e))
    other = "torch" if frame == "sac2" else "sac2"
    assert not [c for c in CALLS if c.startswith(other)], f"{other}'s frame ran in a run of {frame}'s: {CALLS}"
    calls = [c.removeprefix(f"{frame} ") for c in CALLS]
    return Seen(value, error, [(w.category, str(w.message)) for w in caught], torch.get_rng_state(), calls)


def assert_equal(a: Any, b: Any) -> None:
    """Bitwise equality of two pytrees of tensors and plain values (tensors: type, dtype, shape, requires_grad)."""
    leaves_a, spec_a = tree_flatten(a)
    leaves_b, spec_b = tree_flatten(b)
    assert spec_a == spec_b, (spec_a, spec_b)
    for x, y in zip(leaves_a, leaves_b, strict=True):
        if isinstance(x, torch.Tensor):
            assert isinstance(y, torch.Tensor), (x, y)
            assert (x.dtype, x.shape, x.device, x.requires_grad) == (y.dtype, y.shape, y.device, y.requires_grad)
            assert torch.equal(x.detach(), y.detach()), (x, y)
        else:
            assert x == y, (x, y)


def same(scenario: Callable[[], Any], raises: type[Exception] | None = None) -> Seen:
    """Run ``scenario`` on both frames; assert they show the same, and that it raised ``raises`` (None: nothing);
    return what sac2's frame showed."""
    mine, torchs = observe("sac2", scenario), observe("torch", scenario)
    assert mine.error == torchs.error
    assert (mine.error[0] if mine.error else None) is raises, mine.error
    assert_equal(mine.value, torchs.value)
    assert mine.warnings == torchs.warnings
    assert torch.equal(mine.rng, torchs.rng), "the CPU generator ends in a different state"
    assert mine.calls == torchs.calls
    return mine


def x_(*shape: int, seed: int = 0, grad: bool = True, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    t = torch.randn(*(shape or (4, 4)), generator=torch.Generator().manual_seed(seed), dtype=dtype)
    return t.requires_grad_(grad)


def grad_of(out: Any, *inputs: torch.Tensor, **kwargs: Any) -> tuple[torch.Tensor, ...]:
    outs = out if isinstance(out, (tuple, list)) else (out,)
    sums = [o.sum() for o in outs if isinstance(o, torch.Tensor) and o.requires_grad]
    return torch.autograd.grad(sum(sums[1:], sums[0]), inputs, **kwargs)  # a tensor's sum: no int 0 to start from


def sin_exp(x: torch.Tensor) -> torch.Tensor:
    return x.sin().exp()  # saves x (sin) and its output (exp)


def sac2_contexts(policy: Any) -> Callable[[], Any]:
    return partial(sac2.create_selective_checkpoint_contexts, policy)


SAVE_MM = [aten.mm.default]
#: Full AC, and sac2's SAC saving the matmuls.
POLICIES = pytest.mark.parametrize("policy", [None, SAVE_MM], ids=["full", "sac2_sac"])


def _policy(policy: Any) -> dict[str, Any]:
    return {} if policy is None else {"context_fn": sac2_contexts(policy)}


# ---- gradients ----


@POLICIES
def test_a_llama_block_gets_bitwise_equal_outputs_and_gradients(policy):
    def scenario():
        torch.manual_seed(0)
        block = Block(32)
        x = x_(2, 8, 32)
        out = ckpt(block, x, **_policy(policy))
        out.square().sum().backward()
        return out, x.grad, [p.grad for p in block.parameters()]

    seen = same(scenario)
    assert seen.calls == ["forward", "recompute"]
    torch.manual_seed(0)
    block = Block(32)
    x = x_(2, 8, 32)
    block(x).square().sum().backward()
    assert_equal(seen.value[1:], (x.grad, [p.grad for p in block.parameters()]))


# ---- RNG ----


def _dropout_sin(x: torch.Tensor) -> torch.Tensor:
    return F.dropout(x, 0.5, training=True).sin()  # sin saves the dropped-out tensor: recompute must redraw it


def _reference_grad(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    torch.manual_seed(0)
    return grad_of(fn(x), x)[0]


@pytest.mark.parametrize("preserve", [True, False])
def test_preserve_rng_state_replays_the_cpu_generator_or_not(preserve):
    def scenario():
        x = x_(64)
        out = ckpt(_dropout_sin, x, preserve_rng_state=preserve)
        torch.rand(3)  # the generator moves on: a recompute that replays the forward's state must restore this one
        before_backward = torch.get_rng_state()
        (g,) = grad_of(out, x)
        return out, g, torch.equal(torch.get_rng_state(), before_backward)

    seen = same(scenario)
    _, g, generator_untouched_by_backward = seen.value
    assert torch.equal(g, _reference_grad(_dropout_sin, x_(64))) == preserve
    assert generator_untouched_by_backward == preserve


@CUDA
@pytest.mark.parametrize("preserve", [True, False])
def test_preserve_rng_state_replays_the_cuda_generator_or_not(preserve):
    def scenario():
        x = x_(4096).cuda().detach().requires_grad_()
        out = ckpt(_dropout_sin, x, preserve_rng_state=preserve)
        torch.rand(3, device="cuda")
        before_backward = torch.cuda.get_rng_state()
        (g,) = grad_of(out, x)
        return out.cpu(), g.cpu(), torch.equal(torch.cuda.get_rng_state(), before_backward), torch.cuda.get_rng_state()

    seen = same(scenario)
    assert seen.value[2] == preserve


def test_an_explicit_generator_is_not_replayed():
    def scenario():
        g = torch.Generator().manual_seed(1)

        def fn(x):
            return (x * torch.rand(x.shape, generator=g)).sin()  # sin saves x * noise

        x = x_(16)
        out = ckpt(fn, x)
        return out, grad_of(out, x), g.get_state()

    seen = same(scenario)
    g = torch.Generator().manual_seed(1)
    x = x_(16)
    assert not torch.equal(seen.value[1][0], grad_of((x * torch.rand(16, generator=g)).sin(), x)[0])


# ---- autocast, device context ----


def _autocast_mm(log: list) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    def fn(x, w):
        state = torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"), torch.is_autocast_cache_enabled()
        log.append(state)
        return (x @ w).sin()  # mm runs in bfloat16 under autocast; sin saves its output

    return fn


@pytest.mark.parametrize("cache", [True, False])
def test_the_forwards_autocast_state_is_replayed_in_recompute(cache):
    def scenario():
        log: list = []
        x, w = x_(8, 8), x_(8, 8, seed=1)
        with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=cache):
            out = ckpt(_autocast_mm(log), x, w)
        return out, grad_of(out, x, w), log

    seen = same(scenario)
    assert seen.value[2] == [(True, torch.bfloat16, cache)] * 2


def test_autocast_around_backward_is_not_seen_by_recompute():
    def scenario():
        log: list = []
        x, w = x_(8, 8), x_(8, 8, seed=1)
        out = ckpt(_autocast_mm(log), x, w)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            grads = grad_of(out, x, w)
        return out, grads, [enabled for enabled, _, _ in log]

    assert same(scenario).value[2] == [False, False]


def test_the_forwards_device_context_is_replayed_in_recompute():
    devices: list[str] = []

    def fn(x):
        devices.append(torch.empty(0).device.type)  # the factory follows `with torch.device(...)`
        return x.sin()

    def scenario():
        devices.clear()
        x = x_()
        with torch.device("meta"):
            out = ckpt(fn, x)
        return out, grad_of(out, x), list(devices)

    assert same(scenario).value[2] == ["meta", "meta"]


# ---- early stop ----


@pytest.mark.parametrize(
    "early_stop, override, runs",
    [(True, None, 1), (False, None, 2), (True, False, 2), (False, True, 1)],
    ids=["on", "off", "on_but_globally_off", "off_but_globally_on"],
)
def test_early_stop_skips_what_follows_the_last_saved_tensor(early_stop, override, runs):
    op, count = counted_op("test_frame.early_stop")

    def fn(x):
        return op(sin_exp(x)) * 2  # counted and the scalar mul save nothing: the last saved tensor is exp's output

    def scenario():
        before = count()
        x = x_()
        with contextlib.nullcontext() if override is None else tuc.set_checkpoint_early_stop(override):
            out = ckpt(fn, x, early_stop=early_stop)
        return out, grad_of(out, x), count() - before

    assert same(scenario).value[2] == runs


@pytest.mark.parametrize("early_stop", [True, False])
def test_the_global_early_stop_setting_is_read_in_forward_not_in_backward(early_stop):
    op, count = counted_op("test_frame.early_stop_in_backward")

    def scenario():
        before = count()
        x = x_()
        out = ckpt(lambda a: op(sin_exp(a)) * 2, x, early_stop=early_stop)
        with tuc.set_checkpoint_early_stop(not early_stop):
            grads = grad_of(out, x)
        return out, grads, count() - before

    assert same(scenario).value[2] == (1 if early_stop else 2)


# ---- determinism check ----


def _shape_changes_in_recompute(log: list) -> Callable[[torch.Tensor], torch.Tensor]:
    def fn(x):
        log.append(None)
        s = torch.ones(4, 4) if len(log) == 1 else torch.full((1, 4), 2.0)  # mul saves s, for x's gradient
        return x * s

    return fn


def test_default_raises_on_a_recomputed_tensor_of_another_shape() -> None:
    def scenario():
        x = x_()
        return grad_of(ckpt(_shape_changes_in_recompute([]), x), x)

    seen = same(scenario, raises=tuc.CheckpointError)
    assert_expected_inline(seen.error[1].replace(DEBUG_TIP, "<tip>"), """\
torch.utils.checkpoint: Recomputed values for the following tensors have different metadata than during the forward pass.
tensor at position 0:
saved metadata: {'shape': torch.Size([4, 4]), 'dtype': torch.float32, 'device': device(type='cpu')}
recomputed metadata: {'shape': torch.Size([1, 4]), 'dtype': torch.float32, 'device': device(type='cpu')}
.
<tip>""")  # noqa: E501


def test_none_uses_the_recomputed_tensor() -> None:
    def scenario():
        x = x_()
        return grad_of(ckpt(_shape_changes_in_recompute([]), x, determinism_check="none"), x)

    (g,) = same(scenario).value
    assert torch.equal(g, torch.full((4, 4), 2.0))


def test_fewer_tensors_saved_in_recompute_raise() -> None:
    def scenario():
        log: list = []

        def fn(x):
            log.append(None)
            return x.sin() if len(log) == 1 else x * 2  # the scalar mul saves nothing

        x = x_()
        return grad_of(ckpt(fn, x), x)

    seen = same(scenario, raises=tuc.CheckpointError)
    assert_expected_inline(seen.error[1].replace(DEBUG_TIP, "<tip>"), """\
torch.utils.checkpoint: A different number of tensors was saved during the original forward and recomputation.
Number of tensors saved during forward: 1
Number of tensors saved during recomputation: 0.
<tip>""")


def test_more_tensors_saved_in_recompute_raise_without_early_stop() -> None:
    def scenario():
        log: list = []

        def fn(x):
            log.append(None)
            return x.sin() if len(log) == 1 else x.sin().exp()

        x = x_()
        return grad_of(ckpt(fn, x, early_stop=False), x)

    seen = same(scenario, raises=tuc.CheckpointError)
    assert_expected_inline(seen.error[1].replace(DEBUG_TIP, "<tip>"), """\
torch.utils.checkpoint: trying to save more tensors during recomputation than during the original forward pass.
<tip>""")


def test_an_unknown_value_raises_value_error_even_without_grad() -> None:
    def scenario():
        with torch.no_grad():
            ckpt(sin_exp, x_(), determinism_check="bogus")

    seen = same(scenario, raises=ValueError)
    assert_expected_inline(seen.error[1], """determinism_check should be one of ['default', 'none'], but got bogus""")


# ---- debug ----


@pytest.fixture
def clean_torch_debug_logger() -> Iterator[None]:
    """torch's debug mode leaves its logger changed (level, propagate, one more filter per run), and under pytest's
    log capture a later debug run, in this test or another one, then fails formatting a record. Start from the
    logger as it is before any debug run, and leave it so."""
    logger = logging.getLogger("LoggingTensor")

    def reset() -> None:
        logger.setLevel(logging.NOTSET)
        logger.propagate = True
        logger.filters.clear()
        logger.handlers.clear()

    reset()
    yield
    reset()


@pytest.mark.usefixtures("clean_torch_debug_logger")
def test_debug_runs_sac2s_frame_with_the_same_result():
    def scenario(how: str, log: list[str]) -> tuple:
        x = x_()
        if how == "off":
            out = sac2.checkpoint(logged(sin_exp, log), x)
        elif how == "argument":
            out = sac2.checkpoint(logged(sin_exp, log), x, debug=True)
        else:
            with tuc.set_checkpoint_debug_enabled(True):
                out = sac2.checkpoint(logged(sin_exp, log), x)
        return out, grad_of(out, x)

    plain_log: list[str] = []
    plain = observe("sac2", lambda: scenario("off", plain_log))
    assert plain.error is None and plain_log == ["sac2 forward", "sac2 recompute"]
    for how in ("argument", "global"):
        log: list[str] = []
        debugged = observe("sac2", partial(scenario, how, log))
        assert debugged.error is None
        assert log == ["sac2 forward", "sac2 recompute"]
        assert_equal(debugged.value, plain.value)


def test_debug_with_a_context_fn_is_torchs_error_on_torchs_frame_only():
    # torch's frame cannot trace under a policy; sac2's frame traces and names what the policy saved
    seen = observe("torch", lambda: ckpt(sin_exp, x_(), debug=True, context_fn=sac2_contexts(SAVE_MM)))
    assert seen.error == (ValueError, "debug=True is incompatible with non-default context_fn")
    assert observe("sac2", lambda: ckpt(sin_exp, x_(), debug=True, context_fn=sac2_contexts(SAVE_MM))).error is None


def test_debug_shows_the_ops_forward_and_recompute_ran_where_recompute_diverged():
    calls = []

    def changes(x: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return (x.sin() if len(calls) == 1 else x.cos()).exp()

    out = sac2.checkpoint(changes, x_(), debug=True, context_fn=sac2_contexts([aten.exp.default]))
    with pytest.raises(RuntimeError) as caught:
        out.sum().backward()
    trace = str(caught.value).rsplit("\n\n", 1)[1]  # the last paragraph
    assert trace == (
        "sac2 debug trace (debug=True): the ops the checkpointed function dispatched, first difference marked <<\n"
        "       forward           recompute\n"
        "    0  aten.sin.default  aten.cos.default  <<\n"
        "    1  aten.exp.default  -\n"
        "sac2 saved: aten.exp.default (call 0 of that op, op 1 of the region)"
    )


# ---- nesting ----


def _torch_ckpt(fn: Callable[..., Any], *args: Any) -> Any:
    """torch's own checkpoint (its own frame whatever the switch), its function's calls logged as "inner ..."."""
    def call(*a: Any) -> Any:
        CALLS.append("inner " + _frame_now().split()[-1])
        return fn(*a)

    return tuc.checkpoint(call, *args, use_reentrant=False)


NESTINGS = {
    "sac2_in_sac2": lambda inner, outer, x: ckpt(lambda y: outer(ckpt(inner, y)), x),
    "torch_in_sac2": lambda inner, outer, x: ckpt(lambda y: outer(_torch_ckpt(inner, y)), x),
    "sac2_in_torch": lambda inner, outer, x: _torch_ckpt(lambda y: outer(ckpt(inner, y)), x),
    # The inner checkpoint last: the outer's last saved tensor is the inner checkpoint's input, which the inner
    # frame saves as autograd saves tensors, so the outer recompute stops inside the inner checkpoint's set-up.
    "sac2_last_in_sac2": lambda inner, outer, x: ckpt(lambda y: ckpt(inner, outer(y)), x),
    "torch_last_in_sac2": lambda inner, outer, x: ckpt(lambda y: _torch_ckpt(inner, outer(y)), x),
    "sac2_last_in_torch": lambda inner, outer, x: _torch_ckpt(lambda y: ckpt(inner, outer(y)), x),
}


@pytest.mark.parametrize("nesting", NESTINGS)
@pytest.mark.parametrize("early_stop", [True, False])
def test_nested_checkpoints(nesting, early_stop):
    op, count = counted_op(f"test_frame.nested.{nesting}")

    def inner(y):
        return op(y.sin()).cos()  # the inner function saves y and op's output

    def outer(y):
        return y.exp() * 3

    def scenario():
        before = count()
        x = x_()
        with tuc.set_checkpoint_early_stop(early_stop):
            out = NESTINGS[nesting](inner, outer, x)
        return out, grad_of(out, x), count() - before

    seen = same(scenario)
    x = x_()
    composed = inner(outer(x)) if "last" in nesting else outer(inner(x))
    assert_equal(seen.value[1], grad_of(composed, x))


# ---- several backwards ----


def _mm_sin_exp(x: torch.Tensor) -> torch.Tensor:
    return sin_exp(x @ x)


@POLICIES
def test_backward_with_retain_graph_twice_recomputes_twice(policy):
    def scenario():
        x = x_()
        out = ckpt(_mm_sin_exp, x, **_policy(policy))
        out.sum().backward(retain_graph=True)
        first = x.grad.clone()
        out.sum().backward()
        return first, x.grad

    seen = same(scenario)
    assert seen.calls == ["forward", "recompute", "recompute"]


@POLICIES
def test_double_backward(policy):
    def scenario():
        x = x_()
        out = ckpt(_mm_sin_exp, x, **_policy(policy))
        (g,) = torch.autograd.grad(out.sum(), x, create_graph=True)
        g.square().sum().backward()
        return g, x.grad

    same(scenario)


def test_grad_of_one_of_two_outputs_then_of_the_other():
    def scenario():
        x = x_()
        a, b = ckpt(lambda t: (t.sin(), t.exp()), x)
        return grad_of(a, x, retain_graph=True), grad_of(b, x)

    assert same(scenario).calls == ["forward", "recompute", "recompute"]


def test_backward_with_inputs_fills_only_those():
    def scenario():
        x, w = x_(), x_(seed=1)
        out = ckpt(lambda a, b: (a * b).sin(), x, w)
        out.sum().backward(inputs=[w])
        return x.grad, w.grad

    value = same(scenario).value
    assert value[0] is None and value[1] is not None


def test_partial_backward_then_a_full_one():
    def scenario():
        x, w = x_(), x_(seed=1)
        out = ckpt(lambda a, b: (a * b).sin().exp(), x, w)
        out.sum().backward(inputs=[w], retain_graph=True)
        w_first = w.grad.clone()
        out.sum().backward()
        return w_first, x.grad, w.grad

    same(scenario)


# ---- what goes in and out ----


def test_inputs_that_do_not_require_grad():
    def scenario():
        w = x_(seed=1)
        x = x_(grad=False)
        out = ckpt(lambda a: (a @ w).sin(), x)
        return out, grad_of(out, w)

    same(scenario)


def test_outputs_that_do_not_require_grad():
    def scenario():
        x = x_()
        y, detached, index = ckpt(lambda a: (a.sin(), a.cos().detach(), a.argmax()), x)
        return y, detached, index, grad_of(y, x)

    same(scenario)


def test_a_function_whose_outputs_need_no_grad_saves_nothing():
    def scenario():
        x = x_()
        out = ckpt(lambda a: a.detach().sin(), x)
        return out, out.grad_fn is None

    same(scenario)


def test_non_tensor_args_kwargs_and_outputs():
    def fn(x, n, scale, options, pair, *, power=2, bias=None):
        y = (x * scale + pair[0]).pow(power) * options["k"]
        return {"y": y, "n": n, "none": None, "nested": (y.sin(), 3), "bias": bias}

    def scenario():
        x, p = x_(), x_(seed=1)
        out = ckpt(fn, x, 3, 0.5, {"k": 2.0}, (p, "label"), power=3, bias=None)
        return out, grad_of((out["y"], out["nested"][0]), x, p)

    same(scenario)


# ---- saved-tensor hooks ----


def _counting_hooks() -> tuple[Any, dict[str, int]]:
    counts = {"pack": 0, "unpack": 0}

    def pack(t):
        counts["pack"] += 1
        return t

    def unpack(t):
        counts["unpack"] += 1
        return t

    return torch.autograd.graph.saved_tensors_hooks(pack, unpack), counts


def test_save_on_cpu_around_a_checkpoint():
    def scenario():
        x = x_()
        with torch.autograd.graph.save_on_cpu():
            out = ckpt(sin_exp, x)
        return out, grad_of(out, x)

    same(scenario)


def test_the_users_hooks_see_the_checkpoints_inputs_as_torch_hands_them():
    def scenario():
        x, w = x_(), x_(seed=1)
        hooks, counts = _counting_hooks()
        with hooks:
            out = ckpt(lambda a: (a @ w).sin().exp(), x)  # w from the closure: only x is the checkpoint's input
        packed = dict(counts)
        return out, grad_of(out, x, w), packed, counts

    seen = same(scenario)
    assert seen.value[2] == {"pack": 1, "unpack": 0}
    assert seen.value[3] == {"pack": 1, "unpack": 1}


@pytest.mark.parametrize("respect, packs", [(True, 2), (False, 0), (None, 0)])
def test_a_sac_context_fn_under_the_users_hooks(respect, packs):
    # tests/test_saved_tensors_hooks.py: True packs what the save list saves (here both ops' outputs), False and
    # None bypass the hooks (None warns).
    def scenario():
        x = x_(dtype=torch.float64)
        hooks, counts = _counting_hooks()
        with hooks:
            out = ckpt(lambda: x.exp().tanh(), context_fn=sac2_contexts([aten.exp.default, aten.tanh.default]),
                       respect_saved_tensors_hooks=respect)
        return out, grad_of(out, x), counts

    seen = same(scenario)
    assert seen.value[2]["pack"] == packs
    assert [c for c, _ in seen.warnings] == ([FutureWarning] if respect is None else [])


@pytest.mark.parametrize("hooks", [False, True])
def test_torchs_own_sac_contexts(hooks):
    def scenario():
        x = x_()
        counting, counts = _counting_hooks()
        context_fn = partial(tuc.create_selective_checkpoint_contexts, SAVE_MM)
        with counting if hooks else contextlib.nullcontext():
            out = ckpt(_mm_sin_exp, x, context_fn=context_fn)
        return out, grad_of(out, x), counts

    same(scenario)


@pytest.mark.parametrize("saved_tensors_hooks", ["disable_saved_tensors_hooks", "allow_mutation_on_saved_tensors"])
def test_torchs_other_saved_tensors_contexts(saved_tensors_hooks):
    def scenario():
        x = x_()
        h = x * 1
        if saved_tensors_hooks == "disable_saved_tensors_hooks":
            with torch.autograd.graph.disable_saved_tensors_hooks("no saved-tensor hooks here"):
                out = ckpt(sin_exp, h)
        else:
            with torch.autograd.graph.allow_mutation_on_saved_tensors():
                out = ckpt(sin_exp, h)
                h.add_(1)  # the context keeps the original for backward
                return out, grad_of(out, x)
        return out, grad_of(out, x)

    disabled = saved_tensors_hooks == "disable_saved_tensors_hooks"
    seen = same(scenario, raises=RuntimeError if disabled else None)
    assert not disabled or seen.error[1] == "no saved-tensor hooks here"


def test_a_forward_context_that_swallows_the_forwards_error():
    class Swallow:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return True

    def scenario():
        before = _state()
        try:
            ckpt(lambda _a: 1 / 0, x_(), context_fn=lambda: (Swallow(), contextlib.nullcontext()))
        finally:
            assert _state() == before

    seen = same(scenario, raises=RuntimeError)
    assert seen.error == (RuntimeError, "torch.utils.checkpoint: the forward context provided by context_fn "
                          "suppressed an exception raised during the checkpointed forward. This is not supported "
                          "because checkpoint cannot return a value for a failed forward.")


def test_the_contexts_run_in_torchs_order_in_recompute():
    log: list[str] = []

    class Named:
        def __init__(self, name: str) -> None:
            self.name = name

        def __enter__(self):
            log.append(f"enter {self.name}: autocast={torch.is_autocast_enabled('cpu')} grad={torch.is_grad_enabled()}"
                       f" device={torch.empty(0).device.type}")

        def __exit__(self, *exc):
            log.append(f"exit {self.name}")

    def scenario():
        log.clear()
        x = x_()
        with torch.autocast("cpu", dtype=torch.bfloat16), torch.device("meta"):
            out = ckpt(sin_exp, x, context_fn=lambda: (Named("forward"), Named("recompute")))
        return out, grad_of(out, x), list(log)

    assert same(scenario).value[2] == [
        "enter forward: autocast=True grad=True device=meta", "exit forward",
        "enter recompute: autocast=True grad=True device=cpu", "exit recompute",  # the device context is inner
    ]


# ---- no grad ----


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
def test_a_forward_without_grad_runs_once_and_saves_nothing(mode):
    def scenario():
        x = x_()
        with mode():
            out = ckpt(sin_exp, x)
        return out, out.requires_grad, out.is_inference()

    assert same(scenario).calls == ["no frame"]


def test_a_forward_without_grad_still_calls_context_fn():
    def scenario():
        made: list[int] = []

        def context_fn():
            made.append(1)
            return contextlib.nullcontext(), contextlib.nullcontext()

        with torch.no_grad():
            out = ckpt(sin_exp, x_(), context_fn=context_fn)
        return out, len(made)

    assert same(scenario).value[1] == 1


# ---- errors leave nothing behind ----


def _state() -> tuple:
    return (
        torch._C._autograd._top_saved_tensors_default_hooks(False),
        torch.is_grad_enabled(),
        torch._C._len_torch_dispatch_stack(),
        torch._C._len_torch_function_stack(),
        torch.is_autocast_enabled("cpu"),
    )


def _then_a_checkpoint_works() -> tuple:
    x = x_()
    out = ckpt(_dropout_sin, x)
    return out, grad_of(out, x)


class Boom(Exception):
    pass


@POLICIES
def test_an_error_in_forward_leaves_no_state_behind(policy):
    def fn(x):
        F.dropout(x @ x, 0.5, training=True).sin()
        raise Boom("forward")

    def scenario():
        before = _state()
        with pytest.raises(Boom):
            ckpt(fn, x_(), **_policy(policy))
        assert _state() == before
        return _then_a_checkpoint_works()

    same(scenario)


@POLICIES
def test_an_error_in_recompute_leaves_no_state_behind(policy):
    def scenario():
        log: list = []

        def fn(x):
            log.append(None)
            y = F.dropout(x @ x, 0.5, training=True)  # moves the generator before the error
            if len(log) == 2:
                raise Boom("recompute")
            return y.sin()

        before = _state()
        x = x_()
        out = ckpt(fn, x, **_policy(policy))
        with pytest.raises(Boom):
            out.sum().backward()
        assert _state() == before
        return torch.get_rng_state(), _then_a_checkpoint_works()

    same(scenario)


def test_a_backward_after_a_failed_recompute_recomputes_again():
    def scenario():
        log: list = []

        def fn(x):
            log.append(None)
            if len(log) == 2:
                raise Boom("recompute")
            return sin_exp(x)

        x = x_()
        out = ckpt(fn, x)
        with pytest.raises(Boom):
            grad_of(out, x, retain_graph=True)
        return grad_of(out, x)

    assert same(scenario).calls == ["forward", "recompute", "recompute"]


def test_an_error_in_backward_leaves_no_state_behind():
    class FailingBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return x.clone()

        @staticmethod
        def backward(ctx, _grad):
            _ = ctx.saved_tensors  # unpacks, so the recompute ran before the error
            raise Boom("backward")

    def scenario():
        before = _state()
        x = x_()
        out = ckpt(lambda a: FailingBackward.apply(F.dropout(a, 0.5, training=True).sin()), x)
        with pytest.raises(Boom):
            out.sum().backward()
        assert _state() == before
        return torch.get_rng_state(), _then_a_checkpoint_works()

    same(scenario)


def test_an_input_modified_in_place_after_forward_raises_autograds_error():
    def scenario():
        x = x_()
        h = x * 1
        out = ckpt(sin_exp, h)
        h.add_(1)
        return grad_of(out, x)

    seen = same(scenario, raises=RuntimeError)
    assert "modified by an inplace operation" in seen.error[1]


def test_an_input_the_function_modifies_in_place_raises_autograds_error():
    def scenario():
        x = x_()
        out = ckpt(lambda a: a.mul_(2).sin(), x * 1)  # the frame saved the input before the function changed it
        return grad_of(out, x)

    seen = same(scenario, raises=RuntimeError)
    assert "modified by an inplace operation" in seen.error[1]


@pytest.mark.parametrize("backward", [False, True])
def test_nothing_outlives_the_output_without_the_garbage_collector(backward):
    def scenario():
        x = x_(64, 64)
        big = x * 1  # the checkpoint's input; only the graph holds it once dropped here
        alive = weakref.ref(big)
        out = ckpt(lambda a: (a @ a).sin().exp(), big)
        del big
        if backward:
            grad_of(out, x)
        held = alive() is not None
        del out
        return held, alive() is None

    gc.disable()
    try:
        assert same(scenario).value == (not backward, True)  # a backward frees what it used (no retain_graph)
    finally:
        gc.enable()


@pytest.mark.parametrize("early_stop", [True, False])
def test_a_backward_inside_the_checkpointed_forward(early_stop):
    def fn(x):
        y = x.sin()
        (g,) = torch.autograd.grad(y.sum(), x, create_graph=True)  # saves under the frame's hooks too
        return (g * y).exp()

    def scenario():
        x = x_()
        out = ckpt(fn, x, early_stop=early_stop)
        return out, grad_of(out, x)

    same(scenario)


# ---- threads ----


def _blocks() -> list[tuple[Block, torch.Tensor]]:
    """Two blocks and their inputs, made up front: threads share the CPU generator."""
    out = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        out.append((Block(32), x_(2, 8, 32, seed=seed)))
    return out


def _block_step(block: Block, x: torch.Tensor, policy: Any, between: Callable[[], Any] = lambda: None) -> tuple:
    """One checkpointed forward and backward of ``block``; ``between`` runs between the two."""
    block.zero_grad(set_to_none=True)
    x.grad = None
    out = ckpt(block, x, **_policy(policy))
    between()
    out.square().sum().backward()
    between()
    return (out, x.grad, *[p.grad for p in block.parameters()])


@POLICIES
def test_two_threads_checkpointing_concurrently_get_the_single_threaded_results(policy):
    def threaded() -> list:
        use_torch = sac2.frame.switches.torch_frame_in_use()  # the switch is per thread: each thread sets its own
        blocks = _blocks()
        barrier, errors = threading.Barrier(2), []
        results: list[Any] = [None, None]

        def work(i: int) -> None:
            try:
                with sac2.use_torch_frame(use_torch):
                    for _ in range(5):  # both forwards, then both backwards, side by side
                        results[i] = _block_step(*blocks[i], policy, barrier.wait)
            except BaseException as e:  # noqa: BLE001
                errors.append(e)
                barrier.abort()

        threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        CALLS.sort()
        return results

    single = observe("sac2", lambda: [_block_step(*b, policy) for b in _blocks()])
    seen = same(threaded)
    assert_equal(seen.value, single.value)
    assert seen.calls == sorted(single.calls * 5)


# ---- GraphExecGroup and unpacking twice ----

GROUP = getattr(tuc, "GraphExecGroup", None)
needs_group = pytest.mark.skipif(GROUP is None, reason="torch.utils.checkpoint.GraphExecGroup is 2.9+")


@needs_group
def test_backwards_in_one_graph_exec_group_share_one_recompute():
    def scenario():
        x = x_()
        a, b = ckpt(lambda t: (t.sin(), t.cos()), x)
        with GROUP():
            first = grad_of(a, x, retain_graph=True)
            second = grad_of(b, x)
        return first, second

    assert same(scenario).calls == ["forward", "recompute"]


@needs_group
def test_a_retry_in_one_graph_exec_group_after_a_failed_recompute_gives_the_right_gradient():
    # Not an equality with torch: torch's frame counts the failed recompute's saved tensors into the retry (its
    # per-group counter is not reset), so the retry pairs saved tensors with the wrong slots and returns a wrong
    # gradient without an error. sac2's retry starts over.
    def scenario():
        log: list = []

        def fn(x):
            log.append(None)
            y = x.sin()
            if len(log) == 2:
                raise Boom("recompute")
            return y.exp()

        x = x_()
        a, b = ckpt(lambda t: (fn(t), t.cos()), x)
        with GROUP():
            with pytest.raises(Boom):
                grad_of(a, x, retain_graph=True)
            return grad_of(a, x, retain_graph=True)

    x = x_()
    assert_equal(observe("sac2", scenario).value, grad_of(sin_exp(x), x))


@needs_group
def test_overlapping_backwards_in_one_graph_exec_group() -> None:
    def scenario():
        x = x_()
        out = ckpt(sin_exp, x)
        with GROUP():
            grad_of(out, x, retain_graph=True)
            grad_of(out, x)

    seen = same(scenario, raises=tuc.CheckpointError)
    assert_expected_inline(seen.error[1], """torch.utils.checkpoint: Unpack is being triggered for a tensor that was already unpacked once. Performing two backward calls that overlap (i.e. require the same saved activation in order to compute gradients) is not allowed while under the torch.utils.checkpoint.GraphExecGroup context. If you are calling ctx.saved_tensors in backward, make sure to do so only once. Otherwise please open an issue with details on your use case.""")  # noqa: E501


def test_reading_ctx_saved_tensors_twice_in_one_backward() -> None:
    class ReadsTwice(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return x.sin()

        @staticmethod
        def backward(ctx, grad):
            (x,) = ctx.saved_tensors
            (x,) = ctx.saved_tensors
            return grad * x.cos()

    def scenario():
        x = x_()
        return grad_of(ckpt(ReadsTwice.apply, x), x)

    seen = same(scenario, raises=tuc.CheckpointError)
    assert_expected_inline(seen.error[1], """torch.utils.checkpoint: Unpack is being triggered for a tensor that was already unpacked once. If you are calling ctx.saved_tensors in backward, make sure to do so only once. Otherwise please open an issue with details on your use case.""")  # noqa: E501


# ---- CUDA initialised in the forward ----

_INIT_IN_FORWARD = """
import sys, torch, sac2
assert not torch.cuda.is_initialized()
def fn(x):
    return (x.cuda() * 2).sin()
try:
    with sac2.use_torch_frame(sys.argv[1] == "torch"):
        sac2.checkpoint(fn, torch.randn(4, requires_grad=True))
except RuntimeError as e:
    print(type(e).__name__, e)
"""


@CUDA
def test_device_state_initialised_in_forward_raises():
    def run(frame: str) -> str:
        return subprocess.run([sys.executable, "-c", _INIT_IN_FORWARD, frame], capture_output=True, text=True,
                              check=True, timeout=120).stdout

    assert run("sac2") == run("torch")
    assert "PyTorch's device state was initialized in the forward pass of a Checkpoint" in run("sac2")


# ---- memory ----


@pytest.mark.parametrize("policy", [None, "llm"], ids=["full", "sac2_llm"])
def test_a_stack_of_blocks_keeps_no_more_than_on_torchs_frame(policy):
    cfg = dataclasses.replace(CONFIGS["tiny"], n_layers=4)
    torch.manual_seed(0)
    model = Transformer(cfg)
    tokens, targets = random_tokens(cfg, torch.Generator().manual_seed(0), torch.device("cpu"))
    kwargs: dict[str, Any] = {} if policy is None else {"context_fn": sac2_contexts(sac2.policies.llm())}

    def memory(frame: str | None) -> Memory:
        """What one training step keeps after forward and its peak; ``frame`` None: no checkpointing."""
        run_block = (lambda b, x: b(x)) if frame is None else (lambda b, x: sac2.checkpoint(b, x, **kwargs))
        with sac2.use_torch_frame(frame == "torch"):
            measured, _ = measure_step(lambda: model(tokens, targets, run_block), "cpu")
        model.zero_grad(set_to_none=True)
        return measured

    memory("sac2")  # warm-up: first-call allocations (caches, oneDNN) land here
    mine, torchs, plain = memory("sac2"), memory("torch"), memory(None)
    assert mine.kept <= torchs.kept < plain.kept, (mine, torchs, plain)
    assert mine.peak <= torchs.peak, (mine, torchs)


# ---- the deliberate deviations ----


def _rrelu(x: torch.Tensor) -> torch.Tensor:
    return F.rrelu(x[::2], training=True)  # rrelu_with_noise fills the noise buffer autograd saved just before


def _rrelu_runs_in_backward(frame: str, **kwargs: Any) -> tuple[int, torch.Tensor]:
    torch.manual_seed(0)
    x = x_(8, 4)
    with sac2.use_torch_frame(frame == "torch"):
        out = sac2.checkpoint(_rrelu, x, **kwargs)
        with OpRuns() as runs:
            (g,) = grad_of(out, x)
    return runs.counts[aten.rrelu_with_noise.default], g


def test_deviation_sac2_sac_early_stop_lets_an_op_that_fills_a_saved_buffer_finish():
    context_fn = sac2_contexts([])  # save nothing: recompute everything through sac2's modes
    mine, g = _rrelu_runs_in_backward("sac2", context_fn=context_fn)
    torchs, _ = _rrelu_runs_in_backward("torch", context_fn=context_fn)
    assert (mine, torchs) == (1, 0)  # torch's frame stops inside rrelu_with_noise: its noise stays unfilled
    torch.manual_seed(0)
    assert torch.equal(g, _reference_grad(_rrelu, x_(8, 4)))


def test_plain_checkpoint_stops_inside_the_op_on_both_frames():
    assert _rrelu_runs_in_backward("sac2")[0] == _rrelu_runs_in_backward("torch")[0] == 0


def _bytes_kept_by(read: Callable[[], Any]) -> int:
    """Bytes the CPU allocator still holds after ``read()`` of what it allocated during it (its result dropped)."""
    from sac2 import _compat

    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)
    with prof:
        read()
    return sum(_compat.allocation_sizes(prof))


def test_deviation_a_saved_tensor_read_outside_backward_recomputes_for_that_read_alone():
    def scenario():
        x = x_(64, 64)
        out = ckpt(lambda a: a.sin().exp().cos(), x)  # cos saves exp's output; exp its own; sin x
        kept = _bytes_kept_by(lambda: out.grad_fn._saved_self.sum())  # the first read: recomputes
        return out.grad_fn._saved_self, grad_of(out, x), kept  # each read recomputes, on both frames

    mine, torchs = observe("sac2", scenario), observe("torch", scenario)
    assert_equal(mine.value[:2], torchs.value[:2])
    assert mine.calls == torchs.calls == ["forward", "recompute", "recompute", "recompute"]
    assert mine.value[2] == 0 < torchs.value[2]  # torch keeps the other saved tensors of that recompute
