"""torchtitan: apply its activation-checkpointing classes (``FullAC``, ``SelectiveAC``) with sac2's modes.

torchtitan 0.3.0's ``torchtitan.distributed.activation_checkpoint`` wraps each block with its module-level name
``ptd_checkpoint_wrapper`` and, for ``SelectiveAC``, a ``context_fn=lambda: create_selective_checkpoint_contexts(
policy)`` that looks ``create_selective_checkpoint_contexts`` up in that module on every forward. ``apply_ac`` runs
the class's own ``apply`` under ``sac2.integrations.install()``; the wrappers it builds are sac2's and keep sac2's
``create_selective_checkpoint_contexts`` after the installation ends.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from torch import nn

from sac2 import messages
from sac2.api.wrappers import CheckpointWrapper
from sac2.integrations.rebinding import install

__all__ = ["apply_ac"]


@runtime_checkable
class _AC(Protocol):
    """torchtitan's ``ActivationCheckpointing`` (torchtitan is untyped): what sac2 calls of it."""

    def apply(self, model: nn.Module) -> object: ...


@runtime_checkable
class _ACConfig(Protocol):
    """Its ``Config``, which builds one."""

    def build(self, *, dump_folder: str) -> _AC: ...


def apply_ac(ac: _AC | _ACConfig, model: nn.Module, *, dump_folder: str = "") -> list[str]:
    """Apply torchtitan's activation checkpointing ``ac`` to ``model`` with sac2; return the wrapped blocks' names.

    ``ac`` is an ``ActivationCheckpointing`` instance (``FullAC``, ``SelectiveAC``, a subclass) or its ``Config``
    (built with ``dump_folder``). Every block of ``model.layers`` becomes a ``sac2.CheckpointWrapper``; a class
    that wraps nothing (``MemoryBudgetAC`` only sets the compiler's memory budget) raises ``ValueError``, as does
    a block left unwrapped or wrapped by something other than sac2.
    """
    if not isinstance(ac, _AC) and isinstance(ac, _ACConfig):  # as hasattr(ac, "apply"), hasattr(ac, "build")
        ac = ac.build(dump_folder=dump_folder)
    with install():
        ac.apply(model)
    layers = model.get_submodule("layers")
    wrapped: list[str] = []
    other: list[str] = []
    for name, block in layers.named_children():
        (wrapped if isinstance(block, CheckpointWrapper) else other).append(f"layers.{name}")
    if other:
        raise ValueError(messages.torchtitan_blocks_unwrapped(ac, other))
    return wrapped
