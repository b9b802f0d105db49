"""One rule for the module names sac2's APIs take (``sac2.core.module_names``), tested on the names each accepted before
it: ``apply_ac``'s ``save`` globs, ``recompute_linears``' qualified-name suffixes; torchtitan's list keeps
torchtitan's substring rule."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import sac2
from sac2.core.module_names import names_module, torchtitan_names_module


@pytest.mark.parametrize("name", ["layers.3.moe.router.gate", "router.gate", "gate", "*.gate", "layers.*.moe.*.gate"])
def test_a_name_picks_the_module_whose_last_parts_it_matches(name):
    assert names_module(name, "layers.3.moe.router.gate")


@pytest.mark.parametrize(("name", "fqn"), [("mlp.down_proj", "mlp.down_proj"), ("self_attn.*_proj", "self_attn.q_proj"),
                                           ("*_proj", "self_attn.q_proj"), ("*_proj", "mlp.down_proj")])
def test_the_globs_apply_ac_took_still_pick_their_modules(name, fqn):
    assert names_module(name, fqn)


@pytest.mark.parametrize(("name", "fqn"), [("attn", "self_attn"), ("attn", "attn.q_proj"), ("router", "router.gate"),
                                           ("layers.3.moe.router.gate", "moe.router.gate")])
def test_a_name_does_not_pick_a_part_it_only_contains_or_a_module_inside_it(name, fqn):
    assert not names_module(name, fqn)


def test_torchtitans_list_matches_substrings_as_torchtitan_does():
    assert torchtitan_names_module("router", "layers.0.moe.router.gate")
    assert torchtitan_names_module("moe.router.gate", "layers.0.moe.router.gate")
    assert not torchtitan_names_module("moe.gate", "layers.0.moe.router.gate")


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up_proj, self.down_proj, self.gate = nn.Linear(4, 8), nn.Linear(8, 4), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.up_proj(x).relu()) + self.gate(x).sum(-1, keepdim=True)


def test_apply_ac_regions_read_a_glob_by_the_rule():
    model = nn.Sequential(_Block(), _Block())
    sac2.apply_ac(model, mode="regions", save=["*_proj"], blocks=lambda m: isinstance(m, _Block))
    regions = [n.split(".")[-1] for n, m in model.named_modules() if type(m).__name__.startswith("Region")]
    assert regions == ["up_proj", "down_proj"] * 2


def test_recompute_linears_reads_a_glob_by_the_rule():
    # ``*.gate`` picks the block's gate; the top-level Linear of its shape is recomputed too, and named in a warning.
    with pytest.warns(UserWarning, match=r"\['1'\] have the same weight shape as \['0.gate'\]"):
        policy = sac2.policies.recompute_linears(nn.Sequential(_Block(), nn.Linear(4, 2)), ["*.gate"])
    assert "(2, 4)" in repr(policy)
