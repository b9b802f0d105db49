"""Policies, context_fns and checkpointed modules pickle, and decide the same after loading.

The HF/TRL Trainer pickles its TrainingArguments, which hold the ``context_fn``. Each policy is asked about one
recorded sequence of op calls before and after a ``pickle`` round trip; the answers must be equal.
"""

import functools
import io
import pickle
import subprocess
import sys
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint as tuc
from torch import nn
from torch._higher_order_ops.wrap import InductorCompiledCallable, inductor_code_side_table, inductor_compiled_code
from torch._ops import HigherOrderOperator

import sac2
from sac2 import policies
from sac2.core.decisions import ForwardContext, SaveList

from helpers import contexts, randn

aten = torch.ops.aten


@torch.library.custom_op("sac2_test_pickle::flash_attn_fwd", mutates_args=())
def flash_attn_fwd(x: torch.Tensor) -> torch.Tensor:
    return x * 2


flash_attn_fwd.register_autograd(lambda _ctx, g: g * 2)

_callable = InductorCompiledCallable(lambda inputs: [inputs[0].sin()], compile_region_name="compiled")
inductor_code_side_table.add_callable(_callable)


class Block(nn.Module):
    """Linears, attention, topk/max, a custom flash_attn op, a sac2 region and (forward only: the stand-in for
    compiled code has no autograd of its own) a compiled region."""

    def __init__(self, d: int = 8, compiled: bool = False) -> None:
        super().__init__()
        self.compiled = compiled
        self.qkv = nn.Linear(d, 3 * d)
        self.gate = nn.Linear(d, 4, bias=False)
        self.up = nn.Linear(d, 2 * d)
        self.down = nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).unflatten(-1, (3, 2, -1)).transpose(1, 3).unbind(2)
        x = x + flash_attn_fwd(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2))
        weights, _ = torch.topk(self.gate(x).softmax(-1), 2)
        h = sac2.region(lambda t: self.down(F.silu(self.up(t))), name="mlp")(x)
        if self.compiled:
            h = inductor_compiled_code(_callable, [h])[0]
        h = h * weights.sum(-1, keepdim=True)
        return x + h / h.abs().max()


def _block(compiled: bool = False) -> Block:
    torch.manual_seed(0)
    return Block(compiled=compiled)


def _recorded_calls(block: nn.Module) -> list[tuple]:
    """(op, args, kwargs) of every op call sac2's forward mode asks a policy about, in one forward of ``block``."""
    calls = []

    def recording(_ctx, op, *args, **kwargs):
        calls.append((op, args, kwargs))
        return sac2.CheckpointPolicy.PREFER_RECOMPUTE

    sac2.checkpoint(block, randn(2, 4, 8), context_fn=contexts(recording))
    return calls


def _answers(policy, calls: list[tuple]) -> list[str]:
    """The policy's answer to each call, within one forward (one context, as sac2's forward mode gives)."""
    ctx = ForwardContext()
    return [policy(ctx, op, *args, **kwargs).name for op, args, kwargs in calls]


def _round_trip(obj):
    return pickle.loads(pickle.dumps(obj))


@pytest.fixture
def block() -> nn.Module:
    return _block(compiled=True)


@pytest.fixture
def calls(block) -> list[tuple]:
    """The calls a policy is asked about in one forward of ``block``."""
    return _recorded_calls(block)


def _assert_decides_the_same(calls: list[tuple], policy):
    before = _answers(policy, calls)
    assert _answers(_round_trip(policy), calls) == before
    assert set(before) != {"PREFER_RECOMPUTE"}  # it decides something


def test_llm(calls):
    _assert_decides_the_same(calls, policies.llm())


def test_torchtitan(block, calls):
    _assert_decides_the_same(calls, policies.torchtitan(block, ["gate"]))


def test_every_other_matmul(calls):
    _assert_decides_the_same(calls, policies.every_other_matmul())


def test_recompute_linears(block, calls):
    _assert_decides_the_same(calls, policies.recompute_linears(block, ["gate"]))


def test_compose(block, calls):
    _assert_decides_the_same(
        calls,
        policies.compose(policies.recompute_linears(block, ["gate"]), policies.every_other_matmul(), policies.llm())
    )


def test_save_list_of_ops_hops_and_regions(calls):
    _assert_decides_the_same(
        calls,
        SaveList([aten.mm.default, aten.addmm.default, torch.ops.higher_order.flex_attention, sac2.Region("mlp")])
    )


def test_memory_budget_keyed_by_ops_hops_compiled_callables_and_regions(block, calls):
    budget = policies.memory_budget(block, (randn(2, 4, 8),), 0.5, cost="flops")
    keys = {type(c.key).__name__ for c in budget.profile.calls}
    assert {"OpOverload", "Region", "tuple"} <= keys  # the tuple holds the HOP and its callable
    _assert_decides_the_same(calls, budget)


def test_a_preset_listing_an_op_torch_registers_on_import_loads_where_nothing_imported_it():
    """``torch_attn._varlen_attn`` exists once ``torch.nn.attention.varlen`` is imported: a resumed trainer loads
    its pickled policy before anything imports that module."""
    blob = pickle.dumps(policies.llm())
    code = (
        "import pickle, sys, sac2, torch\n"
        "assert 'torch.nn.attention.varlen' not in sys.modules\n"
        "policy = pickle.loads(sys.stdin.buffer.read())\n"
        "print(torch.ops.torch_attn._varlen_attn.default in policy.ops)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], input=blob, capture_output=True, check=True)
    assert out.stdout.decode().strip() == "True"


def test_partial_over_a_list_rebuilds_the_same_ops_and_checkpoints():
    ops: list[Any] = [aten.mm.default, aten.addmm.default, torch.ops.higher_order.flex_attention]  # ops and a HOP
    context_fn = _round_trip(functools.partial(sac2.create_selective_checkpoint_contexts, ops))
    for loaded, op in zip(context_fn.args[0], ops, strict=True):
        assert loaded is op
    sac2.checkpoint(_block(), randn(2, 4, 8), context_fn=context_fn).sum().backward()


def test_partial_over_a_preset():
    context_fn = _round_trip(functools.partial(sac2.create_selective_checkpoint_contexts, policies.llm()))
    sac2.checkpoint(_block(), randn(2, 4, 8), context_fn=context_fn).sum().backward()


def test_torchs_own_list_policy_pickles_once_sac2_is_imported():
    context_fn = functools.partial(tuc.create_selective_checkpoint_contexts, [aten.mm.default])
    assert _round_trip(context_fn).args[0][0] is aten.mm.default


def test_a_hop_made_after_sac2_was_imported_pickles_in_a_save_list():
    class LateHOP(HigherOrderOperator):
        def __init__(self) -> None:
            super().__init__("sac2_test_late_hop")

        def __call__(self, *args):
            return super().__call__(*args)

    hop = LateHOP()
    assert _round_trip(SaveList([hop])).ops == frozenset([hop])


def test_torch_save_and_load_keep_checkpoint_module_checkpointing():
    model = nn.Sequential(_block(), nn.Linear(8, 8))
    sac2.checkpoint_module(
        model[0], context_fn=functools.partial(sac2.create_selective_checkpoint_contexts, policies.llm())
    )
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert type(loaded[0]) is type(model[0])
    runs = []
    # the assert makes loaded[0] an nn.Module to mypy, whose attributes torch's stubs type as Tensor | Module
    loaded[0].gate.register_forward_hook(lambda *_: runs.append(1))  # type: ignore[union-attr]
    out = loaded(randn(2, 4, 8))
    assert torch.equal(out, model(randn(2, 4, 8)))
    out.sum().backward()
    assert len(runs) == 2  # forward, and again in backward's recompute
