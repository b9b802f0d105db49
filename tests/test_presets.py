"""Each policy preset, run on a tiny block: which calls it saves, pinned as "op -> decision" lines."""

import functools
import warnings

import pytest
import torch
import torch.nn.functional as F
from expecttest import assert_expected_inline
from torch import nn

import sac2
from sac2 import policies
from sac2.core.decisions import ForwardContext, op_name


@torch.library.custom_op("sac2_test::flash_attn_fwd", mutates_args=())
def flash_attn_fwd(q: torch.Tensor) -> torch.Tensor:
    """Stands for a flash-attn kernel registered as a custom op (flash_attn::_flash_attn_forward)."""
    return q.clone()


class Attention(nn.Module):
    """A tiny attention + MLP block with an MoE-style router gate."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d, bias=False)
        self.gate = nn.Linear(d, 4, bias=False)
        self.up = nn.Linear(d, 2 * d)
        self.down = nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).unflatten(-1, (3, 2, -1)).transpose(1, 3).unbind(2)
        x = x + self.out(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2))
        weights, _ = torch.topk(self.gate(x).softmax(-1), 2)
        h = self.down(F.silu(self.up(x))) * weights.sum(-1, keepdim=True)
        return x + h / h.abs().max()


def _matmuls_and_saves(log: list[str]) -> str:
    """The lines of the log worth reading: every decision other than PREFER_RECOMPUTE (the no-opinion answer)."""
    return "\n".join(line for line in log if not line.endswith("PREFER_RECOMPUTE"))


def _run(policy, block: nn.Module, forwards: int = 1) -> list[str]:
    """Run ``block`` under ``policy`` with a recording wrapper; return "op -> decision" per call, per forward."""
    log = []

    def recording(ctx, op, *args, **kwargs):
        decision = policy(ctx, op, *args, **kwargs)
        log.append(f"{op_name(op)} -> {decision.name}")
        return decision

    wrapped = sac2.checkpoint_wrapper(
        block, context_fn=functools.partial(sac2.create_selective_checkpoint_contexts, recording)
    )
    x = torch.randn(2, 4, 8, generator=torch.Generator().manual_seed(0), requires_grad=True)
    for i in range(forwards):
        log.append(f"-- forward {i}")
        wrapped(x).sum().backward()
    return log


def _block() -> Attention:
    torch.manual_seed(0)
    return Attention()


def test_saves_matmuls_attention_topk_and_max():
    assert_expected_inline(_matmuls_and_saves(_run(policies.llm(), _block())), """\
-- forward 0
aten.addmm.default -> MUST_SAVE
aten._scaled_dot_product_flash_attention_for_cpu.default -> MUST_SAVE
aten.mm.default -> MUST_SAVE
aten.mm.default -> MUST_SAVE
aten.topk.default -> MUST_SAVE
aten.addmm.default -> MUST_SAVE
aten.addmm.default -> MUST_SAVE
aten.max.default -> MUST_SAVE""")


def test_recomputes_the_cheap_ops():
    log = _run(policies.llm(), _block())
    recomputed = sorted({line.split(" ")[0] for line in log if line.endswith("PREFER_RECOMPUTE")})
    assert_expected_inline("\n".join(recomputed), """\
aten._softmax.default
aten._unsafe_view.default
aten.abs.default
aten.add.Tensor
aten.div.Tensor
aten.mul.Tensor
aten.silu.default
aten.sum.dim_IntList
aten.t.default
aten.transpose.int
aten.unbind.int
aten.view.default""")


def test_saves_device_to_host_copies_and_nothing_else_of_to_copy():
    policy, ctx = policies.llm(), sac2.SelectiveCheckpointContext(is_recompute=False)
    to_copy = torch.ops.aten._to_copy.default
    on_device = torch.empty(2, device="meta")
    decisions = [
        policy(ctx, to_copy, on_device, device=torch.device("cpu")).name,
        policy(ctx, to_copy, on_device, dtype=torch.half).name,
        policy(ctx, to_copy, torch.empty(2), device="cpu").name,
    ]
    assert_expected_inline(str(decisions), """['MUST_SAVE', 'PREFER_RECOMPUTE', 'PREFER_RECOMPUTE']""")


def test_saves_named_regions():
    policy, ctx = policies.llm(), sac2.SelectiveCheckpointContext(is_recompute=False)
    assert policy(ctx, sac2.Region("attn")) is sac2.CheckpointPolicy.MUST_SAVE


def test_save_list_skips_ops_the_running_torch_lacks():
    from sac2.policies import presets

    real = presets._COMPUTE
    presets._COMPUTE = real + ("aten.no_such_op.default", "no_such_namespace.op.default")
    try:
        ops = policies.llm_save_list()
    finally:
        presets._COMPUTE = real
    assert ops == policies.llm_save_list()


def test_saves_flash_attn_custom_kernels_by_name():
    policy, ctx = policies.llm(), ForwardContext()
    q = torch.randn(2, 4)
    ops = (torch.ops.sac2_test.flash_attn_fwd.default, torch.ops.aten.clone.default)
    decisions = [policy(ctx, op, q).name for op in ops]
    assert_expected_inline(str(decisions), """['MUST_SAVE', 'PREFER_RECOMPUTE']""")


def test_save_list_has_the_convolutions_and_upsampling_torchtitan_saves():
    names = {op_name(op) for op in policies.llm_save_list()}
    wanted = {"aten.convolution.default", "aten.convolution_backward.default", "aten.upsample_bilinear2d.default"}
    assert wanted <= names


def test_save_list_has_the_communication_ops():
    names = sorted(op_name(op) for op in policies.llm_save_list() if "c10d" in op_name(op))
    assert_expected_inline("\n".join(names), """\
_c10d_functional.all_gather_into_tensor.default
_c10d_functional.all_gather_into_tensor_coalesced.default
_c10d_functional.all_reduce.default
_c10d_functional.all_reduce_coalesced.default
_c10d_functional.all_to_all_single.default
_c10d_functional.reduce_scatter_tensor.default
_c10d_functional.reduce_scatter_tensor_coalesced.default
_c10d_functional_autograd.all_gather_into_tensor.default
_c10d_functional_autograd.all_to_all_single.default
_c10d_functional_autograd.reduce_scatter_tensor.default""")


def test_saves_the_first_third_and_fifth_matmul_of_each_forward():
    log = _run(policies.every_other_matmul(), _block(), forwards=2)
    assert_expected_inline(_matmuls_and_saves(log), """\
-- forward 0
aten.addmm.default -> MUST_SAVE
aten.mm.default -> MUST_RECOMPUTE
aten.mm.default -> MUST_SAVE
aten.addmm.default -> MUST_RECOMPUTE
aten.addmm.default -> MUST_SAVE
-- forward 1
aten.addmm.default -> MUST_SAVE
aten.mm.default -> MUST_RECOMPUTE
aten.mm.default -> MUST_SAVE
aten.addmm.default -> MUST_RECOMPUTE
aten.addmm.default -> MUST_SAVE""")


def test_counts_per_block():
    # One policy for two blocks in one forward: each block's count starts anew, so the second block's first
    # matmul (the 6th of the forward) is saved too.
    policy, log = policies.every_other_matmul(), []

    def recording(ctx, op, *args, **kwargs):
        decision = policy(ctx, op, *args, **kwargs)
        if decision.name != "PREFER_RECOMPUTE":
            log.append(decision.name)
        return decision

    context_fn = functools.partial(sac2.create_selective_checkpoint_contexts, recording)
    model = nn.Sequential(*(sac2.checkpoint_wrapper(_block(), context_fn=context_fn) for _ in range(2)))
    model(torch.randn(2, 4, 8)).sum()
    per_block = [log[:5], log[5:]]
    assert_expected_inline(
        str(per_block),
        """[['MUST_SAVE', 'MUST_RECOMPUTE', 'MUST_SAVE', 'MUST_RECOMPUTE', 'MUST_SAVE'], ['MUST_SAVE', 'MUST_RECOMPUTE', 'MUST_SAVE', 'MUST_RECOMPUTE', 'MUST_SAVE']]""",  # noqa: E501
    )


def test_forces_recompute_of_the_named_linears_matmuls():
    block = _block()
    log = _run(policies.recompute_linears(block, ["gate"]), block)
    assert_expected_inline(_matmuls_and_saves(log), """\
-- forward 0
aten.mm.default -> MUST_RECOMPUTE""")


def test_warns_about_other_linears_of_the_same_shape():
    block = _block()
    block.out = nn.Linear(8, 4, bias=False)
    with pytest.warns(UserWarning, match=r"\['out'\] have the same weight shape as \['gate'\]"):
        policies.recompute_linears(block, ["gate"])


def test_names_matching_nothing_warn_once_and_force_nothing():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        policy = policies.recompute_linears(_block(), ["router", "moe.gate"])
    assert_expected_inline("\n".join(str(w.message) for w in caught), """\
sac2.policies.recompute_linears: no module of the model is named ['router', 'moe.gate'], so nothing is forced to recompute for them (torchtitan's default 'moe.router.gate' matches nothing in a dense model too).""")  # noqa: E501
    assert _matmuls_and_saves(_run(policy, _block())) == "-- forward 0"


def test_rejects_a_name_matching_no_linear():
    model = nn.Sequential(_block())
    with pytest.raises(ValueError, match="'0' .* is a Attention, not an nn.Linear"):
        policies.recompute_linears(model, ["0"])


def test_save_list_is_torchtitan_030s():
    # torchtitan/distributed/activation_checkpoint.py, _get_default_save_ops, in torchtitan 0.3.0 on torch 2.13:
    # the partitioner's compute-intensive ops, then its own compute and communication ops (deepep and
    # hybridep ops only when registered).
    names = sorted(op_name(op) for op in policies.torchtitan_save_list())
    assert_expected_inline("\n".join(names), """\
_c10d_functional.all_to_all_single.default
_c10d_functional.reduce_scatter_tensor.default
aten._efficient_attention_forward.default
aten._flash_attention_forward.default
aten._scaled_dot_product_attention_math.default
aten._scaled_dot_product_cudnn_attention.default
aten._scaled_dot_product_efficient_attention.default
aten._scaled_dot_product_flash_attention.default
aten._scaled_dot_product_fused_attention_overrideable.default
aten._scaled_mm.default
aten.addmm.default
aten.bmm.default
aten.convolution.default
aten.convolution_backward.default
aten.linear.default
aten.max.default
aten.mm.default
aten.topk.default
aten.upsample_bilinear2d.default
flex_attention
inductor_compiled_code
torch_attn._varlen_attn.default""")


def test_save_list_has_optional_ops_once_registered(request):
    lib = torch.library.Library("deepep", "DEF")
    request.addfinalizer(lib._destroy)
    before = policies.torchtitan_save_list()
    lib.define("dispatch(Tensor x) -> Tensor")
    assert policies.torchtitan_save_list() - before == {torch.ops.deepep.dispatch.default}


def test_saves_every_other_mm_and_recomputes_the_forced_shapes():
    block = _block()
    assert_expected_inline(_matmuls_and_saves(_run(policies.torchtitan(block, ["gate"]), block)), """\
-- forward 0
aten.addmm.default -> MUST_SAVE
aten.mm.default -> MUST_SAVE
aten.topk.default -> MUST_SAVE
aten.addmm.default -> MUST_SAVE
aten.addmm.default -> MUST_SAVE
aten.max.default -> MUST_SAVE""")


def test_counts_mms_per_forward_and_saves_odd_ones():
    policy, ctx = policies.torchtitan(), ForwardContext()
    x, w = torch.randn(2, 3), torch.randn(3, 3)
    mm, linear = torch.ops.aten.mm.default, torch.ops.aten.linear.default
    decisions = [policy(ctx, op, x, w).name for op in (mm, linear, mm, linear)]
    assert_expected_inline(
        str(decisions), """['MUST_SAVE', 'PREFER_RECOMPUTE', 'MUST_SAVE', 'PREFER_RECOMPUTE']"""
    )


def test_recomputes_all_gather_and_all_reduce_unlike_llm():
    names = {op_name(op) for op in policies.torchtitan_save_list()}
    collectives = ["_c10d_functional.all_gather_into_tensor.default", "_c10d_functional.all_reduce.default"]
    assert [n for n in collectives if n in names] == []
    llm_names = {op_name(op) for op in policies.llm_save_list()}
    assert [n for n in collectives if n in llm_names] == collectives


def test_saves_cuda_to_cpu_copies_only():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        on_cuda, on_cpu = torch.empty(2, device="cuda"), torch.empty(2)
    policy, ctx, to_copy = policies.torchtitan(), ForwardContext(), torch.ops.aten._to_copy.default
    decisions = [
        policy(ctx, to_copy, on_cuda, device=torch.device("cpu")).name,
        policy(ctx, to_copy, on_cuda, dtype=torch.half).name,
        policy(ctx, to_copy, on_cpu, device="cpu").name,
    ]
    assert_expected_inline(str(decisions), """['MUST_SAVE', 'PREFER_RECOMPUTE', 'PREFER_RECOMPUTE']""")


def test_rejects_a_forced_name_matching_no_linear():
    with pytest.raises(ValueError, match="matched 'moe', a Module; it must match nn.Linear modules"):
        model = nn.Module()
        model.moe = nn.Module()
        policies.torchtitan(model, ["moe"])


def test_torchtitan_op_policy():
    block = _block()
    policy = policies.compose(
        policies.recompute_linears(block, ["gate"]), policies.every_other_matmul(), policies.llm()
    )
    assert_expected_inline(_matmuls_and_saves(_run(policy, block)), """\
-- forward 0
aten.addmm.default -> MUST_SAVE
aten._scaled_dot_product_flash_attention_for_cpu.default -> MUST_SAVE
aten.mm.default -> MUST_RECOMPUTE
aten.mm.default -> MUST_RECOMPUTE
aten.topk.default -> MUST_SAVE
aten.addmm.default -> MUST_SAVE
aten.addmm.default -> MUST_RECOMPUTE
aten.max.default -> MUST_SAVE""")


def test_must_beats_prefer_and_order_breaks_ties():
    P = sac2.CheckpointPolicy

    def answer(value):
        return lambda _ctx, _op, *a, **k: value

    ctx = sac2.SelectiveCheckpointContext(is_recompute=False)
    cases = {
        "PREFER_SAVE, MUST_RECOMPUTE": (answer(P.PREFER_SAVE), answer(P.MUST_RECOMPUTE)),
        "MUST_SAVE, MUST_RECOMPUTE": (answer(P.MUST_SAVE), answer(P.MUST_RECOMPUTE)),
        "PREFER_SAVE, PREFER_RECOMPUTE": (answer(P.PREFER_SAVE), answer(P.PREFER_RECOMPUTE)),
        "False, True": (answer(False), answer(True)),
    }
    report = "\n".join(
        f"{name} -> {policies.compose(*ps)(ctx, torch.ops.aten.mm.default).name}" for name, ps in cases.items()
    )
    assert_expected_inline(report, """\
PREFER_SAVE, MUST_RECOMPUTE -> MUST_RECOMPUTE
MUST_SAVE, MUST_RECOMPUTE -> MUST_SAVE
PREFER_SAVE, PREFER_RECOMPUTE -> PREFER_SAVE
False, True -> MUST_SAVE""")


def test_rejects_an_answer_that_is_not_a_policy():
    policy = policies.compose(lambda _ctx, _op, *a, **k: "save")  # type: ignore[arg-type]  # a wrong answer, on purpose
    ctx = sac2.SelectiveCheckpointContext(is_recompute=False)
    with pytest.raises(TypeError, match="returned 'save' for aten.mm.default"):
        policy(ctx, torch.ops.aten.mm.default)


def test_its_error_survives_tensor_operators_in_a_checkpointed_forward():
    # a * a turns a TypeError raised under it into NotImplemented; sac2's forward mode raises it again
    policy = policies.compose(lambda _ctx, _op, *a, **k: "save")  # type: ignore[arg-type]  # a wrong answer, on purpose
    context_fn = functools.partial(sac2.create_selective_checkpoint_contexts, policy)
    with pytest.raises(TypeError, match="returned 'save' for aten.mul.Tensor"):
        sac2.checkpoint(lambda a: a * a, torch.randn(3, requires_grad=True), context_fn=context_fn)


def test_gradients_equal_the_unchecked_block():
    block = _block()
    x = torch.randn(2, 4, 8, generator=torch.Generator().manual_seed(0), requires_grad=True)
    block(x).sum().backward()
    expected = [p.grad.clone() for p in block.parameters()]
    block.zero_grad()
    policy = policies.compose(policies.every_other_matmul(), policies.llm())
    sac2.checkpoint_wrapper(
        block, context_fn=functools.partial(sac2.create_selective_checkpoint_contexts, policy)
    )(x).sum().backward()
    for p, e in zip(block.parameters(), expected, strict=True):
        assert torch.equal(p.grad, e)


def _grouped_experts(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """Two experts' MLPs as grouped matmuls (transformers' grouped_mm experts, torchtitan's GroupedExperts)."""
    offs = torch.tensor([8, 16], dtype=torch.int32)
    return torch._grouped_mm(F.silu(torch._grouped_mm(x, w1, offs=offs)), w2, offs=offs)


def _expert_inputs() -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(16, 32, generator=g).bfloat16().requires_grad_()
    w1 = torch.randn(2, 64, 32, generator=g).bfloat16().transpose(-2, -1).requires_grad_()
    w2 = torch.randn(2, 32, 64, generator=g).bfloat16().transpose(-2, -1).requires_grad_()
    return x, w1, w2


def _grouped_mm_decision(policy) -> str:
    (row,) = [r for r in sac2.explain(_grouped_experts, _expert_inputs(), policy, cost="flops").rows
              if r.op == "aten._grouped_mm.default"]
    return row.decision


def test_every_matmul_preset_saves_grouped_expert_matmuls():
    assert _grouped_mm_decision(policies.llm()) == "save"
    assert _grouped_mm_decision(policies.every_other_matmul()) == "save 1 of 2"


def test_torchtitan_preset_recomputes_grouped_expert_matmuls_as_torchtitan_does():
    assert _grouped_mm_decision(policies.torchtitan()) == "recompute"
