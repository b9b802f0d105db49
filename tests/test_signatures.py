"""Changing the import line is the whole migration: every drop-in API takes torch's parameters, in torch's order,
with torch's kinds and defaults."""

import inspect
from typing import Any, Callable

import pytest
import torch.distributed.algorithms._checkpoint.checkpoint_wrapper as torch_wrappers
import torch.utils.checkpoint as torch_checkpoint

import sac2

PAIRS = {
    "checkpoint": (sac2.checkpoint, torch_checkpoint.checkpoint),
    "create_selective_checkpoint_contexts": (
        sac2.create_selective_checkpoint_contexts,
        torch_checkpoint.create_selective_checkpoint_contexts,
    ),
    "checkpoint_wrapper": (sac2.checkpoint_wrapper, torch_wrappers.checkpoint_wrapper),
    "offload_wrapper": (sac2.offload_wrapper, torch_wrappers.offload_wrapper),
    "apply_activation_checkpointing": (
        sac2.apply_activation_checkpointing,
        torch_wrappers.apply_activation_checkpointing,
    ),
    "CheckpointWrapper": (sac2.CheckpointWrapper.__init__, torch_wrappers.CheckpointWrapper.__init__),
}


def _parameters(fn: Callable) -> list[tuple[str, Any, Any]]:
    """(name, kind, default) per parameter; a function default (e.g. a lambda) compares by its name."""
    return [
        (p.name, p.kind, getattr(p.default, "__name__", p.default) if callable(p.default) else p.default)
        for p in inspect.signature(fn).parameters.values()
    ]


@pytest.mark.parametrize("name", PAIRS)
def test_takes_torchs_parameters(name: str) -> None:
    ours, theirs = PAIRS[name]
    assert _parameters(ours) == _parameters(theirs)


def test_checkpoint_impl_is_torchs_own_enum() -> None:
    assert sac2.CheckpointImpl is torch_wrappers.CheckpointImpl
