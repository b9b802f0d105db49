"""sac2.explain: a per-op report of what a policy keeps and recomputes, as a table, as JSON and as a plot."""

import functools
import os
import tempfile

import torch
from expecttest import assert_expected_inline
from torch import nn

import sac2
from sac2.advisor.report import Report, explain, plot_budgets
from sac2.core.decisions import SaveList
from sac2.measure.memory import measure_step
from sac2.offload.standin import stand_in
from sac2.policies.budget import memory_budget

aten = torch.ops.aten


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16), nn.Tanh())


def _input() -> torch.Tensor:
    return torch.ones(4, 16, requires_grad=True)


def save_addmm(_ctx, op, *args, **kwargs):
    return op is aten.addmm.default


def test_table_for_a_save_list():
    report = explain(_mlp(), (_input(),), [aten.addmm.default], cost="flops")
    assert_expected_inline(str(report), """\
op                  calls  saved B  freed B  recompute (flop)  decision   rule
------------------  -----  -------  -------  ----------------  ---------  -------------------------
aten.t.default      2      0        0        0                 recompute  view: re-run, never saved
aten.addmm.default  2      768      0        0                 save       save list
aten.relu.default   1      0        512      128               recompute  save list
aten.tanh.default   1      0        256      64                recompute  save list
total               6      768      768      192""")


def test_table_for_a_memory_budget_names_the_solver():
    model, x = _mlp(), _input()
    report = explain(model, (x,), memory_budget(model, (x,), 0.5, cost="flops"), cost="flops")
    assert_expected_inline(str(report), """\
op                  calls  saved B  freed B  recompute (flop)  decision     rule
------------------  -----  -------  -------  ----------------  -----------  ---------------------------
aten.t.default      2      0        0        0                 recompute    view: re-run, never saved
aten.addmm.default  2      256      512      4096              save 1 of 2  memory_budget(256 B, exact)
aten.relu.default   1      0        512      128               recompute    memory_budget(256 B, exact)
aten.tanh.default   1      256      0        0                 save         memory_budget(256 B, exact)
total               6      512      1024     4224""")


def test_rule_names_a_function_policy_by_its_qualified_name():
    report = explain(_mlp(), (_input(),), save_addmm, cost="flops")
    assert_expected_inline(str(report), """\
op                  calls  saved B  freed B  recompute (flop)  decision   rule
------------------  -----  -------  -------  ----------------  ---------  -------------------------
aten.t.default      2      0        0        0                 recompute  view: re-run, never saved
aten.addmm.default  2      768      0        0                 save       test_explain.save_addmm
aten.relu.default   1      0        512      128               recompute  test_explain.save_addmm
aten.tanh.default   1      0        256      64                recompute  test_explain.save_addmm
total               6      768      768      192""")


def test_json_round_trips():
    report = explain(_mlp(), (_input(),), [aten.addmm.default], cost="flops")
    assert Report.from_json(report.to_json()) == report


def test_curve_spans_budgets_with_memory_rising_and_cost_falling():
    report = explain(_mlp(), (_input(),), [aten.addmm.default], cost="flops")
    budgets, kept, cost = zip(*report.curve, strict=True)
    assert budgets[0] == 0.0
    assert budgets[-1] == 1.0
    assert list(kept) == sorted(kept)
    assert list(cost) == sorted(cost, reverse=True)
    assert report.none_bytes == 4 * 32 * 4  # autograd keeps relu's output (the 2nd Linear's input)
    assert kept[-1] <= report.none_bytes + 4 * 16 * 4  # 1: no more than that (the output aside)


def test_plot_writes_a_png():
    report = explain(_mlp(), (_input(),), [aten.addmm.default], cost="flops")
    with tempfile.TemporaryDirectory() as d:
        report.plot(os.path.join(d, "r.png"))
        curve = plot_budgets(_mlp(), (_input(),), os.path.join(d, "b.png"), cost="flops")
        for name in ("r.png", "b.png"):
            with open(os.path.join(d, name), "rb") as f:
                assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert curve == report.curve


def _sin_t_cos(x: torch.Tensor) -> torch.Tensor:
    a = x.sin()
    a.t_()
    return a.cos()


def save_all(_ctx, _op, *args, **kwargs):
    return True


def test_an_in_place_view_op_is_re_run_and_the_outputs_around_it_are_saved():
    report = explain(_sin_t_cos, (torch.ones(2, 4, requires_grad=True),), save_all, cost="flops")
    assert_expected_inline(str(report), """\
op                calls  saved B  freed B  recompute (flop)  decision   rule
----------------  -----  -------  -------  ----------------  ---------  -------------------------
aten.sin.default  1      32       0        0                 save       test_explain.save_all
aten.t_.default   1      0        0        0                 recompute  view: re-run, never saved
aten.cos.default  1      32       0        0                 save       test_explain.save_all
total             3      64       0        0""")


def test_one_tensor_is_one_argument():
    x = torch.ones(2, 4, requires_grad=True)
    assert explain(_sin_t_cos, x, save_all, cost="flops") == explain(_sin_t_cos, (x,), save_all, cost="flops")


#: Saves relu's output on the device and offloads both Linears' outputs.
OFFLOAD_ADDMM = SaveList([aten.relu.default], offload=[aten.addmm.default])


def test_offloaded_calls_are_counted_in_host_memory_apart_from_what_the_device_keeps():
    with stand_in():  # a device offload moves tensors off
        report = explain(_mlp(), (_input(),), OFFLOAD_ADDMM, cost="flops")
    assert_expected_inline(str(report), """\
op                  calls  saved B  host B  freed B  recompute (flop)  decision   rule
------------------  -----  -------  ------  -------  ----------------  ---------  -------------------------
aten.t.default      2      0        0       0        0                 recompute  view: re-run, never saved
aten.addmm.default  2      0        768     0        0                 offload    save list
aten.relu.default   1      512      0       0        0                 save       save list
aten.tanh.default   1      0        0       256      64                recompute  save list
total               6      512      768     256      64""")


def test_host_bytes_are_what_offload_moves_once_the_next_block_starts():
    first, second, x = _mlp(), _mlp(), _input()
    context_fn = functools.partial(sac2.create_selective_checkpoint_contexts, OFFLOAD_ADDMM)

    def two_blocks():  # the first block goes to the host when the second starts; the last keeps its own
        return sac2.checkpoint(second, sac2.checkpoint(first, x, context_fn=context_fn), context_fn=context_fn)

    with stand_in():
        report = explain(first, (x,), OFFLOAD_ADDMM, cost="flops")
        memory, _ = measure_step(lambda: two_blocks().sum(), "cpu")
    assert memory.host == report.host_bytes


def test_without_an_accelerator_an_offload_answer_keeps_the_bytes_on_the_device_and_it_says_so():
    report = explain(_mlp(), (_input(),), OFFLOAD_ADDMM, cost="flops")
    assert_expected_inline(str(report), """\
op                  calls  saved B  host B  freed B  recompute (flop)  decision   rule
------------------  -----  -------  ------  -------  ----------------  ---------  -------------------------
aten.t.default      2      0        0       0        0                 recompute  view: re-run, never saved
aten.addmm.default  2      768      0       0        0                 offload    save list
aten.relu.default   1      512      0       0        0                 save       save list
aten.tanh.default   1      0        0       256      64                recompute  save list
total               6      1280     0       256      64
offloaded but kept on the device: 768 B (offload moves tensors off a CUDA device to host memory; these are not on one, so the offload answer saves them)""")  # noqa: E501


def test_json_round_trips_host_bytes():
    with stand_in():
        report = explain(_mlp(), (_input(),), OFFLOAD_ADDMM, cost="flops")
    back = Report.from_json(report.to_json())
    assert (back, back.host_bytes) == (report, 768)
