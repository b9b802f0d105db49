"""``apply_ac(model, memory_budget=...)``: checkpoint every block with what a memory budget chose for it.

Each block's attention, Linears and experts are made regions first (whatever applies to the model), so a profile
sees each as one item. The model then runs once on the example inputs (``example_inputs=``, or the first forward
``apply_ac`` sees), without building a graph, to catch what each block is called with; every block is profiled on
its own inputs and ``sac2.policies.plan`` chooses, per kind of block, full AC, a save list of regions or an
op-level ``MemoryBudget``. Regions no plan keeps become plain modules again; each block is wrapped with its plan's
policy. The random number generators are where they were before profiling, so the first step draws what it would
have drawn without a budget.
"""

from __future__ import annotations

import functools
import gc
import warnings
from typing import Any, Callable

import torch
from torch import nn

from sac2 import messages
from sac2._compat import tree_leaves, tree_map
from sac2.api.checkpointing import create_selective_checkpoint_contexts
from sac2.api.wrappers import checkpoint_wrapper
from sac2.policies import path_costs
from sac2.policies.plan import BlockCall, BlockPlan, plan_blocks
from sac2.regions.in_models import ATTENTION, EXPERTS, LINEAR, make_regions, unmake_regions

__all__ = ["apply_budget", "Found"]

#: (parent, attribute, qualified name) of each block ``apply_ac`` wraps.
Found = list[tuple[nn.Module, str, str]]
#: What the candidate regions try, most first: a kind that does not apply to the model is left out.
_CANDIDATES = ((ATTENTION, LINEAR, EXPERTS), (LINEAR, EXPERTS), (ATTENTION,))


def apply_budget(
    model: nn.Module,
    found: Found,
    budget: float | int,
    example_inputs: Any,
    checkpoint_kwargs: dict[str, Any],
) -> None:
    """Plan and wrap ``found`` now (``example_inputs`` given), or on the model's first forward (None)."""
    if example_inputs is not None:
        _plan_and_wrap(model, found, budget, _as_call(example_inputs), checkpoint_kwargs)
        return

    def first_forward(_module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        handle.remove()
        _plan_and_wrap(model, found, budget, (args, kwargs), checkpoint_kwargs)

    # Runs eagerly under torch.compile too: profiling is no code to trace.
    handle = model.register_forward_pre_hook(torch.compiler.disable(first_forward), with_kwargs=True)


def _as_call(example_inputs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A tensor alone is one positional input; a dict holds keyword inputs; a list or tuple positional ones."""
    if isinstance(example_inputs, dict):
        return (), dict(example_inputs)
    if isinstance(example_inputs, (tuple, list)):
        return tuple(example_inputs), {}
    return (example_inputs,), {}


def _plan_and_wrap(
    model: nn.Module, found: Found, budget: float | int, call: tuple[tuple[Any, ...], dict[str, Any]],
    checkpoint_kwargs: dict[str, Any],
) -> None:
    blocks = [(fqn, getattr(parent, attr)) for parent, attr, fqn in found]
    _make_candidate_regions(model, blocks)
    device = _device(call, model)
    # The model may be compiled already (``model.compile()``): profiling runs it as it is written.
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else [], device_type=device.type), \
            torch.compiler.set_stance("force_eager"):
        inputs = _block_inputs(model, blocks, call)
        calls = [BlockCall(b, args, kwargs) for (_, b), (args, kwargs) in zip(blocks, inputs, strict=True)]
        plans = plan_blocks(calls, budget, path_costs.measure(device))
    del inputs, calls
    gc.collect()  # what profiling left in reference cycles (its records): not in the first step's memory
    for (parent, attr, _), plan in zip(found, plans, strict=True):
        block = getattr(parent, attr)
        if plan.kind != "ops":  # an op-level budget was profiled with every region: they stay
            unmake_regions(block, plan.regions)
        setattr(parent, attr, checkpoint_wrapper(block, **_options(plan, checkpoint_kwargs)))
    if all(p.kind == "full" for p in plans):
        warnings.warn(messages.apply_ac_budget_keeps_full_ac(budget, device.type), stacklevel=4)


def _options(plan: BlockPlan, checkpoint_kwargs: dict[str, Any]) -> dict[str, Any]:
    if plan.policy is None:
        return checkpoint_kwargs
    return {"context_fn": functools.partial(create_selective_checkpoint_contexts, plan.policy), **checkpoint_kwargs}


def _make_candidate_regions(model: nn.Module, blocks: list[tuple[str, nn.Module]]) -> None:
    """Make the blocks' attention, Linears and experts regions, as many of them as apply to the model."""
    for save in _CANDIDATES:
        try:
            make_regions(model, blocks, save)
        except ValueError:
            continue
        return


def _device(call: tuple[tuple[Any, ...], dict[str, Any]], model: nn.Module) -> torch.device:
    for t in tree_leaves(call):
        if isinstance(t, torch.Tensor):
            return t.device
    return next((p.device for p in model.parameters()), torch.device("cpu"))


class _Caught(Exception):
    """Raised by the pre-hook of the last block to catch, to end the model's forward there."""


def _block_inputs(
    model: nn.Module, blocks: list[tuple[str, nn.Module]], call: tuple[tuple[Any, ...], dict[str, Any]]
) -> list[tuple[tuple[Any, ...], dict[str, Any]]]:
    """What each block is called with when the model runs ``call``, detached: run without a graph (a forward with
    one would keep what no checkpointing keeps), after a run up to the first block that tells which inputs need
    gradients (the same positions need them in every block called alike)."""
    args, kwargs = call
    first = _catch(blocks[:1], lambda: model(*args, **kwargs))[0]
    needs = [isinstance(t, torch.Tensor) and t.requires_grad for t in tree_leaves(first)]
    with torch.no_grad():
        caught = _catch(blocks, lambda: model(*args, **kwargs))
    return [_detached(got, needs if len(tree_leaves(got)) == len(needs) else None) for got in caught]


def _detached(got: Any, needs: list[bool] | None) -> Any:
    """Detached copies of the tensors in ``got``, needing gradients where ``needs`` says, leaf by leaf (None: the
    floating-point ones do)."""
    flags = iter(needs) if needs is not None else None

    def one(x: Any) -> Any:
        need = next(flags) if flags is not None else True
        if isinstance(x, torch.Tensor):
            return x.detach().requires_grad_(need and x.is_floating_point())
        return x

    return tree_map(one, got)


def _catch(
    blocks: list[tuple[str, nn.Module]], run: Callable[[], object]
) -> list[tuple[tuple[Any, ...], dict[str, Any]]]:
    """The (args, kwargs) each of ``blocks`` is first called with while ``run()`` runs; it stops at the last."""
    caught: dict[int, tuple[tuple[Any, ...], dict[str, Any]]] = {}

    def hook(i: int, _module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        caught.setdefault(i, (args, kwargs))
        if len(caught) == len(blocks):
            raise _Caught

    handles = [b.register_forward_pre_hook(functools.partial(hook, i), with_kwargs=True)
               for i, (_, b) in enumerate(blocks)]
    try:
        run()
    except _Caught:
        pass
    finally:
        for h in handles:
            h.remove()
    missing = [fqn for i, (fqn, _) in enumerate(blocks) if i not in caught]
    if missing:
        raise ValueError(messages.apply_ac_block_not_called(missing[0]))
    return [caught[i] for i in range(len(blocks))]
