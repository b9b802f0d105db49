"""A client module written for torch's checkpoint API: it binds torch's names at import, before any
``sac2.install()``, as frameworks do. ``install()`` finds and rebinds the bindings of the functions it replaces
(``create_selective_checkpoint_contexts``, ``checkpoint_wrapper``); ``checkpoint`` stays torch's function and
``CheckpointWrapper`` torch's class, and run sac2's frame underneath while installed."""

from __future__ import annotations

import functools
from typing import Any

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper, checkpoint_wrapper
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

__all__ = ["context", "call", "wrap"]


def context(policy: Any, plain: bool) -> dict[str, Any]:
    """``context_fn`` for ``policy`` through torch's create_selective_checkpoint_contexts: a partial, or a plain
    function when ``plain``; none for full AC (``policy`` None)."""
    if policy is None:
        return {}
    if plain:
        return {"context_fn": lambda: create_selective_checkpoint_contexts(policy)}
    return {"context_fn": functools.partial(create_selective_checkpoint_contexts, policy)}


def call(kwargs: dict[str, Any], layer: nn.Module, x: Any) -> Any:
    """``layer(x)`` under torch's checkpoint, with ``context(...)``'s keyword arguments."""
    return checkpoint(layer, x, use_reentrant=False, **kwargs)


def wrap(kwargs: dict[str, Any], layer: nn.Module, with_class: bool) -> nn.Module:
    """``layer`` wrapped by torch's ``checkpoint_wrapper`` function, or its ``CheckpointWrapper`` class."""
    if with_class:
        return CheckpointWrapper(layer, **kwargs)
    return checkpoint_wrapper(layer, **kwargs)
