"""Cases where sac2 0.1 was silently wrong or failed where stock SAC is right, each found by differential fuzzing
or review: gradients, outputs after backward and generator states equal those of the un-checkpointed run."""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import sac2

from helpers import assert_same_as_without_checkpointing, contexts

aten = torch.ops.aten


def _save_all(_ctx, _op, *args, **kwargs):
    return sac2.CheckpointPolicy.MUST_SAVE


def _assert_same(fn, inputs, policy, **kwargs):
    """``fn`` under ``sac2.checkpoint`` saving what ``policy`` says gives the outputs and gradients of no
    checkpointing, bit for bit, from the same RNG state."""
    torch.manual_seed(0)
    assert_same_as_without_checkpointing(
        lambda f, *xs: sac2.checkpoint(f, *xs, context_fn=contexts(policy), **kwargs), fn, *inputs
    )


# ---- 1. preserve_rng_state=False leaves the generator where no checkpointing leaves it ----


def _noise_then_sin(x):
    return (x * torch.rand_like(x)).sin()


def _noisy_region(x):
    return x * torch.rand_like(x)


_region = sac2.region(_noisy_region, name="never_silently_wrong.noisy")


def _noisy_region_then_sin(x):
    return _region(x).sin()  # sin saves its input: backward recomputes


@pytest.mark.parametrize(
    "fn, policy",
    [
        (_noise_then_sin, [aten.rand_like.default]),
        (_noise_then_sin, _save_all),
        (_noisy_region_then_sin, [sac2.Region("never_silently_wrong.noisy")]),
        (_noisy_region_then_sin, _save_all),
    ],
    ids=["saved_random_op", "everything_saved", "saved_region_list", "saved_region_function"],
)
def test_backward_without_preserve_rng_state_does_not_rewind_the_generator(fn, policy):
    # Numbers drawn between forward and backward must not be drawn again after backward.
    x = torch.randn(64, requires_grad=True)
    torch.manual_seed(0)
    y = fn(x)
    torch.rand(8)
    y.sum().backward()
    after_plain = torch.get_rng_state()
    torch.manual_seed(0)
    y = sac2.checkpoint(fn, x, context_fn=contexts(policy), preserve_rng_state=False)
    torch.rand(8)
    y.sum().backward()
    assert torch.equal(torch.get_rng_state(), after_plain)


def test_a_saved_op_drawing_from_an_explicit_generator_leaves_it_where_no_checkpointing_does():
    def fn(x, gen):
        return (x * torch.rand(x.shape, generator=gen)).sin()

    x = torch.randn(16, requires_grad=True)
    plain = torch.Generator().manual_seed(3)
    fn(x, plain).sum().backward()
    gen = torch.Generator().manual_seed(3)
    y = sac2.checkpoint(fn, x, gen, context_fn=contexts(_save_all))
    y.sum().backward()
    assert torch.equal(gen.get_state(), plain.get_state())


def test_saved_random_op_still_advances_the_generator_for_recomputed_draws_when_preserving_rng():
    def fn(x):
        return F.dropout(F.dropout(x, 0.5, training=True).sin(), 0.5, training=True)

    first = [c for c in (aten.native_dropout.default, aten.bernoulli_.float)]
    calls = {"n": 0}

    def save_first_dropout(_ctx, op, *args, **kwargs):
        if op in first:
            calls["n"] += 1
            return calls["n"] == 1
        return False

    _assert_same(fn, [torch.randn(64, requires_grad=True)], save_first_dropout)


# ---- 2. a saved factory op later written in place ----


def _save_all_but_in_place(_ctx, op, *args, **kwargs):
    return torch.Tag.inplace not in getattr(op, "tags", ())


@pytest.mark.parametrize("factory", ["zeros", "zeros_like", "ones_like", "empty_like", "full"])
def test_saved_factory_output_written_in_place_later_is_recomputed(factory):
    make = {
        "zeros": lambda _x: torch.zeros(4),
        "zeros_like": torch.zeros_like,
        "ones_like": torch.ones_like,
        "empty_like": lambda x: torch.empty_like(x).fill_(0.5),
        "full": lambda _x: torch.full((4,), 2.0),
    }[factory]

    def fn(x):
        buf = make(x)
        buf.add_(x.detach())
        return buf * x, buf

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # sac2 warns that the saved value went stale
        _assert_same(fn, [torch.randn(4, requires_grad=True)], _save_all_but_in_place)


def test_recompute_does_not_write_into_a_returned_factory_buffer():
    def fn(x):
        buf = torch.zeros(4)
        buf.add_(x.detach())
        return buf * x, buf

    x = torch.randn(4, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out, buf = sac2.checkpoint(fn, x, context_fn=contexts(_save_all_but_in_place))
    before = buf.clone()
    out.sum().backward()
    assert torch.equal(buf, before)


# ---- 3. in-place metadata ops are re-run like views ----


def _t(y):
    return y.t_()


def _transpose(y):
    return y.transpose_(0, 1)


def _unsqueeze(y):
    return y.unsqueeze_(0)


def _squeeze(y):
    return y.unsqueeze(0).mul(1.0).squeeze_(0)


@pytest.mark.parametrize(
    "meta", [_t, _transpose, _unsqueeze, _squeeze], ids=["t_", "transpose_", "unsqueeze_", "squeeze_"]
)
def test_saved_in_place_metadata_ops_replay_correctly(meta):
    def fn(a, b):
        y = (a @ b) * 1.5
        return meta(y).exp()

    _assert_same(fn, [torch.randn(4, 8, requires_grad=True), torch.randn(8, 8, requires_grad=True)], _save_all)


def test_matmul_of_a_vector_and_a_matrix_under_save_everything():
    # matmul(1-D, 2-D) runs squeeze_ inside
    _assert_same(
        lambda v, m: torch.matmul(v, m).tanh(),
        [torch.randn(8, requires_grad=True), torch.randn(8, 4, requires_grad=True)],
        _save_all,
    )


def _backward_twice(fn, inputs, style, **checkpoint_kwargs):
    """Gradients of two backwards through ``fn`` (plain, or under ``sac2.checkpoint``): ``retain_graph=True``
    twice, or ``create_graph=True`` then a backward through the first gradients (double backward)."""
    inputs = [t.detach().clone().requires_grad_() for t in inputs]
    out = sac2.checkpoint(fn, *inputs, **checkpoint_kwargs) if checkpoint_kwargs else fn(*inputs)
    loss = sum(o.sum() for o in (out if isinstance(out, tuple) else (out,)))
    if style == "retain_graph":
        first = torch.autograd.grad(loss, inputs, retain_graph=True)
        second = torch.autograd.grad(loss, inputs)
    else:
        first = torch.autograd.grad(loss, inputs, create_graph=True)
        second = torch.autograd.grad(sum(g.sum() for g in first), inputs)
    return [g.detach() for g in (*first, *second)]


def _vector_matmul_aliased(x0, x2):
    v3 = x0 @ x2  # matmul(1-D, 2-D) squeezes the saved mm output in place
    return v3 * x2, v3.float()  # .float() of a float tensor is v3 itself


@pytest.mark.parametrize("style", ["retain_graph", "create_graph"])
@pytest.mark.parametrize("answer", [sac2.CheckpointPolicy.MUST_SAVE, sac2.CheckpointPolicy.MUST_CPU_OFFLOAD])
def test_a_second_backward_serves_an_output_the_replay_squeezed_in_place(style, answer):
    # The replayed squeeze_ bumps the version counter the served alias shares with the saved output; sac2 0.2 took
    # that for a modification after the forward and raised in the second backward.
    def policy(_ctx, op, *args, **kwargs):
        return answer if op in (aten.mm.default, aten.mul.Tensor) else sac2.CheckpointPolicy.PREFER_RECOMPUTE

    inputs = [torch.randn(4), torch.randn(4, 4)]
    expected = _backward_twice(_vector_matmul_aliased, inputs, style)
    actual = _backward_twice(_vector_matmul_aliased, inputs, style, context_fn=contexts(policy))
    assert all(torch.equal(e, a) for e, a in zip(expected, actual, strict=True))


def test_an_op_filling_a_buffer_a_factory_made_is_let_finish_by_early_stop():
    # rrelu_with_noise writes the noise buffer empty_like made, after autograd saved it for backward. Early stop
    # (the last saved tensor is that buffer) must let the op run first, or backward reads uninitialised memory.
    saved = [aten.empty_like.default, aten.rrelu_with_noise.default, aten.slice.Tensor]

    def policy(_ctx, op, *args, **kwargs):
        return sac2.CheckpointPolicy.PREFER_SAVE if op in saved else sac2.CheckpointPolicy.PREFER_RECOMPUTE

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # empty_like is written later in the forward: recomputed, warned
        _assert_same(lambda x: F.rrelu(x[::2], training=True), [torch.randn(8, 4, requires_grad=True)], policy)


def test_batch_norm_running_statistics_made_in_the_region_are_updated_once():
    # native_batch_norm writes running_mean/var although its schema does not say so: a saved factory op whose
    # output it updates is stale (sac2 0.2 served the forward's buffer and recompute updated it a second time).
    def fn(x):
        mean, var = torch.zeros(4, dtype=x.dtype), x.new_ones(4)
        y = F.batch_norm(x, mean, var, training=True, momentum=0.3)
        return mean, torch.sin(y + mean.exp() * var)

    def after_backward(**checkpoint_kwargs):
        x = torch.randn(4, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0), requires_grad=True)
        mean, out = sac2.checkpoint(fn, x, **checkpoint_kwargs) if checkpoint_kwargs else fn(x)
        out.sum().backward()
        return mean, x.grad

    expected = after_backward()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the factory outputs are written later in the forward: recomputed, warned
        actual = after_backward(context_fn=contexts([aten.zeros.default, aten.new_ones.default]))
    assert all(torch.equal(e, a) for e, a in zip(expected, actual, strict=True))


def test_a_saved_region_serves_a_second_backward_through_another_output():
    act = sac2.region(lambda t: torch.sigmoid(t) * t, name="never_silently_wrong.act")

    def fn(x):
        return x.cos().sum(), (act(x.exp()) * x.sin()).sum()

    def run(**checkpoint_kwargs):
        x = torch.randn(4, dtype=torch.float64, generator=torch.Generator().manual_seed(0), requires_grad=True)
        first, second = sac2.checkpoint(fn, x, **checkpoint_kwargs) if checkpoint_kwargs else fn(x)
        return torch.autograd.grad(first, x)[0], torch.autograd.grad(second, x)[0]  # the graph is not retained

    expected = run()
    actual = run(context_fn=contexts([sac2.Region("never_silently_wrong.act")]))
    assert all(torch.equal(e, a) for e, a in zip(expected, actual, strict=True))


def test_an_outer_checkpoint_replaying_an_in_place_view_op_leaves_an_inner_saved_output_unmodified():
    # The outer checkpoint's replay serves an op of the inner forward and replays unsqueeze_ on it; the bump of
    # the shared version counter read as a modification in the inner record's second backward.
    def inner(t):
        y = t * 1.5
        y.unsqueeze_(0)
        return torch.where(y > 0, y, y)

    def fn(x):
        return sac2.checkpoint(inner, x, context_fn=contexts(_save_all)) * x

    inputs = [torch.randn(4, dtype=torch.float64)]
    expected = _backward_twice(fn, inputs, "retain_graph")
    actual = _backward_twice(fn, inputs, "retain_graph", context_fn=contexts(_save_all))
    assert all(torch.equal(e, a) for e, a in zip(expected, actual, strict=True))


def test_early_stop_finishing_a_random_op_leaves_the_generator_where_torch_leaves_it():
    def fn(x):
        y = x * x
        z = F.rrelu(y * x, training=True)  # the last op that saves: early stop waits for it, then stops
        return y, z

    def state_after(**checkpoint_kwargs):
        torch.manual_seed(0)
        x = torch.randn(4, dtype=torch.float64, requires_grad=True)
        y, _ = sac2.checkpoint(fn, x, **checkpoint_kwargs) if checkpoint_kwargs else fn(x)
        y.sum().backward()
        return torch.get_rng_state()

    expected = state_after()
    actual = state_after(context_fn=contexts([aten.add.Tensor]), preserve_rng_state=False)
    assert torch.equal(actual, expected)


# ---- 4. out= ops that resize their output ----


def test_saved_out_op_that_resizes_its_out_tensor():
    def fn(a):
        out = torch.empty(0)
        torch.mul(a.detach(), 3, out=out)
        return a * out

    _assert_same(fn, [torch.randn(4, 4, requires_grad=True)], _save_all)


# ---- 5. policies with per-forward state ----


def test_every_other_matmul_under_torch_modes_raises_instead_of_saving_every_matmul():
    policy = sac2.policies.every_other_matmul()
    context_fn = functools.partial(torch.utils.checkpoint.create_selective_checkpoint_contexts, policy)
    x = torch.randn(4, 4, requires_grad=True)
    with pytest.raises(RuntimeError, match="needs sac2's modes"):
        torch.utils.checkpoint.checkpoint(lambda t: (t @ t) @ t, x, use_reentrant=False, context_fn=context_fn)


def test_nested_checkpoints_sharing_one_policy_count_their_calls_apart():
    policy = sac2.policies.every_other_matmul()
    answers: dict[str, list[sac2.CheckpointPolicy]] = {"outer": [], "inner": []}

    def recording(name):
        def ask(ctx, op, *args, **kwargs):
            answer = policy(ctx, op, *args, **kwargs)
            if op is aten.mm.default:
                answers[name].append(answer)
            return answer

        return ask

    def inner(t):
        return (t @ t).sin() @ t

    def outer(t):
        return sac2.checkpoint(inner, t @ t, context_fn=contexts(recording("inner"))) @ t

    sac2.checkpoint(outer, torch.randn(4, 4, requires_grad=True), context_fn=contexts(recording("outer")))
    save, recompute = sac2.CheckpointPolicy.MUST_SAVE, sac2.CheckpointPolicy.MUST_RECOMPUTE
    assert answers == {"outer": [save, recompute, save, recompute], "inner": [save, recompute]}


def test_memory_budget_keeps_separate_counts_for_interleaved_forwards():
    from sac2.core.decisions import ForwardContext

    block = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    x = torch.randn(2, 4)
    budget = sac2.policies.memory_budget(block, (x,), 0.5, cost="flops")
    keys = [c.key for c in budget.profile.calls]
    ops = [k for k in keys if isinstance(k, torch._ops.OpOverload)]
    assert ops == keys  # each call's key is its op, what a policy is asked about
    alone = [budget(ForwardContext(), op) for op in ops[:1]]
    outer, inner = ForwardContext(), ForwardContext()
    interleaved = []
    for op in ops:
        interleaved.append(budget(outer, op))
        budget(inner, op)  # another forward in between does not reset the first one's counts
    fresh = ForwardContext()
    assert interleaved == [budget(fresh, op) for op in ops] and alone[0] == interleaved[0]


# ---- 6. regions: CPU_OFFLOAD and a policy's TypeError ----


def test_region_answered_cpu_offload_is_kept_and_not_run_again():
    runs = []

    @sac2.region(name="never_silently_wrong.offloaded")
    def body(x):
        runs.append(1)
        return x.sin() * 2

    def policy(_ctx, op, *args, **kwargs):
        if isinstance(op, sac2.Region):
            return sac2.CheckpointPolicy.MUST_CPU_OFFLOAD
        return sac2.CheckpointPolicy.PREFER_RECOMPUTE

    x = torch.randn(8, requires_grad=True)
    y = sac2.checkpoint(lambda t: body(t).cos(), x, context_fn=contexts(policy))
    runs.clear()
    (grad,) = torch.autograd.grad(y.sum(), x)
    assert runs == []
    assert torch.equal(grad, torch.autograd.grad(body(x).cos().sum(), x)[0])


def _refuses_regions(_ctx, op, *args, **kwargs):
    if isinstance(op, sac2.Region):
        raise TypeError("policy cannot decide regions")
    return False


def test_a_type_error_raised_by_a_policy_for_a_region_reaches_the_caller():
    body = sac2.region(lambda t: t * 2, name="never_silently_wrong.typed")

    with pytest.raises(TypeError, match="policy cannot decide regions"):
        x = torch.randn(3, requires_grad=True)
        sac2.checkpoint(lambda t: body(t) * t, x, context_fn=contexts(_refuses_regions))


# ---- 7. nested jagged tensors ----


class _MLPBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.norm = nn.LayerNorm(8)
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 8)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


def _njt():
    torch.manual_seed(1)
    parts = [torch.randn(n, 8) for n in (3, 5, 2)]
    return torch.nested.nested_tensor(parts, layout=torch.jagged, requires_grad=True)


@pytest.mark.parametrize("policy", [[aten.addmm.default, aten.mm.default], _save_all, []], ids=["mm", "all", "none"])
def test_pre_norm_mlp_block_on_a_nested_jagged_tensor(policy):
    block = _MLPBlock()
    x = _njt()
    block(x).values().sum().backward()
    expected = [p.grad.clone() for p in block.parameters()], x.grad.values().clone()
    block.zero_grad()
    x = _njt()
    sac2.checkpoint(block, x, context_fn=contexts(policy)).values().sum().backward()
    for e, a in zip(expected[0], [p.grad for p in block.parameters()], strict=True):
        assert torch.equal(e, a)
    assert torch.equal(expected[1], x.grad.values())


# ---- autocast caches casts: recompute may run fewer _to_copy than forward ----


def test_recompute_under_autocast_with_cached_casts_does_not_diverge():
    def fn(a, b):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = torch.tanh(F.linear(b, b))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            u = F.linear(b, h) + (b @ a).unsqueeze(1)
        return torch.addmm(u.float(), h.float(), u.float())

    a, b = torch.randn(4, requires_grad=True), torch.randn(4, 4, requires_grad=True)
    out = sac2.checkpoint(fn, a, b, context_fn=contexts([]))
    grads = torch.autograd.grad(out.sum(), (a, b), create_graph=True)
    assert all(torch.equal(g, e) for g, e in zip(grads, torch.autograd.grad(fn(a, b).sum(), (a, b)), strict=True))


# ---- errors that name the cause ----


class _Cache:
    """A KV cache as transformers' DynamicCache fills it: set up on the first call, appended to after."""

    def __init__(self) -> None:
        self.keys: torch.Tensor | None = None

    def update(self, k: torch.Tensor) -> torch.Tensor:
        if self.keys is None:
            self.keys = torch.tensor([])
        self.keys = torch.cat([self.keys, k.detach()])
        return self.keys


def test_a_kv_cache_updated_inside_the_checkpoint_is_named_with_the_fix():
    cache = _Cache()

    def layer(k):
        return (cache.update(k) * k.sum()).sum()

    out = sac2.checkpoint(layer, torch.randn(3, requires_grad=True), context_fn=contexts([]))
    with pytest.raises(RuntimeError, match=r"forward ran aten\.lift_fresh.*KV cache.*use_cache=False"):
        out.backward()


def test_saved_out_op_that_resizes_its_out_tensor_to_its_input_layout():
    # sin(out=empty) on a transposed input gives the output the transposed strides; matmul then copies rather
    # than views it, and recompute must see the same layout to run the same ops.
    def fn(a, w):
        t = (a + 0.5).transpose(0, 1)
        out = torch.empty(0, dtype=a.dtype)
        torch.sin(t.detach(), out=out)
        return (t * out).sum() + (out @ w).sum()

    _assert_same(fn, [torch.randn(2, 4, 4, requires_grad=True), torch.randn(4, 4, requires_grad=True)], _save_all)


def test_a_region_answered_cpu_offload_is_handed_to_the_offloader(monkeypatch):
    # On CUDA the offloader copies it to pinned host memory; on CPU it stays an ordinary save (no device here).
    from sac2.record.saved import Saved

    offloaded = []
    real = Saved.to_host

    def spy(entry):
        offloaded.append(entry.key)
        return real(entry)

    monkeypatch.setattr(Saved, "to_host", spy)
    body = sac2.region(lambda t: t.sin() * 2, name="never_silently_wrong.offload_spy")

    def policy(_ctx, op, *args, **kwargs):
        return sac2.CheckpointPolicy.MUST_CPU_OFFLOAD if isinstance(op, sac2.Region) else False

    sac2.checkpoint(lambda t: body(t).cos(), torch.randn(4, requires_grad=True), context_fn=contexts(policy))
    assert offloaded == [sac2.Region("never_silently_wrong.offload_spy")]


def test_a_policy_type_error_for_a_region_survives_code_that_swallows_it():
    # As for ops: the error is kept and raised when the checkpointed forward ends, even if something caught it.
    body = sac2.region(lambda t: t * 2, name="never_silently_wrong.swallowed")

    def fn(t):
        try:
            return body(t) * t
        except TypeError:
            return t * 3

    with pytest.raises(TypeError, match="policy cannot decide regions"):
        sac2.checkpoint(fn, torch.randn(3, requires_grad=True), context_fn=contexts(_refuses_regions))


def test_a_saved_matmul_modified_after_forward_through_its_unsafe_view_raises():
    # 3-D @ 2-D returns an _unsafe_view of the saved mm output: same storage, its own version counter.
    w = torch.randn(4, 4, dtype=torch.float64, requires_grad=True)

    def fn(a):
        y = a @ w
        return y, y.exp()

    y, e = sac2.checkpoint(fn, torch.randn(2, 3, 4, dtype=torch.float64, requires_grad=True),
                           context_fn=contexts([aten.mm.default]))
    with torch.no_grad():
        y.mul_(2)
    with pytest.raises(RuntimeError, match=r"aten\.mm\.default .* was modified in place after the checkpointed"):
        e.sum().backward()
