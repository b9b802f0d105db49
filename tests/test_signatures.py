"""Changing the import line is the whole migration: every drop-in API takes torch's parameters, in torch's order,
with torch's kinds and defaults. ``checkpoint`` takes torch 2.14's on every supported torch."""

import inspect
from inspect import Parameter
from typing import Any, Callable

import pytest
import torch.distributed.algorithms._checkpoint.checkpoint_wrapper as torch_wrappers
import torch.utils.checkpoint as torch_checkpoint

import sac2

PAIRS: dict[str, tuple[Callable, Callable]] = {
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


#: torch 2.14+'s ``torch.utils.checkpoint.checkpoint``: a decorator without ``function``, ``preserve_rng_state`` as a
#: parameter, ``respect_saved_tensors_hooks``.
CHECKPOINT_2_14 = [
    ("function", Parameter.POSITIONAL_OR_KEYWORD, None),
    ("args", Parameter.VAR_POSITIONAL, "_empty"),
    ("use_reentrant", Parameter.KEYWORD_ONLY, None),
    ("preserve_rng_state", Parameter.KEYWORD_ONLY, True),
    ("context_fn", Parameter.KEYWORD_ONLY, "noop_context_fn"),
    ("determinism_check", Parameter.KEYWORD_ONLY, "default"),
    ("debug", Parameter.KEYWORD_ONLY, False),
    ("early_stop", Parameter.KEYWORD_ONLY, True),
    ("respect_saved_tensors_hooks", Parameter.KEYWORD_ONLY, None),
    ("kwargs", Parameter.VAR_KEYWORD, "_empty"),
]


def test_checkpoint_takes_torch_2_14s_parameters() -> None:
    assert _parameters(sac2.checkpoint) == CHECKPOINT_2_14


@pytest.mark.skipif(
    "respect_saved_tensors_hooks" not in inspect.signature(torch_checkpoint.checkpoint).parameters,
    reason="torch 2.13's checkpoint predates the 2.14 signature",
)
def test_checkpoint_takes_the_installed_torchs_parameters() -> None:
    assert _parameters(sac2.checkpoint) == _parameters(torch_checkpoint.checkpoint)


def test_checkpoint_impl_is_torchs_own_enum() -> None:
    assert sac2.CheckpointImpl is torch_wrappers.CheckpointImpl
