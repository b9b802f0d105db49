"""Saving MoE experts as one-line regions keeps what saving their matmuls op by op keeps.

``apply_ac(model, "regions", save=["experts"])`` makes each matmul call inside an experts module a call of one
region (``sac2.regions.matmuls``): saved, each keeps its output, and the cheap ops between them (the tokens each
expert gathers, the activation) run again in recompute, as they do when the matmuls are saved op by op. A whole
experts body as one saved region kept all of them.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import sac2
from sac2.measure.memory import measure_step
from sac2.regions.in_models import make_regions

from helpers import STYLES, OpRuns, backward_in_style, bitwise_equal

aten = torch.ops.aten
TOKENS, DIM, HIDDEN, EXPERTS, TOP = 256, 32, 64, 4, 2


class ToyExperts(nn.Module):
    """transformers' eager experts: 3-D expert weights, a loop over the experts, tokens gathered per expert."""

    def __init__(self) -> None:
        super().__init__()
        self.gate_up = nn.Parameter(torch.randn(EXPERTS, 2 * HIDDEN, DIM) * DIM ** -0.5)
        self.down = nn.Parameter(torch.randn(EXPERTS, DIM, HIDDEN) * HIDDEN ** -0.5)

    def forward(self, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for e in range(EXPERTS):
            token, slot = torch.where(index == e)
            gate, up = F.linear(x[token], self.gate_up[e]).chunk(2, dim=-1)
            h = F.linear(F.silu(gate) * up, self.down[e]) * weights[token, slot, None]
            out = out.index_add(0, token, h)
        return out


class MoEBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(DIM, EXPERTS, bias=False)
        self.experts = ToyExperts()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.sin()
        weights, index = self.router(h).softmax(-1).topk(TOP, dim=-1)
        return x + self.experts(h, index, weights)


class MoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([MoEBlock(), MoEBlock()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x.square().mean()


def _x() -> torch.Tensor:
    return torch.randn(TOKENS, DIM, generator=torch.Generator().manual_seed(1), requires_grad=True)


def _kept_and_grads(model: nn.Module) -> tuple[int, list[torch.Tensor]]:
    x = _x()
    memory, _ = measure_step(lambda: model(x), "cpu")
    return memory.kept, [x.grad, *(p.grad for p in model.parameters())]


def test_saved_experts_keep_what_saving_their_matmuls_op_by_op_keeps():
    by_ops = MoE()
    sac2.apply_ac(by_ops, "selective", policy=[aten.mm.default], blocks=by_ops.blocks)
    ops_kept, _ = _kept_and_grads(by_ops)
    regions = MoE()
    sac2.apply_ac(regions, "regions", save=["experts", "linear"], blocks=regions.blocks)  # mm: experts and router
    kept, _ = _kept_and_grads(regions)
    assert kept <= ops_kept + 1024
    # What a whole experts body saved (the gathered tokens, the activation and its product): far more.
    assert kept < ops_kept + TOKENS * TOP * DIM * 4


@pytest.mark.parametrize("style", STYLES)
def test_saved_experts_train_bitwise_like_no_checkpointing(style):
    def run(model: nn.Module) -> list[torch.Tensor | None]:
        x = _x()
        return backward_in_style(style, model(x), [x, *model.parameters()], [x])

    model = MoE()
    sac2.apply_ac(model, "regions", save=["experts"], blocks=model.blocks)
    assert bitwise_equal(run(model), run(MoE()))


def test_saved_experts_matmuls_do_not_run_again_in_recompute():
    def backward_mms(save: list[str]) -> int:
        model = MoE()
        sac2.apply_ac(model, "regions", save=save, blocks=model.blocks)
        loss = model(_x())
        with OpRuns() as runs:
            loss.backward()
        return runs.counts[aten.mm.default]

    forward_mms = 2 * 2 * EXPERTS  # two blocks, two matmuls per expert (every expert gets tokens here)
    assert backward_mms(["experts", "linear"]) + forward_mms == backward_mms(["linear"])


def test_explain_reports_the_bytes_saved_experts_keep_as_the_allocator_measures_them():
    block = MoEBlock()
    make_regions(block, [("block", block)], ["experts"])
    x = _x()

    def kept(policy: list) -> int:
        context_fn = partial(sac2.create_selective_checkpoint_contexts, policy)
        step = lambda: sac2.checkpoint(block, x, use_reentrant=False, context_fn=context_fn).square().mean()  # noqa: E731
        return measure_step(step, "cpu")[0].kept

    (row,) = sac2.explain(block, (x,), [sac2.Region("experts")]).regions
    assert (row.region, row.calls) == ("experts", 2 * EXPERTS)  # each matmul call inside the experts is one
    assert row.kept_bytes == kept([sac2.Region("experts")]) - kept([])


def test_an_experts_module_named_by_its_class_is_one_region_its_body_not_run_in_recompute():
    def runs_and_kept(save: list) -> tuple[int, int]:
        model = MoE()
        sac2.apply_ac(model, "regions", save=save, blocks=model.blocks)
        runs = []
        for experts in (m for m in model.modules() if isinstance(m, ToyExperts)):
            experts.register_forward_pre_hook(lambda *_: runs.append(1))
        kept, _ = _kept_and_grads(model)
        return len(runs), kept

    (matmul_runs, matmul_kept), (whole_runs, whole_kept) = runs_and_kept(["experts"]), runs_and_kept([ToyExperts])
    assert (matmul_runs, whole_runs) == (2 * 2, 2)  # two blocks: forward and recompute, or forward only
    assert whole_kept > matmul_kept + TOKENS * TOP * DIM * 4  # it keeps its gathered tokens and activations


def test_making_the_experts_one_region_after_their_matmuls_leaves_one_kind():
    block = MoEBlock()
    make_regions(block, [("block", block)], ["experts"])
    make_regions(block, [("block", block)], [ToyExperts])
    runs = []
    block.experts.register_forward_pre_hook(lambda *_: runs.append(1))
    x = _x()
    context_fn = partial(sac2.create_selective_checkpoint_contexts, [sac2.Region("experts")])
    sac2.checkpoint(block, x, use_reentrant=False, context_fn=context_fn).square().mean().backward()
    assert (type(block.experts).__name__, len(runs)) == ("RegionToyExperts", 1)  # not run again in recompute


class OutExperts(nn.Module):
    """Experts that write a matmul's result into a buffer (``out=``, on tensors that need no grad) and read it."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(DIM, DIM) * DIM ** -0.5)
        self.mix: torch.Tensor
        self.register_buffer("mix", torch.randn(DIM, DIM) * DIM ** -0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = torch.full((x.shape[0], DIM), float("nan"))  # NaN until the matmul writes it: a missed write shows
        torch.mm(x.detach(), self.mix, out=scale)
        return F.linear(x, self.w) * scale.sigmoid()


class OutBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.experts = OutExperts()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.experts(x.sin())


def test_a_saved_experts_matmul_into_a_buffer_writes_it_again_in_recompute():
    def grads(apply: bool) -> list[torch.Tensor | None]:
        torch.manual_seed(0)
        blocks = nn.ModuleList([OutBlock(), OutBlock()])
        if apply:
            sac2.apply_ac(blocks, "regions", save=["experts"], blocks=blocks)
        x = _x()
        h = x
        for block in blocks:
            h = block(h)
        h.square().mean().backward()
        return [x.grad, *(p.grad for p in blocks.parameters())]

    assert bitwise_equal(grads(True), grads(False))
