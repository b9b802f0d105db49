"""Which generator an op draws from and how it moved: what a saved random op restores when it is served, and
what a recomputed one draws from again."""

from __future__ import annotations

from typing import Any

import torch

from sac2 import _compat

__all__ = ["rng_before", "rng_moved", "GeneratorState"]

Tensor = torch.Tensor
#: (generator, its state before the call, its state after it).
GeneratorState = tuple[torch.Generator, Tensor, Tensor]


def rng_before(
    info_random: bool, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[torch.Generator, Tensor] | None:
    """The generator a random op or HOP is about to draw from, and its state now (None for ops that draw nothing)."""
    if not info_random:
        return None
    gen: torch.Generator = kwargs.get("generator") or _compat.default_generator(_device_of(args, kwargs))
    return gen, gen.get_state()


def rng_moved(before: tuple[torch.Generator, Tensor] | None) -> GeneratorState | None:
    """(generator, state before the call, state after it), or None when the call drew nothing (a region or HOP
    without random ops), which then costs nothing to serve."""
    if before is None:
        return None
    gen, state = before
    after = gen.get_state()
    return None if torch.equal(after, state) else (gen, state, after)


def _device_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.device:
    for x in args:
        if isinstance(x, Tensor):
            return x.device
    device = kwargs.get("device")
    return torch.device(device) if device is not None else torch.device("cpu")
