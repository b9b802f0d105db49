"""``sac2.apply_ac(model, mode="regions", save=...)``: calls chosen inside each block become regions without editing
the model, and the blocks checkpoint with no dispatch mode, bitwise like no checkpointing."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from torch import nn

import sac2
from sac2.bench.models import CONFIGS, Transformer, random_tokens

CFG = CONFIGS["tiny"]


def _model() -> Transformer:
    torch.manual_seed(0)
    return Transformer(CFG)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    return random_tokens(CFG, torch.Generator().manual_seed(0), torch.device("cpu"))


def _grads(model: nn.Module) -> list[torch.Tensor]:
    model(*_batch()).backward()
    return [p.grad for p in model.parameters()]


@pytest.mark.parametrize("save", [None, ["attention"], ["linear"], [nn.Linear, "attention"], ["mlp*", "*proj"]],
                         ids=["default", "attention", "linear", "class", "globs"])
def test_a_regions_plan_trains_bitwise_like_no_checkpointing(save):
    reference = _grads(_model())
    model = _model()
    if save == ["mlp*", "*proj"]:
        save = ["gate_up", "*proj"]  # names inside a block: gate_up, down, proj, qkv, attention
    assert sac2.apply_ac(model, "regions", save=save, blocks=model.blocks) == ["blocks.0", "blocks.1"]
    before = sac2.forward_count()
    got = _grads(model)
    assert sac2.forward_count() - before == CFG.n_layers
    assert all(torch.equal(g, r) for g, r in zip(got, reference, strict=True))


def test_no_dispatch_mode_runs_in_forward_or_recompute():
    model = _model()
    sac2.apply_ac(model, "regions", save=["attention", "down"], blocks=model.blocks)
    modes: list[int] = []
    for block in model.blocks:
        assert isinstance(block, sac2.CheckpointWrapper)
        for module in block._checkpoint_wrapped_module.children():
            module.register_forward_pre_hook(lambda _mod, _args: modes.append(torch._C._len_torch_dispatch_stack()))
    model(*_batch()).backward()
    assert len(modes) > 2 * 7 and set(modes) == {0}  # each submodule call in forward, and those recompute ran


def test_a_served_region_runs_its_body_once():
    body_runs = []

    class Doubling(nn.Module):
        def forward(self, x):
            body_runs.append(1)
            return x * 2

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(4, 4), Doubling(), nn.Tanh()) for _ in range(2))

        def forward(self, x):
            for b in self.blocks:
                x = b(x)
            return x.sum()

    torch.manual_seed(0)
    net = Net()
    sac2.apply_ac(net, "regions", save=[Doubling])
    net(torch.randn(3, 4, requires_grad=True)).backward()
    assert len(body_runs) == 2  # once per block, in forward; served in recompute


def test_module_names_and_state_dict_keys_are_unchanged_and_the_model_pickles():
    reference = _model()
    model = _model()
    sac2.apply_ac(model, "regions", blocks=model.blocks)
    assert list(model.state_dict()) == list(reference.state_dict())
    buffer = io.BytesIO()
    torch.save(model, buffer)
    loaded = torch.load(io.BytesIO(buffer.getvalue()), weights_only=False)
    assert all(torch.equal(g, r) for g, r in zip(_grads(loaded), _grads(copy.deepcopy(reference)), strict=True))


@pytest.mark.parametrize("backend", ["aot_eager"])
def test_regions_train_under_torch_compile_like_compiled_no_checkpointing(backend):
    torch._dynamo.reset()
    reference = _model()
    torch.compile(reference, backend=backend)(*_batch()).backward()
    model = _model()
    sac2.apply_ac(model, "regions", blocks=model.blocks)
    torch._dynamo.reset()
    torch.compile(model, backend=backend)(*_batch()).backward()
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5)


def test_a_pattern_matching_nothing_names_it_and_the_names_there():
    model = _model()
    with pytest.raises(ValueError, match=r"save=\['mlp.down_proj'\] matches no module inside the blocks"):
        sac2.apply_ac(model, "regions", save=["mlp.down_proj"], blocks=model.blocks)


def test_a_region_inside_a_region_is_refused():
    net = nn.ModuleList([nn.Sequential(nn.Sequential(nn.Linear(2, 2)))])
    with pytest.raises(ValueError, match=r"'0.0.0.0' is inside '0.0.0'.*cannot hold another"):
        sac2.apply_ac(nn.Sequential(net), "regions", save=[nn.Sequential, "linear"], blocks=net)


def test_attention_without_an_interface_or_a_kernel_module_says_what_to_do():
    net = nn.ModuleList([nn.Linear(2, 2)])
    with pytest.raises(ValueError, match="found no attention call.*sac2.region\\(name='attention'\\)"):
        sac2.apply_ac(nn.Sequential(net), "regions", save=["attention"], blocks=net)


def test_save_only_applies_to_regions():
    with pytest.raises(ValueError, match="save= only applies to mode='regions'"):
        sac2.apply_ac(_model(), "selective", save=["linear"])


def test_a_save_entry_of_the_wrong_kind_is_a_type_error():
    with pytest.raises(TypeError, match="neither a module class nor a string"):
        sac2.apply_ac(_model(), "regions", save=[3])  # type: ignore[list-item]  # on purpose


class _Blocks(nn.Module):
    def __init__(self, *blocks: nn.Module) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x


class _DropConnect(nn.Module):
    """A weight parametrization that draws: each forward drops half the weight's entries."""

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return w * torch.bernoulli(torch.full_like(w, 0.5))


@pytest.mark.parametrize("draws_in_weight", [False, True], ids=["plain linear", "dropconnect linear"])
def test_a_saved_linear_region_keeps_the_random_stream_of_the_ops_after_it(draws_in_weight):
    def net() -> nn.Module:
        torch.manual_seed(0)
        linear = nn.Linear(8, 8)
        if draws_in_weight:
            nn.utils.parametrize.register_parametrization(linear, "weight", _DropConnect())
        return _Blocks(nn.Sequential(linear, nn.Dropout(0.5), nn.Tanh()))

    def grads(model: nn.Module) -> list[torch.Tensor]:
        torch.manual_seed(1)
        model(torch.randn(4, 8, requires_grad=True)).sum().backward()
        return [p.grad for p in model.parameters()]

    reference = grads(net())
    model = net()
    sac2.apply_ac(model, "regions", save=["linear"], blocks=model.blocks)
    got = grads(model)
    assert all(torch.equal(g, r) for g, r in zip(got, reference, strict=True))


def test_compiled_regions_guard_no_object_that_sac2_reaches_from_two_places():
    """dynamo checks, in Python on every call of compiled code, that an object it reached from two places is still
    one object. A region module's name is guarded as a constant (not a ``Region`` every block shares) and sac2's
    modules read no global another module reads too, so one-line regions add none of those checks."""
    model = _model()
    sac2.apply_ac(model, "regions", blocks=model.blocks)
    guards = []

    def keep_all(entries):
        guards.extend(entries)
        return [True] * len(entries)

    torch._dynamo.reset()
    torch.compile(model, backend="eager", options={"guard_filter_fn": keep_all})(*_batch()).backward()
    aliases = [g.name for g in guards if g.guard_type == "DUPLICATE_INPUT"]
    assert guards and not [n for n in aliases if "_sac2_region" in n or "__import_sac2_dot" in n], aliases
