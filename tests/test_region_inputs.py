"""A saved region keeps its outputs and the backward state its body makes, never a tensor recompute rebuilds anyway.

A tensor a saved region's body saves that is (a view of) one of the region's own inputs is kept by the checkpoint
as a position and rebuilt from the replayed input in recompute (``sac2.record.region_saves``), so saving a call as a
region keeps what saving the same ops op by op keeps; ``keep_inputs`` keeps them for real instead.
"""

from __future__ import annotations

import contextlib
import copy
from functools import partial

import pytest
import torch
from torch import nn

import sac2
from sac2.bench.models import CONFIGS, Transformer, random_tokens
from sac2.measure.memory import measure_step
from sac2.record import region_saves

from helpers import STYLES, backward_in_style, bitwise_equal

aten = torch.ops.aten
CFG = CONFIGS["tiny"]
MATMULS = [aten.mm.default, aten.addmm.default]
SDPA = [aten._scaled_dot_product_flash_attention_for_cpu.default]
OPS = {"linear": MATMULS, "attention": SDPA}


def _transformer() -> Transformer:
    torch.manual_seed(0)
    return Transformer(CFG)


def _kept_and_grads(model: nn.Module, forward) -> tuple[int, list[torch.Tensor]]:
    memory, _ = measure_step(lambda: forward(model), "cpu")
    return memory.kept, [p.grad for p in model.parameters()]


def _lm(model: nn.Module) -> torch.Tensor:
    return model(*random_tokens(CFG, torch.Generator().manual_seed(0), torch.device("cpu")))


@pytest.mark.parametrize("save", [["linear"], ["attention"], ["linear", "attention"]],
                         ids=["linears", "attention", "both"])
def test_saved_regions_keep_what_saving_their_ops_keeps_and_train_bitwise(save):
    _, reference = _kept_and_grads(_transformer(), _lm)
    by_ops = _transformer()
    sac2.apply_ac(by_ops, "selective", policy=[op for s in save for op in OPS[s]], blocks=by_ops.blocks)
    ops_kept, _ = _kept_and_grads(by_ops, _lm)
    regions = _transformer()
    sac2.apply_ac(regions, "regions", save=save, blocks=regions.blocks)
    kept, grads = _kept_and_grads(regions, _lm)
    assert kept <= ops_kept + 1024
    assert bitwise_equal(grads, reference)


def test_keep_inputs_keeps_the_inputs_for_real_and_still_trains_bitwise():
    _, reference = _kept_and_grads(_transformer(), _lm)
    rebuilt, keeping = _transformer(), _transformer()
    sac2.apply_ac(rebuilt, "regions", save=["linear"], blocks=rebuilt.blocks)
    rebuilt_kept, _ = _kept_and_grads(rebuilt, _lm)
    sac2.apply_ac(keeping, "regions", save=["linear"], blocks=keeping.blocks, keep_inputs=True)
    keeping_kept, grads = _kept_and_grads(keeping, _lm)
    # Each block's four Linear inputs: the normed input (twice), attention's output, the MLP's hidden state.
    assert keeping_kept - rebuilt_kept >= CFG.n_layers * 2 * 32 * CFG.dim * 4
    assert bitwise_equal(grads, reference)


def test_keep_inputs_survives_copying_the_model():
    keeping = _transformer()
    sac2.apply_ac(keeping, "regions", save=["linear"], blocks=keeping.blocks, keep_inputs=True)
    kept, _ = _kept_and_grads(keeping, _lm)
    copied, _ = _kept_and_grads(copy.deepcopy(keeping), _lm)  # pickles its policy, as torch.save would
    assert copied == kept


def test_keep_inputs_holds_for_the_model_it_was_given_whatever_other_models_ask():
    # Two models with the same region names (a policy and a reference model, say): each keeps its own setting.
    keeping = _transformer()
    sac2.apply_ac(keeping, "regions", save=["linear"], blocks=keeping.blocks, keep_inputs=True)
    kept_alone, _ = _kept_and_grads(keeping, _lm)
    other = _transformer()
    sac2.apply_ac(other, "regions", save=["linear"], blocks=other.blocks)
    other_kept, _ = _kept_and_grads(other, _lm)
    kept_after, _ = _kept_and_grads(keeping, _lm)
    assert kept_after == kept_alone
    assert other_kept < kept_alone


class _Net(nn.Module):
    """sin -> Linear region (on ``view(x)``) -> cos, checkpointed, saving the region only."""

    def __init__(self, view=lambda h: h, twice: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 16)
        self.view, self.twice = view, twice

    def body(self, x: torch.Tensor) -> torch.Tensor:
        h = self.view(x.sin())
        h = sac2.region(self.a, name="ri_a")(h)
        if self.twice:  # a region whose input another saved region made
            h = sac2.region(self.b, name="ri_b")(h)
        return h.cos()

    def forward(self, x: torch.Tensor, checkpointed: bool = True, **options) -> torch.Tensor:
        if not checkpointed:
            return self.body(x)
        context_fn = partial(sac2.create_selective_checkpoint_contexts, [sac2.Region("ri_a"), sac2.Region("ri_b")])
        return sac2.checkpoint(self.body, x, use_reentrant=False, context_fn=context_fn, **options)


def _backward(style: str, net: _Net, x: torch.Tensor, **options) -> list[torch.Tensor | None]:
    out = net(x, **options).sum() if options.pop("checkpointed", True) else net(x, checkpointed=False).sum()
    return backward_in_style(style, out, [x, *net.parameters()], [x, net.a.weight])


VIEWS = {"plain": lambda h: h, "slice": lambda h: h[:, 4:20], "transposed": lambda h: h.t().contiguous().t()}


@pytest.mark.parametrize("view", list(VIEWS), ids=list(VIEWS))
@pytest.mark.parametrize("twice", [False, True], ids=["one", "chained"])
@pytest.mark.parametrize("style", STYLES)
def test_a_region_rebuilding_its_input_gives_no_checkpointing_gradients(style, twice, view):
    x = torch.randn(8, 24, requires_grad=True) if view == "slice" else torch.randn(8, 16, requires_grad=True)
    reference = _backward(style, _Net(VIEWS[view], twice), x.detach().clone().requires_grad_(), checkpointed=False)
    got = _backward(style, _Net(VIEWS[view], twice), x.detach().clone().requires_grad_())
    assert bitwise_equal(got, reference)


#: Views of an input that hold the same memory but read it another way: a lazy conjugate, a lazy negation.
MATH_VIEWS = {"conj": (torch.complex64, torch.conj), "neg": (torch.float32, torch._neg_view)}


@pytest.mark.parametrize("kind", list(MATH_VIEWS))
def test_a_region_saving_a_conjugate_or_negated_view_of_its_input_gives_no_checkpointing_gradients(kind):
    dtype, view = MATH_VIEWS[kind]
    torch.manual_seed(0)
    w = torch.randn(4, 4, dtype=dtype, requires_grad=True)
    x = torch.randn(3, 4, dtype=dtype)

    def body(t):  # the matmul saves the lazy view of the region's input (same storage, same layout)
        return view(t) @ w

    def f(x):
        return sac2.region(body, name="math_view")(x * 2).abs().sum()

    def grads(checkpointed: bool) -> list[torch.Tensor | None]:
        xx = x.clone().requires_grad_()
        w.grad = None
        context_fn = partial(sac2.create_selective_checkpoint_contexts, [sac2.Region("math_view")])
        loss = sac2.checkpoint(f, xx, use_reentrant=False, context_fn=context_fn) if checkpointed else f(xx)
        loss.backward()
        return [xx.grad, w.grad]

    assert bitwise_equal(grads(True), grads(False))


@pytest.mark.parametrize("how", ["torch_frame", "no_early_stop"])
def test_rebuilt_inputs_stay_in_step_on_torch_frame_and_without_early_stop(how):
    x = torch.randn(8, 16)
    reference = _backward("retain_graph", _Net(twice=True), x.clone().requires_grad_(), checkpointed=False)
    if how == "torch_frame":
        with sac2.use_torch_frame():
            got = _backward("retain_graph", _Net(twice=True), x.clone().requires_grad_())
    else:
        got = _backward("retain_graph", _Net(twice=True), x.clone().requires_grad_(), early_stop=False)
    assert bitwise_equal(got, reference)


def test_a_saved_linear_region_keeps_no_copy_of_its_input():
    net = _Net()
    x = torch.randn(4096, 16, requires_grad=True)
    memory, _ = measure_step(lambda: net(x).sum(), "cpu")
    # The Linear's output (4096 x 16 floats), which cos saves too; not sin's output, the Linear's input.
    assert memory.kept < 2 * 4096 * 16 * 4


def _chain(after_a=lambda _a: None, **options):
    """x -> Linear region ri_a -> ``after_a(a)`` -> Linear region ri_b on a's output, checkpointed saving both."""
    net = _Net(twice=True)

    def body(x):
        a = sac2.region(net.a, name="ri_a")(x)
        after_a(a)
        return sac2.region(net.b, name="ri_b")(a)

    context_fn = partial(sac2.create_selective_checkpoint_contexts, [sac2.Region("ri_a"), sac2.Region("ri_b")])
    return net, lambda x: sac2.checkpoint(body, x, use_reentrant=False, context_fn=context_fn, **options)


def test_what_a_saved_region_returned_is_kept_with_it_for_the_next_region_not_rebuilt():
    # ri_b's body saves ri_a's output, which the record keeps anyway: a position to rebuild it would keep no byte
    # less, so recompute stops once ri_a (the last position) is back and never reaches the code between them.
    reached = []
    net, step = _chain(lambda _a: reached.append("between"))
    x = torch.randn(8, 16, requires_grad=True)
    step(x).sum().backward()
    assert reached == ["between"]  # the forward only
    reference = _Net(twice=True)
    reference.b(reference.a(x)).sum().backward()
    assert bitwise_equal([p.grad for p in net.parameters()], [p.grad for p in reference.parameters()])


class _Projections(nn.Module):
    """sin, then three Linear regions on its output (as attention's q/k/v projections): ``q * k``, then ``v``."""

    def __init__(self, between=lambda: None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.q, self.k, self.v = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 16)
        self.between = between

    def body(self, x: torch.Tensor) -> torch.Tensor:
        h = x.sin()
        qk = sac2.region(self.q, name="pr_q")(h) * sac2.region(self.k, name="pr_k")(h)
        self.between()
        return qk + sac2.region(self.v, name="pr_v")(h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        saves = [sac2.Region("pr_q"), sac2.Region("pr_k"), sac2.Region("pr_v")]
        context_fn = partial(sac2.create_selective_checkpoint_contexts, saves)
        return sac2.checkpoint(self.body, x, use_reentrant=False, context_fn=context_fn)


def test_regions_saving_one_input_share_its_position():
    # q's, k's and v's bodies save the same view of h: one position, which q's takes, so recompute stops at the
    # product (its saves are the last positions) and never reaches the code before v.
    reached = []
    net = _Projections(lambda: reached.append("between"))
    net(torch.randn(8, 16, requires_grad=True)).sum().backward()
    assert reached == ["between"]  # the forward only


@pytest.mark.parametrize("torch_frame", [False, True], ids=["sac2_frame", "torch_frame"])
@pytest.mark.parametrize("style", STYLES)
def test_regions_sharing_a_position_give_no_checkpointing_gradients(style, torch_frame):
    x = torch.randn(8, 16)
    reference, net = _Projections(), _Projections()
    want = backward_in_style(style, reference.body(x.clone().requires_grad_()).sum(), list(reference.parameters()),
                             [reference.q.weight])
    with sac2.use_torch_frame() if torch_frame else contextlib.nullcontext():
        got = backward_in_style(style, net(x.clone().requires_grad_()).sum(), list(net.parameters()), [net.q.weight])
    assert bitwise_equal(got, want)


def test_under_copying_hooks_a_saved_regions_output_is_not_kept_again_by_the_next_region():
    # The user's hooks take what the record keeps (respect_saved_tensors_hooks=True) and keep a copy: a later
    # region keeping the tensor itself would keep it a second time.
    _, rebuilding = _chain(respect_saved_tensors_hooks=True)
    _, keeping = _chain(respect_saved_tensors_hooks=True)
    x = torch.randn(4096, 16)
    with torch.autograd.graph.saved_tensors_hooks(torch.clone, lambda t: t):
        rebuilt = measure_step(lambda: rebuilding(x).sum(), "cpu")[0].kept
        try:
            region_saves.keep_inputs(["ri_b"], True)
            kept = measure_step(lambda: keeping(x).sum(), "cpu")[0].kept
        finally:
            region_saves.keep_inputs(["ri_b"], False)
    assert kept - rebuilt >= 4096 * 16 * 4


@pytest.mark.parametrize("keep", [False, True], ids=["rebuilt", "keep_inputs"])
@pytest.mark.parametrize("style", STYLES)
def test_an_input_written_in_place_after_the_region_is_autograds_error(style, keep, keeping_ri_a):
    keeping_ri_a(keep)

    def run(checkpointed: bool) -> None:
        net = _Net()
        x = torch.randn(8, 16, requires_grad=True)

        def body(x):
            h = x.sin()
            y = sac2.region(net.a, name="ri_a")(h)
            h.mul_(2)  # the Linear saved h for its backward
            return y.sum()

        context_fn = partial(sac2.create_selective_checkpoint_contexts, [sac2.Region("ri_a")])
        out = sac2.checkpoint(body, x, use_reentrant=False, context_fn=context_fn) if checkpointed else body(x)
        backward_in_style(style, out, [x, *net.parameters()], [x, net.a.weight])

    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        run(False)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        run(True)


@pytest.fixture
def keeping_ri_a():
    """Set ``keep_inputs`` of region ``ri_a`` for one test; rebuilt again afterwards."""
    try:
        yield lambda keep: region_saves.keep_inputs(["ri_a"], keep)
    finally:
        region_saves.keep_inputs(["ri_a"], False)


@pytest.mark.parametrize("keep", [False, True], ids=["rebuilt", "keep_inputs"])
def test_a_saved_regions_output_written_in_place_before_backward_is_autograds_error(keep, keeping_ri_a):
    # attention saves its own output for backward: a later write into it is autograd's error without checkpointing
    keeping_ri_a(keep)
    q = torch.randn(1, 2, 8, 4, requires_grad=True)

    def body(q):
        attention = sac2.region(torch.nn.functional.scaled_dot_product_attention, name="ri_a")
        out = attention(q, q, q)
        y = out.sum()
        out.mul_(2)
        return y

    context_fn = partial(sac2.create_selective_checkpoint_contexts, [sac2.Region("ri_a")])
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        body(q.detach().requires_grad_()).backward()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        sac2.checkpoint(body, q, use_reentrant=False, context_fn=context_fn).backward()


@pytest.fixture
def eager_flex(monkeypatch):
    """flex_attention's dense eager path, the one CPU can differentiate (as tests/test_hops.py)."""
    import torch.nn.attention.flex_attention as fa

    monkeypatch.setattr(fa, "_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG", True)
    monkeypatch.setattr(fa, "_validate_device", lambda *args, **kwargs: None)
    return fa.flex_attention


def _flex_case(flex):
    """sin -> flex_attention (as a region named "flex" or not) -> cos, on one [2, 4, 128, 16] input."""
    def body(x: torch.Tensor, region: bool) -> torch.Tensor:
        h = x.sin()
        return (sac2.region(flex, name="flex")(h, h, h) if region else flex(h, h, h)).cos()

    return body, torch.randn(2, 4, 128, 16, requires_grad=True), torch.ops.higher_order.flex_attention


def _linear_case(view: str, twice: bool):
    """``_Net``'s body: Linear regions (with bias: addmm) on ``VIEWS[view]`` of sin's output, one or chained."""
    net = _Net(VIEWS[view], twice)

    def body(x: torch.Tensor, region: bool) -> torch.Tensor:
        if region:
            return net.body(x)
        h = net.a(net.view(x.sin()))
        return (net.b(h) if twice else h).cos()

    x = torch.randn(256, 24 if view == "slice" else 16, requires_grad=True)
    return body, x, aten.addmm.default


CASES = {**{f"linear-{v}": (v, False) for v in VIEWS}, "linear-chained": ("plain", True), "flex": None}
REGIONS = [sac2.Region("ri_a"), sac2.Region("ri_b"), sac2.Region("flex")]


def _case(name: str, request):
    return _flex_case(request.getfixturevalue("eager_flex")) if CASES[name] is None else _linear_case(*CASES[name])


def _kept(body, x: torch.Tensor, region: bool, policy: list) -> int:
    context_fn = partial(sac2.create_selective_checkpoint_contexts, policy)
    step = lambda: sac2.checkpoint(body, x, region, use_reentrant=False, context_fn=context_fn).sum()  # noqa: E731
    return measure_step(step, "cpu")[0].kept


@pytest.mark.parametrize("name", list(CASES))
def test_a_saved_region_keeps_what_saving_its_op_keeps(name, request):
    body, x, op = _case(name, request)
    assert _kept(body, x, True, REGIONS) <= _kept(body, x, False, [op]) + 1024


@pytest.mark.parametrize("name", list(CASES))
def test_explain_reports_the_bytes_a_saved_region_keeps_as_the_allocator_measures_them(name, request):
    body, x, _ = _case(name, request)
    report = sac2.explain(lambda x: body(x, True), (x,), REGIONS)
    assert sum(r.kept_bytes for r in report.regions) == _kept(body, x, True, REGIONS) - _kept(body, x, True, [])


@pytest.mark.parametrize("name", [n for n in CASES if n != "linear-chained"])  # its second input: the first's output
def test_explain_reports_the_inputs_a_saved_region_rebuilds_as_keep_inputs_measures_them(name, request):
    body, x, _ = _case(name, request)
    report = sac2.explain(lambda x: body(x, True), (x,), REGIONS)
    names = [r.name for r in REGIONS]
    rebuilding = _kept(body, x, True, REGIONS)
    try:
        region_saves.keep_inputs(names, True)
        keeping = _kept(body, x, True, REGIONS)
    finally:
        region_saves.keep_inputs(names, False)
    assert sum(r.rebuilt_bytes for r in report.regions) == keeping - rebuilding > 0


def test_explain_reports_a_linear_region_keeping_its_outputs_only():
    net = _Net()
    x = torch.randn(64, 16)
    report = sac2.explain(net.body, (x,), [sac2.Region("ri_a")])
    (row,) = [r for r in report.regions if r.region == "ri_a"]
    assert row.kept_bytes == row.output_bytes == 64 * 16 * 4


def test_a_regions_only_policy_runs_no_extra_region_body_in_backward():
    net = _Net(twice=True)
    runs = []
    net.a.register_forward_hook(lambda *a: runs.append("a"))
    net(torch.randn(8, 16, requires_grad=True)).sum().backward()
    assert runs == ["a"]  # forward only: the saved region is served in recompute
