"""torch.distributed's activation-checkpoint wrappers, which live under a private module path.

Removable when torch exposes ``checkpoint_wrapper``, ``CheckpointImpl`` and ``ActivationWrapper`` publicly.
"""

from __future__ import annotations

import types
from typing import Any, Callable

import torch

from sac2 import messages

__all__ = [
    "CheckpointImpl", "register_activation_wrapper", "is_checkpoint_wrapper", "wrap_policy_targets",
    "torch_wrapper_function", "child_module",
]


_wrappers: types.ModuleType | None
try:
    import torch.distributed.algorithms._checkpoint.checkpoint_wrapper as _wrappers
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl
except ImportError:  # torch built without distributed: same members, so user code reads the same
    import enum as _enum

    _wrappers = None
    # The stand-in for the class torch's stubs always have.
    CheckpointImpl = _enum.Enum("CheckpointImpl", ["REENTRANT", "NO_REENTRANT"])  # type: ignore[no-redef]


def register_activation_wrapper(cls: type, kind: str) -> None:
    """Make ``isinstance(m, torch's <kind>)`` hold for a sac2 wrapper class (``kind``: ``ActivationWrapper``,
    ``CheckpointWrapper`` or ``OffloadWrapper``; torch's are ABCs), so torch code that checks for or looks through
    activation wrappers (FSDP's ``.module``, ``apply_activation_checkpointing``'s own tests) accepts ours.

    Removable: the wrapper module moves to a public path.
    """
    if _wrappers is not None:
        getattr(_wrappers, kind).register(cls)


def is_checkpoint_wrapper(module: torch.nn.Module) -> bool:
    """Whether ``module`` is a checkpoint wrapper, torch's or sac2's (registered as torch's, see
    ``register_activation_wrapper``; without torch.distributed, one keeping its child where torch's does).

    Removable: the wrapper module moves to a public path.
    """
    if _wrappers is not None:
        return isinstance(module, _wrappers.CheckpointWrapper)
    return "_checkpoint_wrapped_module" in module._modules


def child_module(module: torch.nn.Module, name: str) -> torch.nn.Module:
    """``module``'s child ``name``, read from the dict where torch keeps children rather than through
    ``nn.Module.__getattr__``: one dict read in eager, and no guards on the parent's parameter and buffer dicts
    when dynamo traces it (an activation wrapper's forward, on every call of compiled code).

    Removable: never: ``nn.Module._modules`` is where torch keeps children; read here, in one package.
    """
    return module._modules[name]  # type: ignore[return-value]


def wrap_policy_targets(policy: object, root: torch.nn.Module) -> dict[torch.nn.Module, dict[str, Any]]:
    """The modules an FSDP ``_Policy`` object (``CustomPolicy``) selects under ``root``, each with its kwargs.

    Removable: FSDP's ``_Policy`` exposes its selection publicly.
    """
    run = getattr(policy, "_run_policy", None)
    if run is None:
        raise ValueError(messages.not_a_wrap_policy(policy))
    targets: dict[torch.nn.Module, dict[str, Any]] = run(root, ignored_modules=set(), root_kwargs={})
    return targets


def torch_wrapper_function(name: str) -> Callable[..., Any] | None:
    """torch's ``checkpoint_wrapper`` or ``apply_activation_checkpointing`` (None without torch.distributed).

    Removable: the wrapper module moves to a public path.
    """
    try:
        import torch.distributed.algorithms._checkpoint.checkpoint_wrapper as module
    except ImportError:
        return None
    function: Callable[..., Any] = getattr(module, name)
    return function
