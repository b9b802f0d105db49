"""The setups ``sac2.advise`` measures (``Candidate``): no checkpointing, full AC, ``apply_ac`` selective with
``llm()``, stock SAC with the same list as the reference, the one-line regions choices, offload where it moves tensors
(full AC with each block's inputs in host memory, and with its attention kept there too: what docs/offload.md's
``hidden`` check offloads), and a memory budget solved for the user's target (``budget_candidate``). Each is one line
of code, and that line as a function applied to a copy of the model. ``block_memory_budget``, the op-level budget of
the first block that 0.4's budget rows printed, stays.
"""

from __future__ import annotations

import copy
import functools
import json
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.utils.checkpoint as tuc
from torch import nn

from sac2 import messages
from sac2._compat import tree_map
from sac2.api.apply import apply_ac
from sac2.policies import llm
from sac2.policies.budget import MemoryBudget, memory_budget

__all__ = [
    "Candidate", "block_memory_budget", "candidates_for", "budget_candidate", "call", "as_inputs", "STOCK_CODE",
]


@dataclass(frozen=True)
class Candidate:
    """One setup: its name, the one line of code that sets it up on ``model``, and that line as a function applied
    in place to a copy of the model (``prepare``). ``reference``: shown for comparison, never recommended.
    ``offload``: it keeps tensors in host memory (``apply_ac(offload=...)``), so it runs only where offload moves
    them (an accelerator: ``sac2.offload.link.offloads``)."""

    name: str
    code: str
    prepare: Callable[[nn.Module], object]
    reference: bool = False
    offload: bool = False


#: The reference row's line: each block under torch's own checkpoint and SAC contexts with ``llm()``.
STOCK_CODE = (
    "sac2.apply_ac(model, checkpoint_fn=functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=False), "
    "context_fn=functools.partial(torch.utils.checkpoint.create_selective_checkpoint_contexts, sac2.policies.llm()))"
)


def _stock_sac(model: nn.Module) -> None:
    """``STOCK_CODE``: the reference row."""
    apply_ac(model, checkpoint_fn=functools.partial(tuc.checkpoint, use_reentrant=False),
             context_fn=functools.partial(tuc.create_selective_checkpoint_contexts, llm()))


def _regions(save: list[str]) -> Callable[[nn.Module], object]:
    return lambda model: apply_ac(model, "regions", save=save)


def _offload(targets: list[str]) -> Callable[[nn.Module], object]:
    return lambda model: apply_ac(model, "full", offload=targets)


class _Captured(Exception):
    """Raised by the pre-hook that caught the first block's inputs, to end that forward early."""


def call(model: nn.Module, inputs: Any) -> Any:
    """``model`` called on ``inputs`` as ``as_inputs`` made them."""
    if isinstance(inputs, dict):
        return model(**inputs)
    return model(*inputs)


def as_inputs(example_inputs: Any) -> Any:
    """A tensor alone is one positional input; a dict holds keyword inputs; a list or tuple positional ones."""
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,)
    if isinstance(example_inputs, list):
        return tuple(example_inputs)
    return example_inputs


def block_memory_budget(model: nn.Module, example_inputs: Any, budget: float | int) -> MemoryBudget:
    """``sac2.policies.memory_budget`` profiled on the first block ``apply_ac`` would wrap, with the inputs that
    block gets when ``model`` runs on ``example_inputs`` (caught by a forward pre-hook; the forward stops there).

    Use it as ``sac2.apply_ac(model, policy=block_memory_budget(model, example_inputs, 0.5))``: the policy is asked
    per checkpointed block, and the blocks of a stack run the same ops. Costs are FLOP estimates, so the same model
    gets the same decisions every time. ``sac2.apply_ac(model, memory_budget=0.5)`` does more in one line: it
    profiles every kind of block, not the first alone, and chooses between this op-level policy, regions and full
    AC with what each costs on the device.
    """
    fqn = apply_ac(copy.deepcopy(model), "full")[0]  # the blocks apply_ac finds, in order: take the first
    block = model.get_submodule(fqn)
    caught: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    def hook(_module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        caught.append((args, kwargs))
        raise _Captured

    handle = block.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        call(model, as_inputs(example_inputs))
    except _Captured:
        pass
    finally:
        handle.remove()
    if not caught:
        raise ValueError(messages.advise_block_never_called(fqn))

    def detached(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return x.detach().requires_grad_(x.requires_grad and x.is_floating_point())
        return x

    args, kwargs = tree_map(detached, caught[0])
    return memory_budget(functools.partial(block, **kwargs), args, budget, cost="flops")


def candidates_for(model: nn.Module, example_inputs: Any) -> list[Candidate]:  # noqa: ARG001 (public; no setup reads it yet)
    """Every built-in candidate setup, no checkpointing first; ``advise`` skips those that do not apply to the model
    (``apply_ac`` raises: e.g. ``save=["experts"]`` on a model without experts) and the offload rows where offload
    moves nothing (no accelerator). The memory budget row is not among them: ``advise`` solves it for the target
    once it has measured no checkpointing and full AC (``BUDGET``)."""
    out = [
        Candidate("none", "# no checkpointing", lambda _model: None),
        Candidate("full AC", 'sac2.apply_ac(model, mode="full")', lambda model: apply_ac(model, "full")),
        Candidate("selective llm()", 'sac2.apply_ac(model, mode="selective")  # sac2.policies.llm()',
                  lambda model: apply_ac(model, "selective")),
        Candidate("stock SAC llm()", STOCK_CODE, _stock_sac, reference=True),
    ]
    for save in (["attention"], ["attention", "linear", "experts"], ["linear"], ["experts"]):  # 2nd: the default
        out.append(Candidate(f"regions {'+'.join(save)}",
                             f'sac2.apply_ac(model, mode="regions", save={json.dumps(save)})', _regions(save)))
    for moved in (["inputs"], ["inputs", "attention"]):
        out.append(Candidate(f"offload {'+'.join(moved)}",
                             f'sac2.apply_ac(model, mode="full", offload={json.dumps(moved)})', _offload(moved),
                             offload=True))
    return out


def budget_candidate(fraction: float, example_inputs: Any) -> Candidate:
    """The row of ``sac2.apply_ac(model, memory_budget=fraction)`` (profiled on ``example_inputs``, as the printed
    line profiles on the model's first forward)."""
    return Candidate(f"budget {fraction:g}", f"sac2.apply_ac(model, memory_budget={fraction:g})",
                     functools.partial(_apply_budget, example_inputs=example_inputs, fraction=fraction))


def _apply_budget(model: nn.Module, example_inputs: Any, fraction: float) -> None:
    apply_ac(model, memory_budget=fraction, example_inputs=example_inputs)
