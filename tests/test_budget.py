"""memory_budget: the policy keeps what the budget allows, recomputes least, and is an ordinary sac2 policy."""

import torch
from expecttest import TestCase
from torch import nn

import sac2
from sac2.policies import llm_save_list
from sac2.policies.budget import memory_budget
from sac2.profile import activation_memory, profile

from helpers import Block

aten = torch.ops.aten
SAVES = (sac2.CheckpointPolicy.MUST_SAVE, sac2.CheckpointPolicy.PREFER_SAVE)


def _model(p: float = 0.0) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(Block(p=p), Block(p=p))


def _input() -> torch.Tensor:
    torch.manual_seed(1)
    return torch.randn(2, 8, 32, requires_grad=True)


def _save_all(ctx, op, *args, **kwargs):
    return sac2.CheckpointPolicy.MUST_SAVE


def _grads(model, x, policy=None):
    torch.manual_seed(2)
    if policy is None:
        out = model(x)
    else:
        out = sac2.checkpoint(
            model, x, context_fn=lambda: sac2.create_selective_checkpoint_contexts(policy)
        )
    return torch.autograd.grad(out.square().sum(), [x, *model.parameters()])


class TestMemoryBudget(TestCase):
    def test_measured_activation_memory_is_within_each_budget(self):
        model, x = _model(), _input()
        everything = activation_memory(model, (x,), _save_all)
        for budget in (0.3, 0.5, 0.7):
            policy = memory_budget(model, (x,), budget, cost="flops")
            kept = activation_memory(model, (x,), policy)
            self.assertGreater(kept, 0, f"budget {budget}: nothing is saved")
            self.assertLessEqual(kept, 1.02 * budget * everything, f"budget {budget}")
            self.assertEqual(kept, policy.kept_bytes)

    def test_recomputes_no_more_than_a_save_list_at_equal_memory(self):
        model, x = _model(), _input()
        for preset in (llm_save_list(), [aten.mm.default]):
            preset_profile = profile(model, (x,), cost="flops", policy=preset)
            saved = [i for i, c in enumerate(preset_profile.calls) if sac2.answers.is_save(c.decision)]
            preset_bytes = preset_profile.kept_bytes(saved)
            policy = memory_budget(model, (x,), preset_bytes, cost="flops")
            self.assertLessEqual(policy.kept_bytes, preset_bytes)
            self.assertLessEqual(policy.recompute_cost, preset_profile.recompute_cost(saved))

    def test_gradients_are_bit_exact(self):
        model, x = _model(), _input()
        policy = memory_budget(model, (x,), 0.5, cost="flops")
        for got, want in zip(_grads(model, x, policy), _grads(model, x)):
            self.assertTrue(torch.equal(got, want))

    def test_random_ops_replay_the_same_numbers(self):
        model, x = _model(p=0.5), _input()
        for budget in (0.0, 0.5, 1.0):
            policy = memory_budget(model, (x,), budget, cost="flops")
            for got, want in zip(_grads(model, x, policy), _grads(model, x)):
                self.assertTrue(torch.equal(got, want), f"budget {budget}")

    def test_decisions_are_the_same_in_every_forward(self):
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
        self.assertEqual(answers, first)
        self.assertEqual(len(first), len(policy.profile.calls))

    def test_views_are_never_saved(self):
        model, x = _model(), _input()
        policy = memory_budget(model, (x,), 1.0, cost="flops")
        answers = []

        def spy(ctx, op, *args, **kwargs):
            answers.append((op, policy(ctx, op, *args, **kwargs)))
            return answers[-1][1]

        _grads(model, x, spy)
        saved = {str(op) for op, answer in answers if answer in SAVES}
        views = {str(op): answer for op, answer in answers if getattr(op, "is_view", False)}
        self.assertIn("aten.mm.default", saved)  # a full budget saves what it can
        self.assertIn("aten.view.default", views)
        self.assertEqual({op: a for op, a in views.items() if a in SAVES}, {})

    def test_a_budget_in_bytes_caps_the_kept_bytes(self):
        model, x = _model(), _input()
        kept = activation_memory(model, (x,), memory_budget(model, (x,), 10_000, cost="flops"))
        self.assertGreater(kept, 0)
        self.assertLessEqual(kept, 10_000)
        smaller = activation_memory(model, (x,), memory_budget(model, (x,), 2_500, cost="flops"))
        self.assertGreater(smaller, 0)
        self.assertLess(smaller, kept)  # the cap, not something else, limits what is kept
        self.assertLessEqual(smaller, 2_500)

    def test_measured_cost_is_in_seconds(self):
        model, x = _model(), _input()
        policy = memory_budget(model, (x,), 0.5)
        self.assertEqual(policy.profile.cost_unit, "s")
        self.assertGreater(policy.kept_bytes, 0)
        self.assertLessEqual(policy.kept_bytes, 0.5 * policy.profile.total_bytes)

    def test_a_different_forward_is_an_error_naming_the_op(self):
        model, x = _model(), _input()
        policy = memory_budget(model[0], (x,), 0.5, cost="flops")
        with self.assertRaisesRegex(RuntimeError, r"runs aten\.\S+ \(call \d+ of that op\).*build one per"):
            _grads(model, x, policy)

    def test_fraction_out_of_range_is_an_error(self):
        model, x = _model(), _input()
        with self.assertRaisesRegex(ValueError, "must be in \\[0, 1\\], got 1.5; pass an int for bytes"):
            memory_budget(model, (x,), 1.5, cost="flops")


class TestOnTheBenchModel(TestCase):
    """The acceptance case: one block of the bench's ``small`` config (d=512, seq 256, batch 2)."""

    def setUp(self):
        from sac2.bench.models import CONFIGS, Transformer

        cfg = CONFIGS["small"]
        torch.manual_seed(0)
        self.block = Transformer(cfg).blocks[0]
        self.x = torch.randn(cfg.batch, cfg.seq_len, cfg.dim, requires_grad=True)

    def test_budgets_keep_within_their_share_and_recompute_no_more_than_the_llm_preset(self):
        block, x = self.block, (self.x,)
        everything = activation_memory(block, x, _save_all)
        preset = profile(block, x, cost="flops", policy=sac2.policies.llm())
        saved = [i for i, c in enumerate(preset.calls) if sac2.answers.is_save(c.decision)]
        preset_bytes, preset_cost = preset.kept_bytes(saved), preset.recompute_cost(saved)
        for budget in (0.3, 0.5, 0.7):
            policy = memory_budget(block, x, budget, cost="flops")
            kept = activation_memory(block, x, policy)
            self.assertGreater(kept, 0, f"budget {budget}: nothing is saved")
            self.assertLessEqual(kept, 1.02 * budget * everything, f"budget {budget}")
            if policy.kept_bytes <= preset_bytes:
                continue
            # at least the preset's memory: the knapsack must not recompute more than the preset does
            self.assertLessEqual(policy.recompute_cost, preset_cost, f"budget {budget}")
        at_preset = memory_budget(block, x, preset_bytes, cost="flops")
        self.assertLessEqual(at_preset.kept_bytes, preset_bytes)
        self.assertLessEqual(at_preset.recompute_cost, preset_cost)
