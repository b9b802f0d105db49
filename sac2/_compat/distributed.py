"""torch.distributed's activation-checkpoint wrappers, which live under a private module path.

Removable when torch exposes ``checkpoint_wrapper``, ``CheckpointImpl`` and ``ActivationWrapper`` publicly.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["CheckpointImpl", "register_activation_wrapper", "wrap_policy_targets", "torch_wrapper_function"]


try:
    import torch.distributed.algorithms._checkpoint.checkpoint_wrapper as _wrappers
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl
except ImportError:  # torch built without distributed: same members, so user code reads the same
    import enum as _enum

    _wrappers = None
    CheckpointImpl = _enum.Enum("CheckpointImpl", ["REENTRANT", "NO_REENTRANT"])  # type: ignore[misc]


def register_activation_wrapper(cls: type, kind: str) -> None:
    """Make ``isinstance(m, torch's <kind>)`` hold for a sac2 wrapper class (``kind``: ``ActivationWrapper``,
    ``CheckpointWrapper`` or ``OffloadWrapper``; torch's are ABCs), so torch code that checks for or looks through
    activation wrappers (FSDP's ``.module``, ``apply_activation_checkpointing``'s own tests) accepts ours.

    Removable: the wrapper module moves to a public path.
    """
    if _wrappers is not None:
        getattr(_wrappers, kind).register(cls)


def wrap_policy_targets(policy: Any, root: torch.nn.Module) -> dict:
    """The modules an FSDP ``_Policy`` object (``CustomPolicy``) selects under ``root``, each with its kwargs.

    Removable: FSDP's ``_Policy`` exposes its selection publicly.
    """
    run = getattr(policy, "_run_policy", None)
    if run is None:
        raise ValueError(f"sac2: auto_wrap_policy {policy!r} is neither callable nor an FSDP wrap policy.")
    return run(root, ignored_modules=set(), root_kwargs={})


def torch_wrapper_function(name: str) -> Any:
    """torch's ``checkpoint_wrapper`` or ``apply_activation_checkpointing`` (None without torch.distributed).

    Removable: the wrapper module moves to a public path.
    """
    try:
        import torch.distributed.algorithms._checkpoint.checkpoint_wrapper as module
    except ImportError:
        return None
    return getattr(module, name)
