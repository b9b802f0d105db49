"""torchtitan 0.3.0: ``FullAC`` and ``SelectiveAC`` on its llama3 debug model (SDPA attention), backed by sac2."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("torchtitan")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torchtitan.distributed import activation_checkpoint as tt_ac  # noqa: E402

import sac2  # noqa: E402
from sac2.integrations import install  # noqa: E402
from sac2.integrations.torchtitan import apply_ac  # noqa: E402

from . import assert_bitwise_equal, titan_model, tokens, train  # noqa: E402

VOCAB = 2048


def n_layers() -> int:
    return len(titan_model().layers)


def loss_fn(ids: torch.Tensor):
    def run(model: torch.nn.Module) -> torch.Tensor:
        logits = model(ids[:, :-1])
        return F.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten())

    return run


@pytest.fixture(scope="module")
def ids():
    return tokens(vocab=VOCAB, seq=33)


@pytest.fixture(scope="module")
def no_ac(ids):
    return train(titan_model(), loss_fn(ids))


def full_ac():
    return tt_ac.FullAC.Config().build()


def selective_ac():
    return tt_ac.SelectiveAC.Config().build()


@pytest.mark.parametrize("make_ac", [full_ac, selective_ac], ids=["FullAC", "SelectiveAC"])
def test_apply_ac_wraps_every_block_with_sac2(make_ac):
    model = titan_model()
    wrapped = apply_ac(make_ac(), model)
    assert wrapped == [f"layers.{name}" for name in model.layers.keys()]
    assert all(isinstance(block, sac2.CheckpointWrapper) for block in model.layers.values())


@pytest.mark.parametrize("make_ac", [full_ac, selective_ac], ids=["FullAC", "SelectiveAC"])
def test_apply_ac_trains_bitwise_like_no_ac(no_ac, ids, make_ac):
    model = titan_model()
    apply_ac(make_ac(), model)
    assert_bitwise_equal(train(model, loss_fn(ids)), no_ac)


@pytest.mark.parametrize("make_ac", [full_ac, selective_ac], ids=["FullAC", "SelectiveAC"])
def test_apply_ac_runs_sac2_modes_in_every_block_forward(ids, make_ac):
    model = titan_model()
    apply_ac(make_ac(), model)
    before = sac2.forward_count()
    train(model, loss_fn(ids))
    assert sac2.forward_count() - before == len(model.layers) * 2


def test_selective_ac_applied_under_install_keeps_sac2_after_uninstall(ids):
    """SelectiveAC's context_fn looks create_selective_checkpoint_contexts up on every forward; a model wrapped
    while installed still runs sac2's modes after uninstall()."""
    model = titan_model()
    with install():
        selective_ac().apply(model)
    assert tt_ac.create_selective_checkpoint_contexts is torch.utils.checkpoint.create_selective_checkpoint_contexts
    before = sac2.forward_count()
    train(model, loss_fn(ids))
    assert sac2.forward_count() - before == len(model.layers) * 2


def test_config_fields_apply_ac_relies_on():
    """The torchtitan 0.3.0 facts docs/torchtitan.md states."""
    assert tt_ac.FullAC.Config().preserve_rng_state is True
    assert tt_ac.SelectiveAC.Config().force_recompute_mm_shapes_by_fqns == ["moe.router.gate"]
    assert tt_ac.MemoryBudgetAC.Config().memory_budget == 0.5


class _FlopBlock(torch.nn.Module):
    """Three bias-free Linears; the router gate has the attention projection's shape (tests/test_recompute_flops)."""

    def __init__(self) -> None:
        super().__init__()
        # containers filled by attribute, for torchtitan's FQNs: Any, as nn.Module's stubs type a submodule's attribute
        # as Tensor | Module
        self.moe: Any = torch.nn.Module()
        self.moe.router = torch.nn.Module()
        self.moe.router.gate = torch.nn.Linear(256, 256, bias=False)
        self.attention: Any = torch.nn.Module()
        self.attention.wq = torch.nn.Linear(256, 256, bias=False)
        self.output = torch.nn.Linear(256, 512, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.output(self.attention.wq(self.moe.router.gate(x)))


class _FlopModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleDict({"0": _FlopBlock()})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers["0"](x)


def _backward_units(ac) -> float:
    from torch.utils.flop_counter import FlopCounterMode

    model = _FlopModel()
    if ac is not None:
        apply_ac(ac, model)
    out = model(torch.randn(64, 256, requires_grad=True)).sum()
    with FlopCounterMode(display=False) as counter:
        out.backward()
    return counter.get_total_flops() / (2 * 64 * 256 * 256)


@pytest.mark.parametrize(
    ("ac", "units"),
    [
        pytest.param(lambda: None, 8, id="no AC"),
        pytest.param(lambda: tt_ac.SelectiveAC.Config(force_recompute_mm_shapes_by_fqns=[]).build(), 9,
                     id="selective"),
        pytest.param(lambda: tt_ac.SelectiveAC.Config().build(), 10, id="selective, router gate forced"),
        pytest.param(lambda: tt_ac.SelectiveAC.Config(force_recompute_mm_shapes_by_fqns=["output"]).build(), 11,
                     id="selective, output forced"),
        pytest.param(full_ac, 12, id="full AC"),
    ],
)
def test_torchtitans_policies_through_sac2_recompute_the_flops_torchtitan_expects(ac, units):
    before = sac2.forward_count()
    assert _backward_units(ac()) == units
    assert ac() is None or sac2.forward_count() > before
