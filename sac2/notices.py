"""What sac2 tells its user beyond return values: one-time warnings, the divergence advice, a forward counter."""

from __future__ import annotations

import warnings
from typing import Any

from sac2.answers import op_name

__all__ = [
    "warn_once", "DIVERGED", "diverged", "unseen_writes", "overlapping_write", "stale_in_forward", "count_forward",
    "forward_count",
]

_warned: set[tuple[str, str]] = set()
_forwards = 0

DIVERGED = (
    "The checkpointed function must run the same ops in backward as in forward: look for control flow that "
    "depends on global state, on data that changed since forward, or on whether a tensor requires grad, and for "
    "state the function updates as it runs, such as a KV cache (Hugging Face models: pass use_cache=False when "
    "training with checkpointing)."
)


_FRESH = "aten.lift_fresh"


def diverged(forward_op: Any) -> str:
    """The advice for a divergence at an op forward ran: ``DIVERGED``, led by the likely cause where the op says.

    ``lift_fresh`` is ``torch.tensor(...)`` from Python data: a forward that made one where recompute did not was
    setting up state on its first call, as a KV cache does (transformers' ``DynamicCache``)."""
    if op_name(forward_op).startswith(_FRESH):
        return (
            "Forward built a tensor from Python data here (torch.tensor) and recompute did not: the function keeps "
            "state across calls that it set up in forward, such as a KV cache filled on its first call. Hugging "
            "Face models build a DynamicCache in train mode unless use_cache=False: pass use_cache=False (or set "
            "model.config.use_cache = False) when training with checkpointing. " + DIVERGED
        )
    return DIVERGED


def unseen_writes(key: Any) -> str:
    return (
        f"sac2: the policy saves {op_name(key)}, which returns nothing yet takes tensors, so it can only have "
        f"written into them in ways sac2 cannot see or write back; it is recomputed in backward instead of saved."
    )


def overlapping_write(key: Any) -> str:
    return (
        f"sac2: the policy saves {op_name(key)}, which wrote into a tensor whose elements overlap in memory (an "
        f"expanded view), so what it wrote cannot be copied back; it is recomputed in backward instead of saved. "
        f"Have the policy recompute it, or write into a contiguous tensor, to silence this warning."
    )


def stale_in_forward(position: str, wrote: bool) -> str:
    return (
        f"sac2: the policy saves {position}, but a tensor it {'wrote' if wrote else 'returned'} was modified in "
        f"place later in the forward, so the saved value is stale; sac2 recomputes this op in backward instead. "
        f"Have the policy recompute it to silence this warning."
    )


def warn_once(kind: str, key: Any, message: str) -> None:
    """Warn once per (kind of warning, op) in this process."""
    seen = (kind, op_name(key))
    if seen not in _warned:
        _warned.add(seen)
        warnings.warn(message, stacklevel=3)


def count_forward() -> None:
    global _forwards
    _forwards += 1


def forward_count() -> int:
    """How many checkpointed forwards sac2 has run (or traced for torch.compile) in this process: forwards of its
    selective contexts, and ``sac2.checkpoint`` calls without a ``context_fn`` (full AC).

    A check that sac2, not torch's SAC, is doing the work: read it before and after a step.
    """
    return _forwards
