"""Regions in a model you did not write: chosen module calls and attention calls become ``sac2.region`` calls.

``sac2.apply_ac(model, mode="regions", save=...)`` uses this to checkpoint each block with a save list of only
``sac2.Region``s, which needs no dispatch mode (``sac2.record.regions``): the ops between regions run at eager
speed.

What ``save`` can name, inside each block:

- ``"attention"``: the attention call. A transformers model's attention interface (SDPA, flex, eager, ...) is
  registered again as a region (``sac2_<implementation>``) and the model switched to it; otherwise the block's
  attention kernel modules (modules without parameters whose class name ends in ``Attention``: torchtitan's
  ``ScaledDotProductAttention``/``FlexAttention``/``VarlenAttention``, ``sac2.bench.models``') are made regions.
- ``"linear"``: every ``nn.Linear`` (subclasses too); ``"experts"``: the matmul calls inside MoE expert modules
  (class name ends in ``Experts``: transformers' ``Qwen3MoeExperts``/``MixtralExperts``, torchtitan's
  ``GroupedExperts``; experts holding experts, as torchtitan's ``RoutedExperts``, give the inner ones), each a
  call of one region named for the module (``sac2.regions.matmuls``), so saving them keeps what saving their matmuls
  op by op keeps;
- a module class: its instances; any other string: a name (dot-separated globs) matching the last parts of module
  names relative to the block, by ``sac2.core.module_names``' rule (``"mlp.down_proj"``, ``"*_proj"``). Each such
  module's call is one region: saved, it keeps its body's backward state too (for an experts module named this way, the
  gathered tokens and activations: more memory than ``"experts"``, no experts op again in recompute).

A module becomes a region in place (its class is swapped for ``Region<Name>``, or ``Matmuls<Name>`` for experts:
parameter names, state-dict keys and hooks stay), named by its name relative to the block, so one ``sac2.Region``
covers the same module in every block.
"""

from __future__ import annotations

import sys
from typing import Any, Callable, Collection, Iterable, Sequence

from torch import nn

from sac2 import messages
from sac2._compat import is_checkpoint_wrapper
from sac2.core.keys import Region
from sac2.core.module_names import names_module
from sac2.regions import module_class
from sac2.regions.calls import call_region, module_region, region_key
from sac2.regions.matmuls import matmuls_as_regions

__all__ = [
    "ATTENTION", "LINEAR", "EXPERTS", "DEFAULT_SAVE", "Target", "make_regions", "unmake_regions", "region_keys",
    "region_name_of",
]

ATTENTION, LINEAR, EXPERTS = "attention", "linear", "experts"
#: What ``mode="regions"`` saves by default: every matmul and attention, ``llm()``'s choice made in regions. It
#: keeps what stock SAC with ``llm()`` keeps and takes less time on the bench configs and client models (README,
#: ``benchmarks/clients_regions.py``); attention alone keeps less but recomputes every matmul, which costs more
#: than stock SAC where the matmuls dominate (``sac2 bench --config small``).
DEFAULT_SAVE: tuple[Target, ...] = (ATTENTION, LINEAR, EXPERTS)

Target = str | type


def _matmuls_forward(self: nn.Module, forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    return matmuls_as_regions(region_key(vars(self)["_sac2_region"]), forward, args, kwargs)


#: The two kinds of module region (``module_class`` kinds): the module's call, or its matmul calls (experts).
REGION, MATMULS = "Region", "Matmuls"
module_class.register_kind(REGION, module_region)
module_class.register_kind(MATMULS, module_class.wrapping(_matmuls_forward))
#: What ``make_regions`` chose inside the blocks, by "block fqn.relative name": (relative name, module, kind), or
#: None for transformers' attention interface (a region already).
Chosen = dict[str, tuple[str, nn.Module, str] | None]


def region_name_of(module: nn.Module) -> str | None:
    """The region a module's calls are (set by ``make_regions``), or None."""
    name: str | None = vars(module).get("_sac2_region")
    return name


def _matches(target: Target, name: str, module: nn.Module) -> bool:
    if isinstance(target, type):
        return isinstance(module, target)
    if target == LINEAR:
        return isinstance(module, nn.Linear)
    if target == EXPERTS:
        return type(module).__name__.endswith("Experts")
    return names_module(target, name)


def _holds_experts(module: nn.Module, targets: list[Target], matched: list[int]) -> bool:
    """Whether ``module`` matched only as experts and holds experts of its own (the inner ones are the region)."""
    if any(targets[i] != EXPERTS for i in matched):
        return False
    return any(_matches(EXPERTS, n, m) for n, m in module.named_modules() if n)


def _is_attention_kernel(module: nn.Module) -> bool:
    return type(module).__name__.endswith("Attention") and next(module.parameters(), None) is None


def _check_targets(save: Iterable[object]) -> list[Target]:
    """``save`` as given by the user, checked: module classes and strings."""
    targets: list[Target] = []
    for t in save:
        if not (isinstance(t, str) or (isinstance(t, type) and issubclass(t, nn.Module))):
            raise TypeError(messages.regions_bad_target(t))
        targets.append(t)
    if not targets:
        raise ValueError(messages.REGIONS_NOTHING_TO_SAVE)
    return targets


def make_regions(model: nn.Module, blocks: Sequence[tuple[str, nn.Module]], save: Iterable[Target]) -> list[Region]:
    """Make the calls ``save`` names inside each block regions (in place); return the ``Region``s to save."""
    targets = _check_targets(save)
    modules = [t for t in targets if t != ATTENTION]
    chosen, hit = _matching_modules(blocks, modules)
    # A kind ("linear", "experts") may be absent (one config for dense and MoE models); a class or a glob is the
    # user's own and must match something, and so must the whole list.
    missed = [modules[i] for i in range(len(modules)) if i not in hit and (modules[i] not in (LINEAR, EXPERTS) or
                                                                          not hit)]
    if missed:
        raise ValueError(messages.pattern_matches_nothing(missed, blocks))
    if ATTENTION in targets:
        chosen.update(_attention(model, blocks))
    _refuse_nesting(chosen)
    return [region_key(n) for n in sorted(_make_region_modules(chosen))]


def region_keys(blocks: Sequence[tuple[str, nn.Module]], targets: Iterable[Target]) -> list[Region]:
    """The regions ``make_regions`` made for ``targets`` inside ``blocks``, once it has run with them (or with more):
    which of a model's regions those targets name."""
    targets = list(targets)
    chosen, _ = _matching_modules(blocks, [t for t in targets if t != ATTENTION])
    names = {found[0] for found in chosen.values() if found is not None}
    if ATTENTION in targets:
        names.add(ATTENTION)
    return [region_key(n) for n in sorted(names)]


def unmake_regions(block: nn.Module, keep: Collection[str]) -> None:
    """Make the module regions inside ``block`` whose names are not in ``keep`` plain modules again (in place): a
    region no policy saves only costs its calls. A transformers attention interface stays a region."""
    for module in block.modules():
        name = region_name_of(module)
        if name is not None and name not in keep:
            del vars(module)["_sac2_region"]
            module_class.restore_class(module, REGION)
            module_class.restore_class(module, MATMULS)


def _matching_modules(blocks: Sequence[tuple[str, nn.Module]], modules: list[Target]) -> tuple[Chosen, set[int]]:
    """(each module inside a block that one of ``modules`` matches, with its kind: ``MATMULS`` where
    ``"experts"`` matched it, else ``REGION``; the indices of ``modules`` that matched something)."""
    chosen: Chosen = {}
    hit: set[int] = set()
    for block_name, block in blocks:
        for name, module in block.named_modules():
            if not name:
                continue
            matched = [i for i, t in enumerate(modules) if _matches(t, name, module)]
            if matched and _holds_experts(module, modules, matched):
                continue  # experts inside experts (torchtitan's RoutedExperts around GroupedExperts): the inner
            if matched:
                hit.update(matched)
                kind = MATMULS if any(modules[i] == EXPERTS for i in matched) else REGION
                chosen[f"{block_name}.{name}"] = (name, module, kind)
    return chosen, hit


def _make_region_modules(chosen: Chosen) -> set[str]:
    """Make each chosen module a region of its kind (in place); return the region names."""
    names = set()
    for found in chosen.values():
        if found is None:
            names.add(ATTENTION)  # the attention interface, made a region already
            continue
        name, module, kind = found
        _refuse(module, name)
        vars(module)["_sac2_region"] = name
        module_class.restore_class(module, MATMULS if kind == REGION else REGION)  # made the other kind before
        if not module_class.is_kind(module, kind):  # made a region before: renamed only
            module_class.swap_class(module, kind)
        names.add(name)
    return names


def _attention(model: nn.Module, blocks: Sequence[tuple[str, nn.Module]]) -> Chosen:
    """The attention calls as regions: a transformers model's attention interface, else the blocks' attention
    kernel modules (named ``attention``). Returns the modules to make regions (None for transformers)."""
    if _transformers_attention(model):
        return {"attention interface": None}
    kernels: Chosen = {
        f"{block_name}.{name}": (ATTENTION, module, REGION)
        for block_name, block in blocks
        for name, module in block.named_modules()
        if name and _is_attention_kernel(module)
    }
    if not kernels:
        raise ValueError(messages.NO_ATTENTION_CALL)
    return kernels


def _transformers_attention(model: nn.Module) -> bool:
    """Register the model's attention function again as a region and switch the model to it (transformers)."""
    config = getattr(model, "config", None)
    implementation = getattr(config, "_attn_implementation", None)
    set_implementation: Callable[[str], object] | None = getattr(model, "set_attn_implementation", None)
    if not isinstance(implementation, str) or set_implementation is None:
        return False
    if implementation.startswith("sac2_"):
        return True  # done before
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if implementation == "eager":  # each model family has its own eager function, beside the model class
        family = sys.modules[type(model).__module__]
        function = family.eager_attention_forward
        name = f"sac2_eager_{family.__name__.rsplit('.', 1)[-1]}"
    else:
        function = ALL_ATTENTION_FUNCTIONS.get_interface(implementation, None)
        name = f"sac2_{implementation}"
    key = region_key(ATTENTION)

    def attention(*args: Any, **kwargs: Any) -> Any:
        return call_region(key, function, args, kwargs)

    AttentionInterface.register(name, attention)
    # transformers builds the attention mask by the implementation's name too: the same mask as before.
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[implementation])
    set_implementation(name)
    return True


def _refuse_nesting(chosen: Chosen) -> None:
    names = sorted(chosen)
    for outer, inner in zip(names, names[1:], strict=False):
        if inner.startswith(outer + "."):
            raise ValueError(messages.nested_regions(inner, outer))


def _refuse(module: nn.Module, name: str) -> None:
    """Raise when a module cannot be a region, saying why."""
    if is_checkpoint_wrapper(module) or hasattr(module, "_sac2_checkpoint_kwargs"):
        raise ValueError(messages.region_is_checkpointed(name))
    inner = [n for n, m in module.named_modules() if n and is_checkpoint_wrapper(m)]
    if inner:
        raise ValueError(messages.region_holds_checkpoints(name, inner[:3]))
    if isinstance(module, (nn.ModuleList, nn.ModuleDict)):
        raise ValueError(messages.region_is_container(name, module))
    if "forward" in module.__dict__:
        raise ValueError(messages.region_forward_on_instance(name))
