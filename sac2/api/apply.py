"""``apply_ac``: checkpoint every block of a transformer stack in one call."""

from __future__ import annotations

import functools
import warnings
from typing import Any, Callable, Iterable, Union

from torch import nn

from sac2 import messages
from sac2.api import offload_targets
from sac2.api.budgeted import apply_budget
from sac2.api.checkpointing import OPTIONS, create_selective_checkpoint_contexts
from sac2.api.wrappers import checkpoint_wrapper
from sac2.core.decisions import Policy, SaveList
from sac2.policies import llm
from sac2.policies.budget import check_budget
from sac2.regions.in_models import DEFAULT_SAVE, Target, make_regions

__all__ = ["apply_ac"]

Blocks = Union[nn.Module, Iterable[str], Callable[[nn.Module], bool], None]
_MODES = ("selective", "regions", "full", "none")


def apply_ac(
    model: nn.Module,
    mode: str = "selective",
    *,
    policy: Policy | None = None,
    save: Iterable[Target] | None = None,
    blocks: Blocks = None,
    every: int = 1,
    keep_inputs: bool = False,
    offload: Iterable[object] | None = None,
    memory_budget: float | int | None = None,
    example_inputs: Any = None,
    checkpoint_fn: Callable[..., Any] | None = None,
    **checkpoint_kwargs: Any,
) -> list[str]:
    """Wrap blocks of ``model`` in place with ``sac2.checkpoint_wrapper``; return the names of the wrapped blocks.

    One call for a transformer stack: it finds the blocks, builds the ``context_fn`` and wraps each block. Wrapped
    state dicts keep the unwrapped keys, so apply it before or after loading weights. Blocks that transformers
    already checkpoints (``gradient_checkpointing = True``) would be recomputed twice: it warns.

    Args:
        model: the model to change in place.
        mode: ``"selective"`` (the default) keeps what ``policy`` saves and recomputes the rest. ``"full"`` keeps
            only each block's inputs. ``"none"`` changes nothing. ``"regions"`` makes the calls ``save`` names
            inside each block regions, without editing the model's source, and keeps exactly those: the policy
            names only regions, so no dispatch mode runs and the ops between regions cost what they cost without
            checkpointing. A saved region keeps its outputs and the backward state its body makes; what its
            body saves of its own inputs (a Linear's input, attention's q/k/v) is rebuilt in recompute, as
            saving the same ops does.
        policy: ``mode="selective"`` only: a policy callable or a list of ops to save; default (None)
            ``sac2.policies.llm()``.
        save: ``mode="regions"`` only: what to make regions (``sac2.regions.in_models``: ``"attention"``,
            ``"linear"``, ``"experts"``, module classes, name globs); default (None)
            ``("attention", "linear", "experts")``.
        blocks: a container module of ``model`` (an ``nn.ModuleList``, ``nn.ModuleDict``, ``nn.Sequential`` or any
            module: its children are the blocks; ``model`` itself too), qualified module names, or a predicate (the
            outermost modules it accepts). Default (None): ``model.layers`` if it is a ``ModuleList``/``ModuleDict``,
            else the one such container of ``model`` with the most children, all of one class (an
            ``nn.Sequential``, ``model`` itself included, where there is no such container).
        every: wrap only the k-th, 2k-th, ... block for ``every=k`` (older torchtitan's
            ``selective_ac_option="k"`` is ``mode="full", every=k``); the others run without checkpointing. The
            default 1 wraps every block.
        keep_inputs: ``mode="regions"``: True keeps for real what a saved region's body saves of its own inputs,
            for inputs whose producer may not give the same values in recompute (nondeterministic kernels such
            as GPU atomics); it costs their memory. The default False rebuilds them in recompute (but for a
            region whose name keeps them: ``sac2.region(keep_inputs=True)``). It holds for this model's blocks
            only: another model's regions of the same names keep their own setting.
        offload: what to keep in pinned host memory between forward and backward instead of device memory, with
            the copies hidden behind compute (``sac2.offload``): ``"inputs"`` (each block's checkpoint inputs, what
            full AC keeps), region targets as ``save`` takes them (``"attention"``, ``"linear"``, module classes,
            name globs: made regions and saved whole), op overloads (their outputs). What it names is saved; the
            rest follows ``mode``. Default (None): nothing. On a machine without CUDA it changes nothing and warns
            once. Pinned memory and prefetch limits: ``sac2.offload_limits``.
        memory_budget: what the blocks may keep for backward, for ``mode="selective"`` in place of ``policy``: a
            number in [0, 1] is a fraction of what they keep without checkpointing (1: no more than training
            without checkpointing, as fast as that allows; 0: what full AC keeps), an int above 1 is bytes for all
            the wrapped blocks together. Every block is profiled on its own inputs (``sac2.policies.plan``), and
            each kind of block gets the fastest of full AC, saved regions with no dispatch mode, or an op-level
            ``sac2.policies.MemoryBudget``, with sac2's own per-decision costs measured on the device; where
            nothing a budget could keep pays, the blocks run full AC and a warning says so. Default None: no budget.
        example_inputs: what ``model`` is called with to profile a ``memory_budget`` (a tuple or list:
            positional, a dict: keyword, a tensor alone); default (None) the first forward the model runs, which
            then profiles before it runs, eagerly under torch.compile too (the blocks are wrapped from then on).
        checkpoint_fn: replaces ``sac2.checkpoint`` in each block's wrapper (``sac2.checkpoint_wrapper``'s
            option), e.g. ``functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=False)`` to run
            torch's own frame; default (None) ``sac2.checkpoint``.
        **checkpoint_kwargs: ``sac2.checkpoint``'s options for each block (``preserve_rng_state``,
            ``determinism_check``, ...; a ``context_fn`` here replaces the one ``policy`` makes), nothing else.

    Returns:
        The qualified names of the wrapped blocks, in model order (``[]`` for ``mode="none"``); with a
        ``memory_budget`` and no ``example_inputs``, the blocks the first forward wraps.

    Raises:
        ValueError: an unknown ``mode``; ``policy`` without ``mode="selective"``; ``save`` without
            ``mode="regions"``; ``memory_budget`` with another ``mode``, with ``policy``, ``keep_inputs=True`` or a
            ``context_fn``, or a negative one or a fraction above 1; ``example_inputs`` without ``memory_budget``;
            a block that does not run on the inputs a budget is profiled on; ``every`` not a positive int;
            ``blocks`` a container that is not a submodule of ``model``, a predicate that accepts no module, or a
            name of no submodule; no ``blocks`` given and ``model`` has no such container, or several of the same
            size; ``mode="regions"`` with a ``save``
            that is empty or matches nothing (a class or a glob; no attention call for ``"attention"``), or
            that would make regions sac2 refuses (nested, already checkpointed, holding checkpoints, containers);
            ``offload`` with ``mode="none"`` or a ``memory_budget``, empty, holding an ``OpOverloadPacket``, or
            naming regions that match nothing.
        TypeError: a keyword argument that is neither ``apply_ac``'s nor ``sac2.checkpoint``'s; ``blocks`` is one
            string rather than a list of names; a ``save`` entry is neither a string nor a module class;
            ``memory_budget`` is not a number; ``offload`` is one string, or holds something that is none of its
            targets.
    """
    unknown = [k for k in checkpoint_kwargs if k not in OPTIONS]
    if unknown:
        raise TypeError(messages.apply_ac_unknown_keywords(unknown, OPTIONS))
    if mode not in _MODES:
        raise ValueError(messages.apply_ac_bad_mode(mode, _MODES))
    if memory_budget is not None:
        check_budget(memory_budget)
        for clash, what in ((mode != "selective", f"mode={mode!r}"), (policy is not None, "policy="),
                            ("context_fn" in checkpoint_kwargs, "context_fn="), (keep_inputs, "keep_inputs=True")):
            if clash:
                raise ValueError(messages.apply_ac_budget_with(what))
        if offload is not None:
            raise ValueError(messages.APPLY_AC_BUDGET_WITH_OFFLOAD)
    elif example_inputs is not None:
        raise ValueError(messages.APPLY_AC_EXAMPLE_INPUTS_ALONE)
    if checkpoint_fn is not None:
        checkpoint_kwargs = {"checkpoint_fn": checkpoint_fn, **checkpoint_kwargs}
    if mode != "selective" and policy is not None:
        raise ValueError(messages.apply_ac_policy_needs_selective(mode))
    if mode != "regions" and save is not None:
        raise ValueError(messages.apply_ac_save_needs_regions(mode))
    if type(every) is not int or every < 1:
        raise ValueError(messages.apply_ac_bad_every(every))
    moved = offload_targets.parse(offload, mode)
    if mode == "none":
        return []
    found = _find_blocks(model, blocks)
    if memory_budget is not None:
        chosen_blocks = [f for i, f in enumerate(found) if (i + 1) % every == 0]
        _warn_if_hf_checkpointed(chosen_blocks)
        apply_budget(model, chosen_blocks, memory_budget, example_inputs, checkpoint_kwargs)
        return [fqn for _, _, fqn in chosen_blocks]
    pairs = [(fqn, getattr(parent, attr)) for parent, attr, fqn in found]
    if mode == "regions":
        chosen = DEFAULT_SAVE if save is None else save
        # A SaveList, not a list: torch.compile reads a policy object in a context_fn, not a list of Regions.
        made = make_regions(model, pairs, [*chosen, *moved.regions] if moved is not None else chosen)
        policy = SaveList(made, keep_inputs=keep_inputs)  # this model's setting: its own policy's, not its names'
    if moved is not None:
        policy = offload_targets.with_offload(model, pairs, mode, policy, moved)
    if mode in ("selective", "regions") or moved is not None:
        context_fn = functools.partial(create_selective_checkpoint_contexts, llm() if policy is None else policy)
        checkpoint_kwargs = {"context_fn": context_fn, **checkpoint_kwargs}
    _warn_if_hf_checkpointed(found)
    wrapped = []
    for i, (parent, attr, fqn) in enumerate(found):
        if (i + 1) % every == 0:
            setattr(parent, attr, checkpoint_wrapper(getattr(parent, attr), **checkpoint_kwargs))
            wrapped.append(fqn)
    return wrapped


def _warn_if_hf_checkpointed(blocks: list[tuple[nn.Module, str, str]]) -> None:
    """Warn when transformers' own gradient checkpointing is on for some of ``blocks`` (its layers' flag)."""
    modules = ((fqn, getattr(parent, attr)) for parent, attr, fqn in blocks)
    names = [fqn for fqn, m in modules if getattr(m, "gradient_checkpointing", False) is True]
    if names:
        warnings.warn(messages.apply_ac_checkpointed_twice(names), stacklevel=3)


def _find_blocks(model: nn.Module, blocks: Blocks) -> list[tuple[nn.Module, str, str]]:
    """(parent, attribute name, qualified name) of each block, in model order."""
    names = {id(m): fqn for fqn, m in model.named_modules()}
    if blocks is None:
        blocks = _default_container(model)
    if isinstance(blocks, nn.Module):  # a container, whatever its class (a module is callable: not a predicate)
        if id(blocks) not in names:
            raise ValueError(messages.APPLY_AC_CONTAINER_NOT_SUBMODULE)
        prefix = names[id(blocks)]
        return [(blocks, attr, f"{prefix}.{attr}" if prefix else attr) for attr, _ in blocks.named_children()]
    if isinstance(blocks, str):
        raise TypeError(messages.apply_ac_blocks_is_one_name(blocks))
    if callable(blocks):
        found, inside = [], ()
        for fqn, m in model.named_modules():
            if fqn and not fqn.startswith(inside) and blocks(m):
                found.append(fqn)
                inside = tuple(f + "." for f in found)
        if not found:
            raise ValueError(messages.APPLY_AC_PREDICATE_MATCHED_NOTHING)
        blocks = found
    result = []
    for fqn in blocks:
        parent_name, _, attr = fqn.rpartition(".")
        try:
            parent = model.get_submodule(parent_name)
            getattr(parent, attr)
        except AttributeError:
            raise ValueError(messages.apply_ac_no_such_submodule(fqn)) from None
        result.append((parent, attr, fqn))
    return result


def _containers(model: nn.Module, kinds: tuple[type[nn.Module], ...]) -> list[tuple[str, nn.Module]]:
    """The modules of ``kinds`` in ``model`` (itself included) with children, all of one class."""
    return [(fqn, m) for fqn, m in model.named_modules()
            if isinstance(m, kinds) and len(list(m.children())) and len({type(c) for c in m.children()}) == 1]


def _default_container(model: nn.Module) -> nn.Module:
    layers = getattr(model, "layers", None)
    if isinstance(layers, (nn.ModuleList, nn.ModuleDict)):
        return layers
    candidates = _containers(model, (nn.ModuleList, nn.ModuleDict)) or _containers(model, (nn.Sequential,))
    if not candidates:
        raise ValueError(messages.APPLY_AC_NO_CONTAINER)
    most = max(len(list(m.children())) for _, m in candidates)
    best = [(fqn, m) for fqn, m in candidates if len(list(m.children())) == most]
    if len(best) > 1:
        raise ValueError(messages.apply_ac_several_containers([fqn for fqn, _ in best]))
    return best[0][1]
