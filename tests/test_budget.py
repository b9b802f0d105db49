"""memory_budget: the policy keeps what the budget allows, recomputes least, and is an ordinary sac2 policy."""

import functools
import warnings
from typing import Any, Callable

import pytest
import torch
from torch import nn

import sac2
from sac2.measure.kept import activation_memory
from sac2.policies import llm_save_list
from sac2.policies.budget import memory_budget
from sac2.policies.profile import profile

from helpers import Block

aten = torch.ops.aten
SAVES = (sac2.CheckpointPolicy.MUST_SAVE, sac2.CheckpointPolicy.PREFER_SAVE)


def _model(p: float = 0.0) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(Block(p=p), Block(p=p))


def _input() -> torch.Tensor:
    torch.manual_seed(1)
    return torch.randn(2, 8, 32, requires_grad=True)


def _save_all(_ctx, _op, *args, **kwargs):
    return sac2.CheckpointPolicy.MUST_SAVE


def _none_and_output_bytes(fn, x) -> tuple[int, int]:
    """What autograd keeps for backward without checkpointing (inputs, parameters and outputs aside), and the bytes
    of the outputs (kept anyway by whoever runs ``fn``: free for a budget), measured with saved-tensor hooks."""
    outside = {t.untyped_storage().data_ptr() for t in (x, *fn.parameters())}
    saved: dict[int, int] = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(x)
    returned = out.untyped_storage().data_ptr()
    return (sum(n for k, n in saved.items() if k not in outside and k != returned),
            out.untyped_storage().nbytes())


def _grads(model, x, policy=None):
    torch.manual_seed(2)
    if policy is None:
        out = model(x)
    else:
        out = sac2.checkpoint(
            model, x, context_fn=lambda: sac2.create_selective_checkpoint_contexts(policy)
        )
    return torch.autograd.grad(out.square().sum(), [x, *model.parameters()])


def test_each_budget_keeps_at_most_its_share_of_what_no_checkpointing_keeps():
    model, x = _model(), _input()
    none, output = _none_and_output_bytes(model, x)
    for budget in (0.3, 0.5, 0.7):
        policy = memory_budget(model, (x,), budget, cost="flops")
        kept = activation_memory(model, (x,), policy)
        assert kept > output, f"budget {budget}: nothing is saved but the output"
        assert kept - output <= budget * none, f"budget {budget}"
        assert kept == policy.kept_bytes


def test_a_whole_budget_keeps_no_more_than_no_checkpointing():
    model, x = _model(), _input()
    none, output = _none_and_output_bytes(model, x)
    policy = memory_budget(model, (x,), 1.0, cost="flops")
    assert activation_memory(model, (x,), policy) - output <= none
    assert none < activation_memory(model, (x,), _save_all) - output  # saving every op keeps more


def test_an_int_one_is_the_whole_budget_not_one_byte():
    model, x = _model(), _input()
    whole = memory_budget(model, (x,), 1.0, cost="flops")
    assert memory_budget(model, (x,), 1, cost="flops").saved == whole.saved


def test_recomputes_no_more_than_a_save_list_at_equal_memory():
    model, x = _model(), _input()
    _, output = _none_and_output_bytes(model, x)
    for preset in (llm_save_list(), [aten.mm.default]):
        preset_profile = profile(model, (x,), cost="flops", policy=preset)
        saved = [i for i, c in enumerate(preset_profile.calls) if sac2.core.decisions.is_save(c.decision)]
        preset_bytes = preset_profile.kept_bytes(saved)
        policy = memory_budget(model, (x,), preset_bytes, cost="flops")
        assert policy.kept_bytes - output <= preset_bytes
        assert policy.recompute_cost <= preset_profile.recompute_cost(saved)


def test_gradients_are_bit_exact():
    model, x = _model(), _input()
    policy = memory_budget(model, (x,), 0.5, cost="flops")
    for got, want in zip(_grads(model, x, policy), _grads(model, x), strict=True):
        assert torch.equal(got, want)


def test_random_ops_replay_the_same_numbers():
    model, x = _model(p=0.5), _input()
    for budget in (0.0, 0.5, 1.0):
        policy = memory_budget(model, (x,), budget, cost="flops")
        for got, want in zip(_grads(model, x, policy), _grads(model, x), strict=True):
            assert torch.equal(got, want), f"budget {budget}"


def test_decisions_are_the_same_in_every_forward():
    model, x = _model(), _input()
    policy = memory_budget(model, (x,), 0.5, cost="flops")
    answers = []

    def spy(ctx, op, *args, **kwargs):
        answers.append(policy(ctx, op, *args, **kwargs))
        return answers[-1]

    _grads(model, x, spy)
    first = list(answers)
    answers.clear()
    _grads(model, x, spy)
    assert answers == first
    assert len(first) == len(policy.profile.calls)


def test_views_are_never_saved():
    model, x = _model(), _input()
    policy = memory_budget(model, (x,), 1.0, cost="flops")
    answers = []

    def spy(ctx, op, *args, **kwargs):
        answers.append((op, policy(ctx, op, *args, **kwargs)))
        return answers[-1][1]

    _grads(model, x, spy)
    saved = {str(op) for op, answer in answers if answer in SAVES}
    views = {str(op): answer for op, answer in answers if getattr(op, "is_view", False)}
    assert "aten.mm.default" in saved  # a full budget saves what it can
    assert "aten.view.default" in views
    assert {op: a for op, a in views.items() if a in SAVES} == {}


def test_a_budget_in_bytes_caps_the_kept_bytes():
    model, x = _model(), _input()
    _, output = _none_and_output_bytes(model, x)
    kept = activation_memory(model, (x,), memory_budget(model, (x,), 10_000, cost="flops")) - output
    assert kept > 0
    assert kept <= 10_000
    smaller = activation_memory(model, (x,), memory_budget(model, (x,), 2_500, cost="flops")) - output
    assert smaller > 0
    assert smaller < kept  # the cap, not something else, limits what is kept
    assert smaller <= 2_500


def test_measured_cost_is_in_seconds():
    model, x = _model(), _input()
    policy = memory_budget(model, (x,), 0.5)
    assert policy.profile.cost_unit == "s"
    assert policy.capacity <= 0.5 * policy.profile.none_bytes


def test_a_call_the_profile_did_not_see_is_recomputed_and_named_once():
    model, x = _model(), _input()
    policy = memory_budget(model[0], (x,), 0.5, cost="flops")  # profiled on one block, run on two
    with pytest.warns(UserWarning, match=r"runs aten\.\S+ \(call \d+ of that op\).*it is recomputed"):
        got = _grads(model, x, policy)
    assert all(torch.equal(g, w) for g, w in zip(got, _grads(model, x), strict=True))
    assert activation_memory(model, (x,), policy) <= policy.kept_bytes


def test_fraction_out_of_range_is_an_error():
    model, x = _model(), _input()
    with pytest.raises(ValueError, match="must be in \\[0, 1\\], got 1.5; pass an int for bytes"):
        memory_budget(model, (x,), 1.5, cost="flops")


@pytest.fixture
def bench_block() -> tuple[nn.Module, torch.Tensor]:
    """The acceptance case: one block of the bench's ``small`` config (d=512, seq 256, batch 2), and its input."""
    from sac2.bench.models import CONFIGS, Transformer

    cfg = CONFIGS["small"]
    torch.manual_seed(0)
    return Transformer(cfg).blocks[0], torch.randn(cfg.batch, cfg.seq_len, cfg.dim, requires_grad=True)


def test_budgets_keep_within_their_share_and_recompute_no_more_than_the_llm_preset(bench_block):
    block, x = bench_block[0], (bench_block[1],)
    none, output = _none_and_output_bytes(block, bench_block[1])
    preset = profile(block, x, cost="flops", policy=sac2.policies.llm())
    saved = [i for i, c in enumerate(preset.calls) if sac2.core.decisions.is_save(c.decision)]
    preset_bytes, preset_cost = preset.kept_bytes(saved), preset.recompute_cost(saved)
    for budget in (0.3, 0.5, 0.7):
        policy = memory_budget(block, x, budget, cost="flops")
        kept = activation_memory(block, x, policy) - output
        assert kept > 0, f"budget {budget}: nothing is saved"
        assert kept <= budget * none, f"budget {budget}"
        if kept <= preset_bytes:
            continue
        # at least the preset's memory: the knapsack must not recompute more than the preset does
        assert policy.recompute_cost <= preset_cost, f"budget {budget}"
    at_preset = memory_budget(block, x, preset_bytes, cost="flops")
    assert at_preset.kept_bytes - output <= preset_bytes
    assert at_preset.recompute_cost <= preset_cost


def _answers_per_forward(policy: Any, run: Callable[[Callable], None]) -> list[list[tuple[str, str]]]:
    """What ``policy`` answered in each forward ``run`` makes (a compiled region is traced more than once), as
    (op, answer) for the calls it saves."""
    forwards: list[tuple[Any, list[tuple[str, str]]]] = []  # (ctx, answers): the ctx held, so its id stays its own

    def spy(ctx, op, *args, **kwargs):
        answer = policy(ctx, op, *args, **kwargs)
        if not forwards or forwards[-1][0] is not ctx:
            forwards.append((ctx, []))
        if answer in SAVES:
            forwards[-1][1].append((str(op), answer.name))
        return answer

    run(functools.partial(sac2.create_selective_checkpoint_contexts, spy))
    return [answers for _, answers in forwards]


def _compiled(mode: str, fn: Callable) -> Callable:
    torch._dynamo.reset()
    if mode == "inductor":
        return torch.compile(fn)
    if mode == "dynamic":
        return torch.compile(fn, backend="aot_eager", dynamic=True)
    return torch.compile(fn, backend="aot_eager", fullgraph=mode == "fullgraph")


@pytest.mark.parametrize("mode", ["aot_eager", "inductor", "fullgraph", "dynamic", "mark_dynamic"])
def test_a_budget_profiled_in_eager_decides_the_same_under_compile(mode):
    torch.manual_seed(0)
    block, x = Block(), _input()
    budget = memory_budget(block, (x,), 0.5, cost="flops")

    def run(compiled: bool) -> Callable[[Callable], None]:
        def go(context_fn: Callable) -> None:
            fn = functools.partial(sac2.checkpoint, block, context_fn=context_fn)
            t = x.detach().clone().requires_grad_()
            if compiled and mode == "mark_dynamic":
                torch._dynamo.mark_dynamic(t, 1)
            (_compiled(mode, fn) if compiled else fn)(t).sum().backward()

        return go

    (eager,) = _answers_per_forward(budget, run(False))
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*did not run")  # no call the profile did not see
        traced = _answers_per_forward(budget, run(True))
    assert traced and all(forward == eager for forward in traced)


class _Experts(nn.Module):
    """Top-1 routing over four expert MLPs; an expert that gets no token is skipped, as MoE layers do."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.router = nn.Linear(16, 4, bias=False)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16)) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = self.router(x).softmax(-1)
        choice = probs.argmax(-1)
        out = torch.zeros_like(x)
        for i, expert in enumerate(self.experts):
            rows = (choice == i).nonzero().squeeze(-1)
            if rows.numel():
                out = out.index_add(0, rows, expert(x[rows]) * probs[rows, i : i + 1])
        return out


def _tokens(seed: int) -> torch.Tensor:
    return torch.randn(12, 16, generator=torch.Generator().manual_seed(seed), requires_grad=True)


def test_a_budget_profiled_on_one_routing_keeps_no_more_on_another_and_explain_shows_both():
    model = _Experts()
    used = [len(set(model.router(_tokens(s)).argmax(-1).tolist())) for s in range(40)]
    few, many = _tokens(used.index(min(used))), _tokens(used.index(4))  # some experts idle / every expert busy
    budget = memory_budget(model, (few,), 0.6, cost="flops")
    with pytest.warns(UserWarning, match="which the profiled forward did not run"):
        got = _grads(model, many, budget)
    assert all(torch.equal(g, w) for g, w in zip(got, _grads(model, many), strict=True))
    report = sac2.explain(model, many, budget, cost="flops")  # the report says it, not a warning
    assert report.predicted_bytes == budget.kept_bytes
    assert report.kept_bytes == activation_memory(model, many, budget) <= budget.kept_bytes
    assert f"this forward keeps {report.kept_bytes} B; the budget predicted {budget.kept_bytes} B" in str(report)
