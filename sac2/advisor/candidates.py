"""``sac2.advise``: what should I save for *my* model at *my* memory? Measure every checkpointing setup on it.

Each candidate setup (no checkpointing, full AC, ``apply_ac`` selective with ``llm()``, stock SAC with the same list as
the reference, one-line regions, memory budgets) gets its own deep copy of the user's model; they run on the same inputs
side by side in one process, taking turns step by step (``sac2.measure.rotation.turns``), as ``sac2 bench`` does. Step 0
of each measures memory (``sac2.measure.memory.measure_step``: kept = allocated by forward and alive when backward
starts) and is not timed; every step's loss and gradients are compared with no checkpointing's, bit for bit. The answer
(``sac2.advisor.advice.Advice``) holds the rows, the Pareto front of step time against kept bytes, and the fastest setup
whose kept bytes fit the memory target, with the one line of code that sets it up.
"""

from __future__ import annotations

import copy
import functools
import json
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.utils.checkpoint as tuc
from torch import nn

from sac2 import messages
from sac2._compat import tree_map
from sac2.advisor.advice import Advice, recommend
from sac2.api.apply import apply_ac
from sac2.measure.determinism import deterministic_kernels
from sac2.measure.rotation import turns
from sac2.measure.step import Progress, Result, grads_equal, take_step
from sac2.policies import llm
from sac2.policies.budget import MemoryBudget, memory_budget

__all__ = ["Candidate", "advise", "block_memory_budget", "candidates_for", "BUDGET_FRACTIONS", "DEFAULT_TARGET"]

#: The memory budgets tried, as fractions of what saving every op of a block keeps.
BUDGET_FRACTIONS = (0.3, 0.5, 0.7)
#: The memory target when none is given: half of what no checkpointing keeps.
DEFAULT_TARGET = 0.5

#: ``loss_fn(output)``: the scalar loss of the model's output.
LossFn = Callable[[Any], torch.Tensor]


@dataclass(frozen=True)
class Candidate:
    """One setup: its name, the one line of code that sets it up on ``model``, and that line as a function applied
    in place to a copy of the model (``prepare``). ``reference``: shown for comparison, never recommended."""

    name: str
    code: str
    prepare: Callable[[nn.Module], object]
    reference: bool = False




def _stock_sac(model: nn.Module) -> None:
    """Each block under torch's own checkpoint and SAC contexts with ``llm()``: the reference row."""
    context_fn = functools.partial(tuc.create_selective_checkpoint_contexts, llm())
    apply_ac(model, "full", checkpoint_fn=functools.partial(tuc.checkpoint, use_reentrant=False, context_fn=context_fn))


def _regions(save: list[str]) -> Callable[[nn.Module], object]:
    return lambda model: apply_ac(model, "regions", save=save)


class _Captured(Exception):
    """Raised by the pre-hook that caught the first block's inputs, to end that forward early."""


def _call(model: nn.Module, inputs: Any) -> Any:
    if isinstance(inputs, dict):
        return model(**inputs)
    return model(*inputs)


def _as_inputs(example_inputs: Any) -> Any:
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
    gets the same decisions every time.
    """
    fqn = apply_ac(copy.deepcopy(model), "full")[0]  # the blocks apply_ac finds, in order: take the first
    block = model.get_submodule(fqn)
    caught: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    def hook(_module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        caught.append((args, kwargs))
        raise _Captured

    handle = block.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        _call(model, _as_inputs(example_inputs))
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
    (``apply_ac`` raises: e.g. ``save=["experts"]`` on a model without experts)."""
    out = [
        Candidate("none", "# no checkpointing", lambda _model: None),
        Candidate("full AC", 'sac2.apply_ac(model, mode="full")', lambda model: apply_ac(model, "full")),
        Candidate("selective llm()", 'sac2.apply_ac(model, mode="selective")  # sac2.policies.llm()',
                  lambda model: apply_ac(model, "selective")),
        Candidate("stock SAC llm()", "torch.utils.checkpoint + torch's SAC contexts, sac2.policies.llm()",
                  _stock_sac, reference=True),
    ]
    for save in (["attention"], ["attention", "linear", "experts"], ["linear"], ["experts"]):  # 2nd: the default
        out.append(Candidate(f"regions {'+'.join(save)}",
                             f'sac2.apply_ac(model, mode="regions", save={json.dumps(save)})', _regions(save)))
    for fraction in BUDGET_FRACTIONS:
        out.append(Candidate(
            f"budget {fraction}",
            f"sac2.apply_ac(model, policy=sac2.advisor.block_memory_budget(model, example_inputs, {fraction}))",
            functools.partial(_apply_budget, example_inputs=example_inputs, fraction=fraction),
        ))
    return out


def _apply_budget(model: nn.Module, example_inputs: Any, fraction: float) -> None:
    apply_ac(model, policy=block_memory_budget(model, example_inputs, fraction))


def _default_loss(output: Any) -> torch.Tensor:
    """The output's ``.loss`` when it has one (transformers with labels), else the sum of its first tensor."""
    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    if isinstance(output, torch.Tensor):
        return output.float().sum()
    values = output.values() if isinstance(output, dict) else output  # transformers' outputs are dicts
    for v in values if isinstance(values, (tuple, list, type({}.values()))) else ():
        if isinstance(v, torch.Tensor):
            return v.float().sum()
    raise TypeError(messages.advise_no_loss(output))


def _target_bytes(memory_target: float | int | None, none_kept: int) -> int:
    target = DEFAULT_TARGET if memory_target is None else memory_target
    if isinstance(target, bool) or not isinstance(target, (int, float)):
        raise TypeError(messages.advise_bad_target(target))
    if isinstance(target, float):
        if not 0.0 < target <= 1.0:
            raise ValueError(messages.advise_bad_target(target))
        return int(target * none_kept)
    if target < 0:
        raise ValueError(messages.advise_bad_target(target))
    return target


def _select(candidates: Sequence[str | Candidate] | None, builtin: list[Candidate]) -> list[Candidate]:
    """The candidates to run, no checkpointing first (added when missing: every row is checked against it)."""
    if candidates is None:
        return builtin
    by_name = {c.name: c for c in builtin}
    chosen: list[Candidate] = []
    for c in candidates:
        if isinstance(c, Candidate):
            chosen.append(c)
        elif c in by_name:
            chosen.append(by_name[c])
        else:
            raise ValueError(messages.advise_unknown_candidate(c, list(by_name)))
    if not chosen or chosen[0].name != "none":
        chosen = [by_name["none"], *(c for c in chosen if c.name != "none")]
    return chosen


def advise(
    model: nn.Module,
    example_inputs: Any,
    *,
    loss_fn: LossFn | None = None,
    memory_target: float | int | None = None,
    steps: int = 3,
    device: torch.device | str | None = None,
    candidates: Sequence[str | Candidate] | None = None,
    progress: bool = True,
) -> Advice:
    """Measure every candidate setup on ``model`` and recommend the fastest whose kept bytes fit ``memory_target``.

    ``model`` itself is left untouched: each setup trains a deep copy, with no optimizer step, on the same inputs.
    One untimed step measures the memory each setup keeps for backward, then ``steps`` timed steps run the setups
    interleaved. Only setups whose gradients equal no checkpointing's bitwise are recommended; on CUDA every setup
    runs under ``torch.use_deterministic_algorithms(True)`` (``sac2.measure.determinism``), without which attention's
    backward differs from run to run. A setup that does not apply (e.g. a regions choice matching nothing:
    ``ValueError``) is skipped with the reason.

    Args:
        model: the model to measure (not changed).
        example_inputs: what ``model`` is called with (a tuple/list: positional, a dict: keyword, a tensor alone).
        loss_fn: ``loss_fn(output)`` gives the scalar loss; default (None) ``output.loss`` if present, else the
            sum of the output's first tensor.
        memory_target: bytes (an int), or a fraction in (0, 1] of what no checkpointing keeps; default (None)
            0.5.
        steps: timed steps per setup after the untimed step that measures memory (default 3).
        device: where to run; default (None) the device of the model's first parameter.
        candidates: names of built-in setups (``sac2.advisor.candidates_for``) or ``Candidate``s; default
            (None) every built-in setup. No checkpointing runs first whether named or not.
        progress: True (the default) shows a progress bar on stderr when it is a terminal.

    Returns:
        An ``Advice``: a row per setup that ran, the skipped setups, the Pareto front and the recommendation
        (``advice.code`` is its line of code).

    Raises:
        ValueError: ``steps`` is not a positive int; a name in ``candidates`` is not a built-in setup;
            ``memory_target`` is a float outside (0, 1] or a negative int.
        TypeError: ``memory_target`` is not a number; without ``loss_fn``, the output has no ``loss`` and no
            tensor.
    """
    if type(steps) is not int or steps < 1:
        raise ValueError(messages.advise_bad_steps(steps))
    dev = torch.device(device) if device is not None else next(model.parameters()).device
    inputs = tree_map(lambda x: x.to(dev) if isinstance(x, torch.Tensor) else x, _as_inputs(example_inputs))
    base = copy.deepcopy(model).to(dev)
    lossf = _default_loss if loss_fn is None else loss_fn
    chosen = _select(candidates, candidates_for(base, inputs))
    models: list[nn.Module] = []
    setups: list[Candidate] = []
    skipped: dict[str, str] = {}
    for c in chosen:
        m = copy.deepcopy(base)
        try:
            c.prepare(m)
        except (ValueError, TypeError) as e:
            skipped[c.name] = str(e).splitlines()[0]
            continue
        models.append(m)
        setups.append(c)
    results = [Result(c.name, c.code) for c in setups]
    bar = Progress((steps + 1) * len(setups)) if progress else None
    with deterministic_kernels(dev):  # on CUDA, so that the bitwise check can hold at all
        for step in range(steps + 1):
            losses: list[torch.Tensor] = [torch.empty(0)] * len(setups)
            for i in turns(step, len(setups)):
                models[i].zero_grad(set_to_none=True)
                forward = functools.partial(lambda m: lossf(_call(m, inputs)), models[i])
                losses[i] = take_step(forward, results[i], dev, step == 0)
                if bar is not None:
                    bar.step()
            for i in range(1, len(setups)):
                results[i].equal &= grads_equal(models[i], losses[i], models[0], losses[0], bitwise=True)
    target = _target_bytes(memory_target, results[0].kept_bytes)
    return recommend(results, [c.reference for c in setups], skipped, target, str(dev), steps)
