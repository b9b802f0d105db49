"""sac2's module wrappers behave like torch's checkpoint_wrapper family, on sac2's checkpoint."""

import copy
import functools
import warnings
from typing import Any

import pytest
import torch
from expecttest import assert_expected_inline
from torch import nn
from torch.distributed.algorithms._checkpoint import checkpoint_wrapper as torch_cw
from torch.distributed.fsdp.wrap import CustomPolicy, ModuleWrapPolicy, size_based_auto_wrap_policy
from torch.utils._python_dispatch import TorchDispatchMode

import sac2

from helpers import randn


class Block(nn.Module):
    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, 2 * d)
        self.down = nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return x + scale * self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class Model(nn.Module):
    def __init__(self, n: int = 3, d: int = 8) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block(d) for _ in range(n))
        self.head = nn.Linear(d, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x).sum()


def _model(seed: int = 0) -> Any:  # Any: tests read model.layers[0].up, which nn.Module's stubs type as Tensor | Module
    torch.manual_seed(seed)
    return Model()


def _wrapped_names(model: nn.Module, cls: type) -> list[str]:
    return [fqn for fqn, m in model.named_modules() if isinstance(m, cls)]


def _losses(model: nn.Module, steps: int = 3) -> list[torch.Tensor]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(steps):
        loss = model(randn(2, 4, 8, seed=1, grad=False))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses


def _count_calls(module: nn.Module) -> list[int]:
    calls = [0]
    module.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


class _CountOps(TorchDispatchMode):
    """Counts the calls of each op that runs under it."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: dict = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func] = self.counts.get(func, 0) + 1
        return func(*args, **(kwargs or {}))


def test_state_dict_keys_are_those_of_the_unwrapped_model_and_of_torchs_wrapper():
    ours, theirs, plain = _model(), _model(), _model()
    sac2.apply_activation_checkpointing(ours, check_fn=lambda m: isinstance(m, Block))
    torch_cw.apply_activation_checkpointing(theirs, check_fn=lambda m: isinstance(m, Block))
    assert list(ours.state_dict()) == list(theirs.state_dict())
    assert list(ours.state_dict()) == list(plain.state_dict())


def test_unwrapped_state_dict_loads_into_wrapped_model_and_back():
    plain, wrapped = _model(seed=0), _model(seed=1)
    sac2.apply_activation_checkpointing(wrapped, check_fn=lambda m: isinstance(m, Block))
    wrapped.load_state_dict(plain.state_dict())
    for (_, a), (_, b) in zip(plain.state_dict().items(), wrapped.state_dict().items(), strict=True):
        assert torch.equal(a, b)
    other = _model(seed=2)
    other.load_state_dict(wrapped.state_dict())
    assert torch.equal(other.head.weight, plain.head.weight)


def test_named_parameters_match_torchs_wrapper():
    ours, theirs = _model(), _model()
    sac2.apply_activation_checkpointing(ours, check_fn=lambda m: isinstance(m, Block))
    torch_cw.apply_activation_checkpointing(theirs, check_fn=lambda m: isinstance(m, Block))
    assert [n for n, _ in ours.named_parameters()] == [n for n, _ in theirs.named_parameters()]
    # The wrapper's own names are the wrapped module's; a parent's names show the wrapper, as in torch.
    assert [n for n, _ in ours.layers[0].named_parameters()] == [n for n, _ in Block().named_parameters()]


def test_three_adamw_steps_give_the_losses_of_the_unwrapped_model():
    policy = functools.partial(sac2.create_selective_checkpoint_contexts, [torch.ops.aten.addmm.default])
    every_kwargs: tuple[dict[str, Any], ...] = ({}, {"context_fn": policy})
    for kwargs in every_kwargs:
        model = _model()
        for i, block in enumerate(model.layers):
            model.layers[i] = sac2.checkpoint_wrapper(block, **kwargs)
        torch.testing.assert_close(_losses(model), _losses(_model()), atol=0, rtol=0)


def test_wrapped_module_recomputes_in_backward():
    model = _model()
    calls = _count_calls(model.layers[0].up)
    model.layers[0] = sac2.checkpoint_wrapper(model.layers[0])
    model(randn(2, 4, 8, seed=1, grad=False)).backward()
    assert calls[0] == 2


def test_context_fn_runs_sac2_policy():
    seen = []

    def policy(_ctx, op, *args, **kwargs):
        seen.append(op)
        return sac2.CheckpointPolicy.PREFER_RECOMPUTE

    block = sac2.checkpoint_wrapper(
        Block(), context_fn=functools.partial(sac2.create_selective_checkpoint_contexts, policy)
    )
    block(randn(2, 4, 8, seed=1)).sum().backward()
    assert torch.ops.aten.addmm.default in seen


def test_forward_keyword_arguments_reach_the_module_for_both_impls():
    for impl in sac2.CheckpointImpl:
        block = Block()
        x = randn(2, 4, 8, seed=1)
        expected = block(x, scale=0.5)
        out = sac2.checkpoint_wrapper(block, checkpoint_impl=impl)(x, scale=0.5)
        assert torch.equal(out, expected)
        out.sum().backward()


def test_reentrant_impl_rejects_a_selective_policy():
    with pytest.raises(ValueError, match="REENTRANT recomputes the whole module"):
        sac2.checkpoint_wrapper(
            Block(), sac2.CheckpointImpl.REENTRANT, context_fn=lambda: (None, None)
        )


def test_checkpoint_impl_is_torchs_enum():
    assert sac2.CheckpointImpl is torch_cw.CheckpointImpl


def test_torch_code_sees_sac2_wrappers_as_activation_wrappers():
    assert isinstance(sac2.checkpoint_wrapper(Block()), torch_cw.ActivationWrapper)


def test_attribute_access_and_indexing_reach_the_wrapped_module():
    seq = sac2.checkpoint_wrapper(nn.Sequential(nn.Linear(2, 2), nn.ReLU()))
    block = sac2.checkpoint_wrapper(Block())
    assert isinstance(seq, sac2.CheckpointWrapper) and isinstance(block, sac2.CheckpointWrapper)
    assert isinstance(seq[1], nn.ReLU)
    assert block.up.out_features == 16


def test_offload_wrapper_gives_the_gradients_of_torchs_offload_wrapper():
    grads = []
    for wrap in (sac2.offload_wrapper, torch_cw.offload_wrapper):
        torch.manual_seed(0)
        block = Block()
        wrap(block)(randn(2, 4, 8, seed=1)).sum().backward()
        grads.append([p.grad for p in block.parameters()])
    for ours, theirs in zip(*grads, strict=True):
        assert torch.equal(ours, theirs)


def _compare(**kwargs):
    ours, theirs = _model(), _model()
    sac2.apply_activation_checkpointing(ours, **kwargs)
    torch_cw.apply_activation_checkpointing(theirs, **kwargs)
    names = _wrapped_names(ours, sac2.CheckpointWrapper)
    assert names == _wrapped_names(theirs, torch_cw.CheckpointWrapper)
    return names


def test_wraps_exactly_the_modules_check_fn_selects():
    names = _compare(check_fn=lambda m: isinstance(m, nn.Linear))
    assert_expected_inline(
        str(names),
        """['layers.0.up', 'layers.0.down', 'layers.1.up', 'layers.1.down', 'layers.2.up', 'layers.2.down', 'head']""",
    )


def test_wraps_nested_selections_children_first_and_never_the_root():
    names = _compare(check_fn=lambda m: isinstance(m, (Model, Block, nn.LayerNorm)))
    assert_expected_inline(
        str(names),
        """['layers.0', 'layers.0._checkpoint_wrapped_module.norm', 'layers.1', 'layers.1._checkpoint_wrapped_module.norm', 'layers.2', 'layers.2._checkpoint_wrapped_module.norm']""",  # noqa: E501
    )


@pytest.mark.parametrize(
    "policy",
    [
        ModuleWrapPolicy({Block}),
        CustomPolicy(lambda m: isinstance(m, nn.LayerNorm)),
        functools.partial(size_based_auto_wrap_policy, min_num_params=100),
    ],
    ids=["ModuleWrapPolicy", "CustomPolicy", "size_based_auto_wrap_policy"],
)
def test_fsdp_auto_wrap_policies_select_what_they_select_in_torch(policy):
    assert _compare(auto_wrap_policy=policy)


def test_keeps_qualified_names_and_state_dict():
    model = _model()
    keys, names = list(model.state_dict()), [n for n, _ in model.named_modules()]
    for block in model.layers:
        sac2.checkpoint_module(block)
    assert list(model.state_dict()) == keys
    assert [n for n, _ in model.named_modules()] == names
    assert isinstance(model.layers[0], Block)


def test_recomputes_in_backward_and_matches_unwrapped_losses():
    model = _model()
    calls = _count_calls(model.layers[0].up)
    sac2.checkpoint_module(model.layers[0])
    model(randn(2, 4, 8, seed=1, grad=False)).backward()
    assert calls[0] == 2
    model = _model()
    for block in model.layers:
        sac2.checkpoint_module(block, context_fn=functools.partial(
            sac2.create_selective_checkpoint_contexts, [torch.ops.aten.addmm.default]))
    torch.testing.assert_close(_losses(model), _losses(_model()), atol=0, rtol=0)


def test_selective_policy_saves_what_it_names():
    # The Linears' addmm runs again in backward only when the policy does not save it (the gradients are mms).
    addmms_in_backward = {}
    for name, ops in (("saves addmm", [torch.ops.aten.addmm.default]), ("saves nothing", [])):
        block = sac2.checkpoint_module(
            Block(), context_fn=functools.partial(sac2.create_selective_checkpoint_contexts, ops)
        )
        out = block(randn(2, 4, 8, seed=1))
        with _CountOps() as counter:
            out.sum().backward()
        addmms_in_backward[name] = counter.counts.get(torch.ops.aten.addmm.default, 0)
    assert addmms_in_backward["saves addmm"] == 0
    assert addmms_in_backward["saves nothing"] > 0


def test_checkpointing_twice_is_an_error():
    block = sac2.checkpoint_module(Block())
    with pytest.raises(ValueError, match="already checkpointed"):
        sac2.checkpoint_module(block)


def test_deepcopy_keeps_it_checkpointed():
    block = copy.deepcopy(sac2.checkpoint_module(Block()))
    calls = _count_calls(block.up)
    block(randn(2, 4, 8, seed=1)).sum().backward()
    assert calls[0] == 2


def _warnings(run) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run()
    return [str(w.message) for w in caught if "sac2" in str(w.message)]


def test_a_wrapper_inside_another_checkpoints_forward_warns_once():
    inner = sac2.checkpoint_wrapper(Block())

    def step():
        x = randn(2, 4, 8, seed=1)
        torch.utils.checkpoint.checkpoint(inner, x, use_reentrant=False).sum().backward()

    assert_expected_inline("\n".join(_warnings(lambda: [step(), step()])), """\
sac2: this Block is checkpointed inside the forward of another checkpoint, so backward recomputes it twice. Checkpoint it once: drop the outer checkpoint (in transformers, model.gradient_checkpointing_disable()) or the sac2 wrapper.""")  # noqa: E501


def test_checkpoint_module_inside_a_checkpoint_wrapper_warns():
    outer = sac2.checkpoint_wrapper(nn.Sequential(sac2.checkpoint_module(Block()), nn.ReLU()))
    assert len(_warnings(lambda: outer(randn(2, 4, 8, seed=1)).sum().backward())) == 1


def test_a_wrapper_alone_or_beside_another_does_not_warn():
    model = _model()
    sac2.apply_ac(model)
    assert _warnings(lambda: model(randn(2, 4, 8, seed=1, grad=False)).backward()) == []


def test_apply_ac_warns_about_blocks_transformers_already_checkpoints():
    model = _model()
    model.layers[0].gradient_checkpointing = model.layers[2].gradient_checkpointing = True
    assert_expected_inline("\n".join(_warnings(lambda: sac2.apply_ac(model))), """\
sac2.apply_ac: ['layers.0', 'layers.2'] already run under transformers' gradient checkpointing (gradient_checkpointing = True), so wrapping them checkpoints them twice. Call model.gradient_checkpointing_disable() before sac2.apply_ac.""")  # noqa: E501


@pytest.mark.parametrize("form", ["wrapper", "composable"])
def test_torch_compile_of_a_checkpointed_model_matches_eager(form):
    llm, asked = sac2.policies.llm(), []

    def policy(ctx, op, *args, **kwargs):
        asked.append(op)
        return llm(ctx, op, *args, **kwargs)

    context_fn = functools.partial(sac2.create_selective_checkpoint_contexts, policy)
    model = _model()
    for i, block in enumerate(model.layers):
        if form == "wrapper":
            model.layers[i] = sac2.checkpoint_wrapper(block, context_fn=context_fn)
        else:
            sac2.checkpoint_module(block, context_fn=context_fn)
    eager = copy.deepcopy(model)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    torch.compile(model, backend="aot_eager", fullgraph=True)(randn(2, 4, 8, seed=1, grad=False)).backward()
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    assert torch.ops.aten.addmm.default in asked  # the policy tagged the traced graph
    eager(randn(2, 4, 8, seed=1, grad=False)).backward()
    for (name, p), q in zip(model.named_parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


def test_a_compiled_checkpoint_module_that_breaks_the_graph_is_checkpointed_once():
    """Where dynamo breaks the graph inside the checkpoint, the call runs eagerly with the parent's forward rebuilt
    by dynamo: a bound method would come back as the module's own (checkpointing) forward, checkpointing the block
    inside itself. The block runs once in forward and once in recompute, with no nested-checkpoint warning."""
    runs = []

    class Breaking(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            runs.append(1)
            y = self.linear(x).relu()
            torch._dynamo.graph_break()
            return self.linear(y)

    block = sac2.checkpoint_module(Breaking())
    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.compile(block, backend="aot_eager")(randn(2, 8, seed=1)).sum().backward()
    assert len(runs) == 2
    assert not [w for w in caught if "inside the forward of another checkpoint" in str(w.message)]


def test_wraps_each_block_of_model_layers_by_default():
    model = _model()
    assert sac2.apply_ac(model) == ["layers.0", "layers.1", "layers.2"]
    assert _wrapped_names(model, sac2.CheckpointWrapper) == ["layers.0", "layers.1", "layers.2"]


def test_selective_and_full_train_like_the_unwrapped_model():
    for mode in ("selective", "full"):
        model = _model()
        sac2.apply_ac(model, mode)
        torch.testing.assert_close(_losses(model), _losses(_model()), atol=0, rtol=0)


def test_every_kth_block_as_torchtitan_counts_them():
    model = nn.Sequential(*(Block() for _ in range(5)))
    assert sac2.apply_ac(model, "full", blocks=[str(i) for i in range(5)], every=2) == ["1", "3"]


def test_blocks_given_as_container_names_or_predicate():
    model = _model()  # not bound by a walrus inside the assert, which pytest rewrites to read it before binding it
    assert sac2.apply_ac(model, blocks=model.layers) == ["layers.0", "layers.1", "layers.2"]
    assert sac2.apply_ac(_model(), blocks=["head", "layers.1.up"]) == ["head", "layers.1.up"]
    wrapped = sac2.apply_ac(_model(), blocks=lambda m: isinstance(m, (Block, nn.Linear)))
    assert wrapped == ["layers.0", "layers.1", "layers.2", "head"]  # outermost matches only


def test_finds_the_one_container_of_blocks_without_a_layers_attribute():
    model = nn.Module()
    model.blocks, model.extra = nn.ModuleList(Block() for _ in range(3)), nn.ModuleList([nn.ReLU()])
    assert sac2.apply_ac(model) == ["blocks.0", "blocks.1", "blocks.2"]
    model.more = nn.ModuleList(Block() for _ in range(3))
    with pytest.raises(ValueError, match=r"several containers could hold the blocks: \['blocks', 'more'\]"):
        sac2.apply_ac(model)


def test_none_changes_nothing_and_bad_arguments_are_errors():
    model = _model()
    assert sac2.apply_ac(model, "none") == []
    assert _wrapped_names(model, sac2.CheckpointWrapper) == []
    with pytest.raises(ValueError, match="mode='op'"):
        sac2.apply_ac(model, "op")
    with pytest.raises(ValueError, match="a policy only applies to mode='selective'"):
        sac2.apply_ac(model, "full", policy=sac2.policies.llm())
    with pytest.raises(ValueError, match="no submodule named 'layers.9'"):
        sac2.apply_ac(model, blocks=["layers.9"])
