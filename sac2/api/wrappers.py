"""Module-level checkpointing: torch's ``checkpoint_wrapper`` API on sac2's checkpoint, and a composable form.

``checkpoint_wrapper``, ``CheckpointWrapper``, ``offload_wrapper`` and ``apply_activation_checkpointing`` take the
arguments of their namesakes in ``torch.distributed.algorithms._checkpoint.checkpoint_wrapper`` and produce
modules with the same state-dict keys, so checkpoints move freely between wrapped and unwrapped models and between
torch's wrapper and sac2's. ``checkpoint_module`` checkpoints a module in place without a wrapper, keeping every
qualified name as it was, and pickles (``torch.save(model)``).

A sac2 wrapper whose forward runs inside another non-reentrant checkpoint's forward (HF's gradient checkpointing,
an outer wrapper) would be recomputed twice in backward: it warns once, naming the module and the fix.

``CheckpointImpl`` is torch's enum. ``NO_REENTRANT`` (the default) is ``sac2.checkpoint``: selective policies via
``context_fn``. ``REENTRANT`` runs torch's reentrant checkpoint, which recomputes the whole module and cannot
apply a policy, so a ``context_fn`` with it is rejected when the wrapper is built.
"""

from __future__ import annotations

import functools
import warnings
import weakref
from typing import Any, Callable, Iterator, TypeVar

import torch
from torch import nn
from torch.compiler import is_compiling

from sac2 import _compat, messages
from sac2._compat import (
    child_module,  # not read through ``_compat``, which sac2.api.checkpointing's compiled path reads too
)
from sac2.api.checkpointing import checkpoint
from sac2.regions import module_class

__all__ = [
    "ActivationWrapper",
    "CheckpointImpl",
    "CheckpointWrapper",
    "OffloadWrapper",
    "checkpoint_wrapper",
    "offload_wrapper",
    "apply_activation_checkpointing",
    "checkpoint_module",
]

CheckpointImpl = _compat.CheckpointImpl
_WRAPPED = "_checkpoint_wrapped_module"
_PREFIX = _WRAPPED + "."


class ActivationWrapper(nn.Module):
    """Holds the module as ``_checkpoint_wrapped_module`` and hides that name from state dicts and parameter names.

    The base of ``CheckpointWrapper`` and ``OffloadWrapper``; torch's ``ActivationWrapper`` counts it as one of its
    own (``isinstance``). Attributes and indexing the wrapper lacks are the wrapped module's.

    Args:
        module: the module to wrap.
    """

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self._checkpoint_wrapped_module = module
        self.register_state_dict_post_hook(_strip_prefix)
        self.register_load_state_dict_pre_hook(_add_prefix)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._checkpoint_wrapped_module, name)

    def __getitem__(self, key: object) -> Any:
        # The wrapped module indexes if its class does (nn.Sequential, ModuleList, ModuleDict, the user's own):
        # nn.Module's stubs declare no __getitem__.
        return self._checkpoint_wrapped_module[key]  # type: ignore[index]

    def named_parameters(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, nn.Parameter]]:
        """Parameter names as the unwrapped model has them (every ``_checkpoint_wrapped_module.`` removed)."""
        for name, param in super().named_parameters(*args, **kwargs):
            yield name.replace(_PREFIX, ""), param


def _strip_prefix(  # a state_dict post-hook: torch passes every argument by position
    _module: nn.Module, state_dict: dict[str, Any], prefix: str, _local_metadata: dict[str, Any]
) -> None:
    _replace_prefix(state_dict, prefix + _PREFIX, prefix)


def _add_prefix(_module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
    _replace_prefix(state_dict, prefix, prefix + _PREFIX)


def _replace_prefix(state_dict: dict[str, Any], old: str, new: str) -> None:
    """Rename the keys under ``old`` to live under ``new``, in place and keeping the order of the keys."""
    items = list(state_dict.items())
    state_dict.clear()
    for key, value in items:
        state_dict[new + key[len(old) :] if key.startswith(old) else key] = value


class CheckpointWrapper(ActivationWrapper):
    """Runs the wrapped module under ``sac2.checkpoint`` (or ``checkpoint_fn``) with ``checkpoint_fn_kwargs``.

    Build it with ``checkpoint_wrapper``. Keyword arguments of the module's forward work with every
    ``checkpoint_impl``.

    Args:
        mod: the module to wrap.
        checkpoint_impl: ``CheckpointImpl.NO_REENTRANT`` (the default) runs ``sac2.checkpoint``;
            ``CheckpointImpl.REENTRANT`` runs torch's reentrant checkpoint, which recomputes the whole module.
            Ignored when ``checkpoint_fn`` is given.
        checkpoint_fn: a function called as ``checkpoint_fn(module, *args, **checkpoint_fn_kwargs, **kwargs)``
            in place of ``sac2.checkpoint``; default (None) ``sac2.checkpoint``.
        **checkpoint_fn_kwargs: options for the checkpoint function (``context_fn``, ``preserve_rng_state``,
            ...), bound once here.

    Raises:
        ValueError: ``CheckpointImpl.REENTRANT`` without ``checkpoint_fn``, with a ``context_fn``.
    """

    def __init__(
        self,
        mod: nn.Module,
        checkpoint_impl: CheckpointImpl = CheckpointImpl.NO_REENTRANT,
        checkpoint_fn: Callable[..., Any] | None = None,
        **checkpoint_fn_kwargs: Any,
    ) -> None:
        super().__init__(mod)
        self.checkpoint_impl = checkpoint_impl
        reentrant = checkpoint_fn is None and checkpoint_impl == CheckpointImpl.REENTRANT
        if reentrant and "context_fn" in checkpoint_fn_kwargs:
            raise ValueError(messages.WRAPPER_REENTRANT_WITH_POLICY)
        if checkpoint_fn is None:
            checkpoint_fn = functools.partial(checkpoint, use_reentrant=reentrant)
        self.checkpoint_fn = functools.partial(checkpoint_fn, **checkpoint_fn_kwargs)
        self._reentrant = reentrant

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        module = child_module(self, _WRAPPED)
        if self._reentrant and kwargs:
            # Reentrant checkpoint passes only positional arguments through autograd.Function.
            names = tuple(kwargs)

            def run(*flat: Any) -> Any:
                n = len(flat) - len(names)
                return module(*flat[:n], **dict(zip(names, flat[n:], strict=True)))

            return self.checkpoint_fn(run, *args, *kwargs.values())
        _warn_if_nested(module)
        return self.checkpoint_fn(module, *args, **kwargs)


class OffloadWrapper(ActivationWrapper):
    """Keeps the wrapped module's activations in pinned CPU memory between forward and backward.

    Each forward runs under torch's ``save_on_cpu(pin_memory=True)``: no recompute, host memory and transfers
    instead. Build it with ``offload_wrapper``.

    Args:
        module: the module to wrap.
    """

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with torch.autograd.graph.save_on_cpu(pin_memory=True):
            return self._checkpoint_wrapped_module(*args, **kwargs)


_compat.register_activation_wrapper(ActivationWrapper, "ActivationWrapper")
_compat.register_activation_wrapper(CheckpointWrapper, "CheckpointWrapper")
_compat.register_activation_wrapper(OffloadWrapper, "OffloadWrapper")


_warned_nested: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def _warn_if_nested(module: nn.Module) -> None:
    """Warn, once per module, when it is about to be checkpointed inside another checkpoint's forward."""
    if is_compiling() or module in _warned_nested or not _compat.in_checkpoint_forward():
        return
    _warned_nested.add(module)
    warnings.warn(messages.nested_checkpoint(module), stacklevel=3)


def checkpoint_wrapper(
    module: nn.Module,
    checkpoint_impl: CheckpointImpl = CheckpointImpl.NO_REENTRANT,
    checkpoint_fn: Callable[..., Any] | None = None,
    **checkpoint_fn_kwargs: Any,
) -> nn.Module:
    """Wrap ``module`` so each call runs under ``sac2.checkpoint(module, *args, **checkpoint_fn_kwargs)``.

    ``checkpoint_fn_kwargs`` are those of ``sac2.checkpoint``: ``context_fn`` for a selective policy,
    ``preserve_rng_state``, ``determinism_check``, ``debug``, ``early_stop``. A ``checkpoint_fn`` replaces
    ``sac2.checkpoint`` (and ``checkpoint_impl`` is then ignored), as in torch. State-dict keys and parameter
    names stay those of ``module``.

    Args:
        module: the module to wrap.
        checkpoint_impl: ``CheckpointImpl.NO_REENTRANT`` (the default) is ``sac2.checkpoint``;
            ``CheckpointImpl.REENTRANT`` runs torch's reentrant checkpoint, which cannot apply a policy.
        checkpoint_fn: replaces ``sac2.checkpoint``, called as ``checkpoint_fn(module, *args, **kwargs)`` with
            ``checkpoint_fn_kwargs``; default (None) ``sac2.checkpoint``.
        **checkpoint_fn_kwargs: the checkpoint function's options, passed on every call.

    Returns:
        A ``CheckpointWrapper`` around ``module``.

    Raises:
        ValueError: ``CheckpointImpl.REENTRANT`` (without ``checkpoint_fn``) with a ``context_fn``.
    """
    return CheckpointWrapper(module, checkpoint_impl, checkpoint_fn, **checkpoint_fn_kwargs)


def offload_wrapper(module: nn.Module) -> nn.Module:
    """Wrap ``module`` so its activations are offloaded to pinned CPU memory (torch's ``save_on_cpu``).

    Args:
        module: the module to wrap.

    Returns:
        An ``OffloadWrapper`` around ``module``.
    """
    return OffloadWrapper(module)


def apply_activation_checkpointing(
    model: nn.Module,
    checkpoint_wrapper_fn: Callable[..., nn.Module] = checkpoint_wrapper,
    check_fn: Callable[[nn.Module], bool] = lambda _: True,
    auto_wrap_policy: Callable[..., bool] | object = None,
) -> None:
    """Replace, in place, each submodule of ``model`` that ``check_fn`` selects by ``checkpoint_wrapper_fn(it)``.

    Children are wrapped before their parents; the root is never wrapped (wrap it yourself). An
    ``auto_wrap_policy`` from ``torch.distributed.fsdp.wrap`` (``ModuleWrapPolicy``, ``CustomPolicy``, a
    ``functools.partial`` of ``lambda_auto_wrap_policy`` or ``size_based_auto_wrap_policy``) replaces ``check_fn``.
    torch's function of the same name, with ``sac2.checkpoint_wrapper`` as the default wrapper.

    Args:
        model: the model to change in place (never wrapped itself).
        checkpoint_wrapper_fn: called with each selected submodule, returns its replacement; default
            ``sac2.checkpoint_wrapper`` (bind options with ``functools.partial``).
        check_fn: selects the submodules to wrap; the default selects every one.
        auto_wrap_policy: an FSDP wrap policy that selects instead of ``check_fn``; ``CustomPolicy`` may also
            give per-module keyword arguments for ``checkpoint_wrapper_fn``. Default None: ``check_fn`` selects.

    Raises:
        ValueError: ``auto_wrap_policy`` is neither callable nor an FSDP wrap policy.
    """
    if auto_wrap_policy is None:
        _post_order_wrap(model, check_fn, checkpoint_wrapper_fn)
    elif callable(auto_wrap_policy):
        _auto_wrap(model, auto_wrap_policy, checkpoint_wrapper_fn)
    else:
        targets = _compat.wrap_policy_targets(auto_wrap_policy, model)
        _post_order_wrap(model, lambda m: m in targets, lambda m: checkpoint_wrapper_fn(m, **targets[m]))


def _post_order_wrap(
    root: nn.Module, select: Callable[[nn.Module], bool], wrapper_fn: Callable[[nn.Module], nn.Module]
) -> None:
    """Visit each module below ``root`` once, children first; replace it in its parent by ``wrapper_fn(it)``."""
    seen = {root}

    def visit(module: nn.Module) -> None:
        for name, child in list(module.named_children()):
            if child in seen:
                continue
            seen.add(child)
            visit(child)
            if select(child):
                setattr(module, name, wrapper_fn(child))

    visit(root)


def _auto_wrap(root: nn.Module, policy: Callable[..., object], wrapper_fn: Callable[[nn.Module], nn.Module]) -> None:
    """FSDP's auto-wrap protocol: ``policy(module=, recurse=True, nonwrapped_numel=)`` says whether to look inside
    a module, ``recurse=False`` whether to wrap it, given the parameter elements not inside a wrapped child."""

    def numel(module: nn.Module) -> int:
        return sum(p.numel() for p in module.parameters())

    def visit(module: nn.Module, total: int) -> int | None:
        """Wrap below ``module``; the parameter elements now inside wrappers, or None if not looked into."""
        if not policy(module=module, recurse=True, nonwrapped_numel=total):
            return None
        wrapped = 0
        for name, child in list(module.named_children()):
            child_total = numel(child)
            inside = visit(child, child_total)
            if inside is None:
                continue
            if policy(module=child, recurse=False, nonwrapped_numel=child_total - inside):
                setattr(module, name, wrapper_fn(child))
                inside = child_total
            wrapped += inside
        return wrapped

    visit(root, numel(root))


def _checkpointed_forward(self: nn.Module, forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    _warn_if_nested(self)
    options: dict[str, Any] = vars(self)["_sac2_checkpoint_kwargs"]  # set by checkpoint_module
    # ``forward``: the class's function (not bound: see ``module_class.wrapping``), called with the module first
    return checkpoint(forward, self, *args, **options, **kwargs)


module_class.register_kind("Checkpointed", module_class.wrapping(_checkpointed_forward, bound=False))


_M = TypeVar("_M", bound=nn.Module)


def checkpoint_module(
    module: _M,
    *,
    context_fn: _compat.ContextFn = _compat.noop_context_fn,
    **checkpoint_kwargs: Any,
) -> _M:
    """Checkpoint every call of ``module`` in place: no wrapper, so parameter names and state-dict keys stay as
    they were. Returns ``module``.

    The module's class becomes a subclass of its class (``Checkpointed<Name>``, still an instance of the original)
    whose forward runs the original forward under ``sac2.checkpoint(..., context_fn=context_fn,
    **checkpoint_kwargs)``. Forward hooks of the module itself run once, outside the checkpoint; hooks of its
    submodules run again in recompute. ``fully_shard`` and ``torch.compile`` work on the result, and it pickles
    (``torch.save``/``torch.load(weights_only=False)``) when ``context_fn`` does.

    Args:
        module: the module to checkpoint, changed in place.
        context_fn: the checkpoint's ``context_fn``, e.g.
            ``functools.partial(sac2.create_selective_checkpoint_contexts, policy)``; the default, torch's
            ``noop_context_fn``, is full activation checkpointing.
        **checkpoint_kwargs: other options of ``sac2.checkpoint`` (``preserve_rng_state``, ...).

    Returns:
        ``module`` itself, now of the ``Checkpointed<Name>`` class.

    Raises:
        ValueError: ``module`` is already checkpointed by ``checkpoint_module``; ``use_reentrant=True``.
    """
    if getattr(module, "_sac2_checkpoint_kwargs", None) is not None:
        raise ValueError(messages.already_checkpointed(module))
    if checkpoint_kwargs.get("use_reentrant"):
        raise ValueError(messages.CHECKPOINT_MODULE_REENTRANT)
    # In the instance's dict, as an attribute assignment puts it (nn.Module's stubs type attributes as tensors).
    vars(module)["_sac2_checkpoint_kwargs"] = {"context_fn": context_fn, **checkpoint_kwargs}
    module_class.swap_class(module, "Checkpointed")
    return module
