"""Judged against training without checkpointing: what it rejects sac2 rejects, what it computes sac2 computes.

sac2 runs its own frame, so torch's old limits are sac2's to fix: a tensor saved for backward and written in place
afterwards raises autograd's own error (not a wrong gradient), a random op drawing from the user's generator draws
the same numbers in recompute, the user's saved-tensor hooks are honoured on every route, and a hook that changes a
tensor's strides does not break recompute.
"""

from __future__ import annotations

import ast
import functools
import inspect
from typing import Any, Callable

import pytest
import torch
import torch.utils.checkpoint as tuc
from torch import nn

import sac2

from helpers import ROOT, contexts

_AUTOGRAD_INPLACE = r"^one of the variables needed for gradient computation has been modified by an inplace operation"


class _WritesASavedTensor(nn.Module):
    """The issue's snippet: ``lin`` saves ``n`` for its weight's gradient, then ``n`` is written in place."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x * 2.0
        y = self.lin(n)
        n.add_(1.0)
        return (y * n).sin()


_ROUTES: dict[str, Callable[[nn.Module, torch.Tensor], torch.Tensor]] = {
    "full AC": lambda m, x: sac2.checkpoint(m, x),
    "SAC saving the matmul": lambda m, x: sac2.checkpoint(m, x, context_fn=contexts([torch.ops.aten.addmm.default])),
    "SAC saving nothing": lambda m, x: sac2.checkpoint(m, x, context_fn=contexts([])),
    "torch's checkpoint under install()": lambda m, x: _installed(m, x),
    "one-line regions": lambda m, x: _regions(m, x),
}


def _regions(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    model = nn.Sequential(m)
    sac2.apply_ac(model, mode="regions", save=["linear"], blocks=lambda module: module is m)
    return model(x)


def _installed(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with sac2.install():
        return tuc.checkpoint(m, x, use_reentrant=False)


def test_without_checkpointing_the_snippet_raises_autograds_error():
    with pytest.raises(RuntimeError, match=_AUTOGRAD_INPLACE):
        _WritesASavedTensor()(torch.randn(4, 8, requires_grad=True)).sum().backward()


@pytest.mark.parametrize("route", list(_ROUTES))
def test_a_saved_tensor_written_in_place_later_in_the_forward_raises_autograds_error(route):
    out = _ROUTES[route](_WritesASavedTensor(), torch.randn(4, 8, requires_grad=True))
    with pytest.raises(RuntimeError, match=_AUTOGRAD_INPLACE + r".*sac2: .*saved .*inside a checkpointed function"):
        out.sum().backward()


@pytest.mark.parametrize("route", ["full AC", "SAC saving nothing"])
def test_a_saved_tensor_written_in_place_after_the_forward_raises_autograds_error(route):
    x = torch.randn(4, requires_grad=True)
    out = _ROUTES[route](nn.Sequential(nn.Tanh()), x)  # tanh saves its output
    with torch.no_grad():
        out.mul_(2)
    with pytest.raises(RuntimeError, match=_AUTOGRAD_INPLACE):
        out.sum().backward()


@pytest.mark.parametrize("route", ["none", *_ROUTES])
def test_a_parameter_written_in_place_after_the_forward_raises_autograds_error(route):
    torch.manual_seed(0)
    lin = nn.Linear(8, 8)  # saves (a view of) its weight for the input's gradient
    m, x = nn.Sequential(lin, nn.Tanh()), torch.randn(4, 8, requires_grad=True)
    out = m(x) if route == "none" else _ROUTES[route](m, x)
    with torch.no_grad():
        lin.weight.add_(1.0)  # an optimizer step before backward
    with pytest.raises(RuntimeError, match=_AUTOGRAD_INPLACE + r": \[torch.FloatTensor \[8, 8\]\]"):
        out.sum().backward()


@pytest.mark.parametrize("route", ["full AC", "SAC saving nothing"])
def test_saved_views_of_one_tensor_written_through_it_raise_autograds_error_naming_the_view(route):
    """The frame keeps one witness per version counter (views share their base's): a write into the base is
    still each saved view's write, named by the view's own shape."""
    kept: list[torch.Tensor] = []

    def f(x: torch.Tensor) -> torch.Tensor:
        b = x * 2.0
        kept.append(b)
        return b[:, :4].sin() * b.view(8, 4)[:4].cos()  # each saves its own (4, 4) view of b

    x = torch.randn(4, 8, requires_grad=True)
    out = _ROUTES[route](lambda x: f(x), x)  # type: ignore[arg-type]  # a function, as checkpoint takes
    with torch.no_grad():
        kept[0].add_(1.0)
    with pytest.raises(RuntimeError, match=_AUTOGRAD_INPLACE + r": \[torch.FloatTensor \[4, 4\]\]"):
        out.sum().backward()


@pytest.mark.parametrize("route", ["none", "full AC", "SAC saving nothing"])
def test_a_saved_tensor_written_after_the_forward_through_a_detached_alias_raises_autograds_error(route):
    """``detach()`` shares the version counter, not the tensor: the saved tensor dies with the forward, and a write
    through the alias that lives on is still a write into what backward needs (the frame's witness sees it)."""
    aliases: list[torch.Tensor] = []

    def f(x: torch.Tensor) -> torch.Tensor:
        y = x.exp()  # exp saves its output
        aliases.append(y.detach())
        return y.sum()

    x = torch.randn(4, requires_grad=True)
    out = f(x) if route == "none" else _ROUTES[route](lambda x: f(x), x)  # type: ignore[arg-type]  # a function
    with torch.no_grad():
        aliases[0].add_(1.0)
    with pytest.raises(RuntimeError, match=_AUTOGRAD_INPLACE + r": \[torch.FloatTensor \[4\]\]"):
        out.backward()


def test_a_write_before_the_tensor_is_saved_is_no_error():
    def f(x: torch.Tensor) -> torch.Tensor:
        n = x * 2.0
        n.add_(1.0)  # autograd saves n only below, after the write
        return n.sin()

    x = torch.randn(5, requires_grad=True)
    (want,) = torch.autograd.grad(f(x).sum(), [x])
    (got,) = torch.autograd.grad(sac2.checkpoint(f, x).sum(), [x])
    assert torch.equal(got, want)


def _input_written_after_forward(outer: Callable[..., Any], inner: Callable[..., Any]) -> None:
    """``inner`` (a checkpoint, or a plain call) takes ``b`` unused; ``b`` is written after ``outer``'s forward."""
    x = torch.randn(4, 4, dtype=torch.float64, requires_grad=True)
    kept: list[torch.Tensor] = []

    def body(x: torch.Tensor) -> torch.Tensor:
        a, b = x * 2.0, x * 3.0
        kept.append(b)
        return inner(lambda a, _b: torch.logsumexp(a @ a, dim=-1), a, b)

    out = outer(body, x)
    with torch.no_grad():
        kept[0].zero_()
    out.sum().backward()


_OUTERS: dict[str, Callable[..., Any]] = {
    "none": lambda f, x: f(x),
    "full AC": lambda f, x: sac2.checkpoint(f, x),
    "SAC saving nothing": lambda f, x: sac2.checkpoint(f, x, context_fn=contexts([])),
}


@pytest.mark.parametrize("outer", ["full AC", "SAC saving nothing"])
def test_a_nested_checkpoints_input_written_after_the_forward_raises_autograds_error_naming_the_input(outer):
    # Recompute runs the checkpointed function again from its inputs: a written input would give it other values
    # (a documented error: without checkpointing this trains, see below). The outer checkpoint holds the input.
    with pytest.raises(RuntimeError) as error:
        _input_written_after_forward(_OUTERS[outer], sac2.checkpoint)
    assert str(error.value).startswith(
        "one of the variables needed for gradient computation has been modified by an inplace operation: "
        "[torch.DoubleTensor [4, 4]] is at version 1; expected version 0 instead. sac2: it is input 1 of a "
        "checkpointed function, written in place after the checkpointed call started"
    )


def test_a_checkpoints_input_written_after_the_forward_raises_autograds_own_error():
    # On its own, the checkpoint saves its inputs as autograd saves tensors: autograd checks them, in its words.
    with pytest.raises(RuntimeError, match=_AUTOGRAD_INPLACE + r": \[torch.DoubleTensor \[4, 4\]\], which is output 0"):
        _input_written_after_forward(_OUTERS["none"], sac2.checkpoint)


def test_an_unused_input_written_after_the_forward_trains_without_checkpointing():
    _input_written_after_forward(_OUTERS["none"], lambda f, *args: f(*args))


def test_allow_mutation_on_saved_tensors_still_allows_writing_a_saved_input():
    x = torch.randn(4, requires_grad=True)
    h = x * 1
    with torch.autograd.graph.allow_mutation_on_saved_tensors():
        out = sac2.checkpoint(torch.sin, h)
        h.add_(1)  # the context keeps the original for backward
        (got,) = torch.autograd.grad(out.sum(), [x])
    assert torch.equal(got, x.detach().cos())


# ---- explicit generators ----


def _noisy(g: torch.Generator) -> Callable[[torch.Tensor], torch.Tensor]:
    def f(x: torch.Tensor) -> torch.Tensor:
        return (x * torch.randn(x.shape, generator=g)).sin()

    return f


def _grads_and_generator(run: Callable[[Callable[..., Any], torch.Tensor], torch.Tensor]) -> tuple[Any, ...]:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, generator=torch.Generator().manual_seed(0), requires_grad=True)
    (grad,) = torch.autograd.grad(run(_noisy(g), x).sum(), [x])
    return grad, g.get_state()


_NO_CHECKPOINT = functools.partial(_grads_and_generator, lambda f, x: f(x))


@pytest.mark.parametrize("policy", [[], [torch.ops.aten.randn.generator]], ids=["recomputed", "saved"])
def test_a_random_op_drawing_from_the_users_generator_draws_the_same_numbers_in_recompute(policy):
    got = _grads_and_generator(lambda f, x: sac2.checkpoint(f, x, context_fn=contexts(policy)))
    want = _NO_CHECKPOINT()
    assert torch.equal(got[0], want[0])
    assert torch.equal(got[1], want[1]), "the generator is left where no checkpointing leaves it"


@pytest.mark.filterwarnings("ignore:sac2. the policy saves")
def test_a_nested_checkpoint_saving_a_draw_from_the_users_generator_leaves_it_where_no_checkpointing_does():
    # The inner checkpoint's draw, saved by the outer one too, is recomputed in the outer recompute (the inner
    # forward writes into what the outer saved): it draws from the state it drew from in forward.
    saving_all = [torch.ops.aten.empty_like.default, torch.ops.aten.normal_.default, torch.ops.aten.add.Tensor]

    def run(nested: bool) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(1)
        x = torch.ones(4, 4, requires_grad=True)

        def inner(a: torch.Tensor) -> torch.Tensor:
            return (a + torch.empty_like(a).normal_(generator=g)).sin()

        def outer(a: torch.Tensor) -> torch.Tensor:
            b = a * 2
            c = sac2.checkpoint(inner, b, context_fn=contexts(saving_all)) if nested else inner(b)
            return c @ c

        y = sac2.checkpoint(outer, x, context_fn=contexts(saving_all)) if nested else outer(x)
        (grad,) = torch.autograd.grad(y.sum(), [x])
        return grad, g.get_state()

    got, want = run(True), run(False)
    assert torch.equal(got[0], want[0])
    assert torch.equal(got[1], want[1]), "the generator is left where no checkpointing leaves it"


def test_full_ac_replays_the_generators_preserve_generators_names():
    def run(f: Callable[..., Any], x: torch.Tensor) -> torch.Tensor:
        g = inspect.getclosurevars(f).nonlocals["g"]
        with sac2.preserve_generators(g):
            return sac2.checkpoint(f, x)

    got, want = _grads_and_generator(run), _NO_CHECKPOINT()
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_full_ac_draws_again_from_a_generator_it_was_not_told_about():
    # docs/concepts.md: no mode sees the ops of full AC; name the generator with sac2.preserve_generators.
    got, want = _grads_and_generator(lambda f, x: sac2.checkpoint(f, x)), _NO_CHECKPOINT()
    assert not torch.equal(got[0], want[0])


def test_preserve_generators_takes_generators_only():
    with pytest.raises(TypeError, match="takes torch.Generator objects, got int"):
        sac2.preserve_generators(3)  # type: ignore[arg-type]  # the wrong type, on purpose


# ---- the user's saved-tensor hooks ----


def _counting_hooks() -> tuple[Any, dict[str, int]]:
    counts = {"pack": 0}

    def pack(t: torch.Tensor) -> torch.Tensor:
        counts["pack"] += 1
        return t

    return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), counts


def _packs(route: str, respect: bool | None) -> tuple[int, list[type[Warning]]]:
    x = torch.randn(4, 4, dtype=torch.float64, requires_grad=True)
    policy = [torch.ops.aten.exp.default, torch.ops.aten.tanh.default]
    hooks, counts = _counting_hooks()
    with pytest.warns() if respect is None else _no_warning() as caught, hooks:
        if route == "sac2.checkpoint":
            out = sac2.checkpoint(lambda t: t.exp().tanh(), x, context_fn=contexts(policy),
                                  respect_saved_tensors_hooks=respect)
        else:
            with sac2.install():
                context_fn = functools.partial(tuc.create_selective_checkpoint_contexts, policy)
                out = tuc.checkpoint(lambda t: t.exp().tanh(), x, use_reentrant=False, context_fn=context_fn,
                                     respect_saved_tensors_hooks=respect)
    out.sum().backward()
    return counts["pack"], [w.category for w in caught]


class _no_warning:
    def __enter__(self) -> list[Any]:
        import warnings

        self._catch = warnings.catch_warnings(record=True)
        caught = self._catch.__enter__()
        warnings.simplefilter("always")
        return caught

    def __exit__(self, *exc: Any) -> None:  # the exception's type, value and traceback, passed on
        self._catch.__exit__(*exc)


_TORCH_TAKES_THE_FLAG = "respect_saved_tensors_hooks" in inspect.signature(tuc.checkpoint).parameters


@pytest.mark.skipif(not _TORCH_TAKES_THE_FLAG, reason="torch 2.13's checkpoint has no respect_saved_tensors_hooks")
@pytest.mark.parametrize("respect", [True, False, None])
def test_respect_saved_tensors_hooks_does_under_install_what_it_does_through_sac2(respect):
    assert _packs("install()", respect) == _packs("sac2.checkpoint", respect)


@pytest.mark.parametrize(("respect", "packs"), [(True, 3), (False, 1)])
def test_what_the_policy_saves_goes_through_the_users_hooks_only_when_respected(respect, packs):
    # the checkpoint's input goes through them either way, as autograd saves it; exp's and tanh's outputs too
    # when respected
    assert _packs("sac2.checkpoint", respect)[0] == packs


def _contiguous(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().clone()  # what save_on_cpu's copy into a fresh buffer does to a transposed tensor


def _column_major(t: torch.Tensor) -> torch.Tensor:
    # the same values, the first and last dims' strides swapped
    return t.transpose(0, -1).contiguous().transpose(0, -1) if t.dim() >= 2 else t.clone()


@pytest.mark.parametrize("repack", [_contiguous, _column_major], ids=["to contiguous", "to column-major"])
def test_a_hook_that_changes_an_inputs_strides_does_not_break_recompute(repack):
    # The checkpoint's input comes back from the user's hook with other strides, so reshape views it in one run
    # and copies it (clone, _unsafe_view) in the other.
    def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return (x.reshape(-1, 8) @ w).relu()

    base = torch.randn(4, 6, requires_grad=True)
    w = torch.randn(8, 3, requires_grad=True)
    x = base.t() if repack is _contiguous else base.reshape(6, 4)
    with torch.autograd.graph.saved_tensors_hooks(repack, lambda t: t):
        want = torch.autograd.grad(f(x, w).sum(), [base, w])  # the same hooks, without checkpointing
        out = sac2.checkpoint(f, x, w, context_fn=contexts([torch.ops.aten.mm.default]),
                              respect_saved_tensors_hooks=True)
    got = torch.autograd.grad(out.sum(), [base, w])
    for a, b in zip(got, want, strict=True):
        # Not bitwise: without checkpointing mm's backward reads the layout the hook gave its saved input; with
        # it, the recomputed one, so the matmul sums in another order.
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


# ---- saved tensors written in place under the user's hooks (frame rule 3a) ----


def _written_after_saving(x: torch.Tensor) -> torch.Tensor:
    n = x * 2.0
    y = (n * x).sin()  # mul saves n for x's gradient; the last tensor saved is sin's input
    n.clamp_(-0.5, 0.5)  # without hooks autograd raises; under them, backward reads what the hook kept
    return y


def _clone(t: torch.Tensor) -> torch.Tensor:
    return t.clone()


_KEEPING = {"save_on_cpu (keeps CPU tensors themselves)": torch.autograd.graph.save_on_cpu,
            "hooks that copy": lambda: torch.autograd.graph.saved_tensors_hooks(_clone, lambda t: t)}
_SAC_ROUTES = {"full AC": None, "SAC saving nothing": [], "SAC saving mul": [torch.ops.aten.mul.Tensor]}


@pytest.mark.parametrize("early_stop", [True, False], ids=["early stop", "no early stop"])
@pytest.mark.parametrize("route", list(_SAC_ROUTES))
@pytest.mark.parametrize("hooks", list(_KEEPING))
def test_a_saved_tensor_written_later_in_the_forward_under_hooks_gives_what_the_hooks_kept(hooks, route, early_stop):
    x = torch.randn(6, dtype=torch.float64, requires_grad=True)
    with _KEEPING[hooks]():
        (want,) = torch.autograd.grad(_written_after_saving(x).sum(), [x])
        save = _SAC_ROUTES[route]
        options: dict[str, Any] = {} if save is None else {"context_fn": contexts(save)}
        with tuc.set_checkpoint_early_stop(early_stop), pytest.warns() if save else _no_warning():
            out = sac2.checkpoint(_written_after_saving, x, **options)
    (got,) = torch.autograd.grad(out.sum(), [x])
    assert torch.equal(got, want)


@pytest.mark.parametrize("route", ["full AC", "SAC saving nothing"])
def test_a_saved_tensor_resized_later_is_no_error_where_its_node_never_runs(route):
    # mul saves n, which is then resized; no gradient flows through mul, so autograd never unpacks n.
    def f(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n = x.detach() * 2
        unused = w * n  # an output whose node backward never runs
        n.resize_(1)
        return (x * x).sum(), unused

    x, w = torch.randn(4, 4, requires_grad=True), torch.randn(4, 4, requires_grad=True)
    plain = f(x, w)
    (want,) = torch.autograd.grad(plain[0], [x])
    options: dict[str, Any] = {} if route == "full AC" else {"context_fn": contexts([])}
    outs = sac2.checkpoint(f, x, w, **options)  # both outputs alive: the mul node (and its saved n) too
    (got,) = torch.autograd.grad(outs[0], [x])
    assert torch.equal(got, want)


def test_a_saved_tensor_resized_later_in_the_forward_under_save_on_cpu_fails_as_without_checkpointing():
    def f(x: torch.Tensor) -> torch.Tensor:
        n = x.detach() * 2.0
        y = x * n  # saves n
        n.resize_(2, 8)
        return y

    x = torch.randn(4, 4, requires_grad=True)
    with torch.autograd.graph.save_on_cpu():
        with pytest.raises(RuntimeError, match="must match the size") as want:
            f(x).sum().backward()
        out = sac2.checkpoint(f, x)
    with pytest.raises(RuntimeError, match="must match the size") as got:
        out.sum().backward()
    assert str(got.value) == str(want.value)


def test_a_saved_tensor_written_after_the_forward_under_hooks_keeping_it_raises():
    # Without checkpointing backward would read the written values, which no recompute can make.
    x = torch.randn(6, requires_grad=True)
    with torch.autograd.graph.save_on_cpu():
        out = sac2.checkpoint(torch.tanh, x * 1)  # tanh saves its output
    with torch.no_grad():
        out.mul_(2)
    with pytest.raises(RuntimeError, match=r"sac2: a tensor .* was modified in place after the checkpointed "
                                           r"forward ended\. Your saved-tensor hooks keep saved tensors themselves"):
        out.sum().backward()


def test_a_saved_tensor_written_after_the_forward_under_hooks_that_copy_gives_the_copy():
    x = torch.randn(6, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(_clone, lambda t: t):
        want = torch.tanh(x * 1)
        out = sac2.checkpoint(torch.tanh, x * 1)
    with torch.no_grad():
        want.mul_(2)
        out.mul_(2)
    (w,) = torch.autograd.grad(want.sum(), [x])
    (g,) = torch.autograd.grad(out.sum(), [x])
    assert torch.equal(g, w)


def _saved_sin_written_after_the_forward(hooks: Any, checkpointed: bool) -> torch.Tensor:
    """``y = sin(x)`` is saved by the policy (and by no backward node: sin saves ``x``); ``b = cos(y)`` (an ``out=``
    buffer) and ``y * b`` are recomputed, the sum is saved; ``y`` is written after the forward. Returns x's
    gradient (through ``y * b``, which saves ``b``)."""
    x = torch.randn(4, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0)).requires_grad_()
    kept: list[torch.Tensor] = []

    def f(x: torch.Tensor) -> torch.Tensor:
        y = x.sin()
        kept.append(y)
        b = torch.zeros(4, 4, dtype=torch.float64)
        torch.cos(y.detach(), out=b)
        return torch.sum(y * b, dim=-1)

    saving = contexts([torch.ops.aten.sin.default, torch.ops.aten.sum.dim_IntList])
    with hooks:
        out = sac2.checkpoint(f, x, context_fn=saving, respect_saved_tensors_hooks=True) if checkpointed else f(x)
    with torch.no_grad():
        kept[0].add_(1.0)
    return torch.autograd.grad(out.sum(), [x])[0]


def test_a_saved_op_output_written_after_the_forward_under_hooks_keeping_it_raises():
    # save_on_cpu keeps a CPU tensor itself: what sac2 serves is the written value, and recompute would make
    # another ``cos(y)`` from it than the forward's, which backward without checkpointing reads.
    with pytest.raises(RuntimeError, match=r"modified in place after the checkpointed forward ended"):
        _saved_sin_written_after_the_forward(torch.autograd.graph.save_on_cpu(), checkpointed=True)


def test_a_saved_op_output_written_after_the_forward_under_hooks_that_copy_gives_the_copy():
    def copying() -> Any:
        return torch.autograd.graph.saved_tensors_hooks(_clone, lambda t: t)

    want = _saved_sin_written_after_the_forward(copying(), checkpointed=False)
    assert torch.equal(_saved_sin_written_after_the_forward(copying(), checkpointed=True), want)


def test_a_saved_op_output_a_hook_handed_back_as_a_view_takes_in_place_view_ops_in_recompute():
    # The hook's copy is a view made in no-grad mode; autograd forbids in-place ops on such a view in grad mode.
    def f(x: torch.Tensor) -> torch.Tensor:
        v = x * 1.5
        v.t_()
        return v.sin()

    x = torch.randn(4, 4, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(_column_major, lambda t: t):
        (want,) = torch.autograd.grad(f(x).sum(), [x])
        out = sac2.checkpoint(f, x, context_fn=contexts([torch.ops.aten.mul.Tensor]),
                              respect_saved_tensors_hooks=True)
    (got,) = torch.autograd.grad(out.sum(), [x])
    assert torch.equal(got, want)


def test_a_saved_op_output_a_hook_restrided_is_served_with_its_forward_strides():
    # Served column-major, sin's output would make linear's matmul run bmm where forward ran mm.
    def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        linear = torch.nn.functional.linear
        return linear(linear(torch.sin(x), w), w)

    x = torch.randn(2, 4, 4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, 4, dtype=torch.float64)
    with torch.autograd.graph.saved_tensors_hooks(_column_major, lambda t: t):
        want = torch.autograd.grad(f(x, w).sum(), [x])
        out = sac2.checkpoint(f, x, w, context_fn=contexts(lambda *args, **kwargs: True),
                              respect_saved_tensors_hooks=True)
    got = torch.autograd.grad(out.sum(), [x])
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)  # mm's backward reads the hook's layout


# ---- engine checks ----


def test_no_engine_check_is_a_bare_assert_that_python_O_would_drop():
    bare = [
        f"{path.relative_to(ROOT)}:{node.lineno}"
        for path in sorted((ROOT / "sac2").rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Assert)
    ]
    assert bare == []


def test_an_input_a_hook_restrided_comes_back_with_its_forward_strides_for_ops_that_read_them():
    # empty_like keeps its argument's strides and uniform_ fills memory in order: on a restrided input the same
    # draws would land at other positions.
    def f(x: torch.Tensor) -> torch.Tensor:
        return x * torch.empty_like(x).uniform_(-1.0, 1.0)

    x = torch.randn(4, 6, requires_grad=True)
    torch.manual_seed(0)
    (want,) = torch.autograd.grad(f(x).sum(), [x])
    torch.manual_seed(0)
    with torch.autograd.graph.saved_tensors_hooks(_column_major, lambda t: t):
        out = sac2.checkpoint(f, x)
    (got,) = torch.autograd.grad(out.sum(), [x])
    assert torch.equal(got, want)
