"""The texts of a recompute that ran other ops than its forward (divergence), and of values a policy saves
that sac2 recomputes instead, since it could not keep them (writes it cannot see or copy back, writes after the
save).

Raised or warned by ``sac2.modes.forward``, ``sac2.record.record`` and ``sac2.record.regions``.
"""

from __future__ import annotations

__all__ = [
    "RecomputeDiverged", "DIVERGED", "diverged", "recompute_diverged", "recompute_ran_past_forward",
    "recompute_ended_early", "region_diverged", "regions_ended_early", "unseen_writes", "overlapping_write",
    "stale_in_forward", "stale_after_region", "saved_output_modified",
]


# --- divergence: recompute ran other ops than forward -------------------------------------------------------------


class RecomputeDiverged(RuntimeError):
    """A recompute ran other ops (or regions) than its forward did: a ``RuntimeError``, which ``debug=True`` explains
    as torch explains its own non-determinism errors (``sac2.frame.frame``)."""


DIVERGED = (
    "The checkpointed function must run the same ops in backward as in forward: look for control flow that "
    "depends on global state, on data that changed since forward, or on whether a tensor requires grad, and for "
    "state the function updates as it runs, such as a KV cache (Hugging Face models: pass use_cache=False when "
    "training with checkpointing)."
)

_FRESH = "aten.lift_fresh"


def diverged(forward_op: str) -> str:
    """The advice for a divergence at an op forward ran (its name): ``DIVERGED``, led by the likely cause where the
    op says.

    ``lift_fresh`` is ``torch.tensor(...)`` from Python data: a forward that made one where recompute did not was
    setting up state on its first call, as a KV cache does (transformers' ``DynamicCache``)."""
    if forward_op.startswith(_FRESH):
        return (
            "Forward built a tensor from Python data here (torch.tensor) and recompute did not: the function keeps "
            "state across calls that it set up in forward, such as a KV cache filled on its first call. Hugging "
            "Face models build a DynamicCache in train mode unless use_cache=False: pass use_cache=False (or set "
            "model.config.use_cache = False) when training with checkpointing. " + DIVERGED
        )
    return DIVERGED


def recompute_diverged(i: int, forward_ran: str, recompute_ran: str, advice: str) -> str:
    return (
        f"sac2: recompute diverged from forward at op {i} of the region: forward ran "
        f"{forward_ran}, recompute ran {recompute_ran}. {advice}"
    )


def recompute_ran_past_forward(op: str, i: int, n: int) -> str:
    return f"sac2: recompute ran {op} as op {i} of the region, but the forward ran only {n} ops. {DIVERGED}"


def recompute_ended_early(cursor: int, n: int, missing: str) -> str:
    return (
        f"sac2: recompute ended after {cursor} ops, but the forward ran {n}; the first op missing is "
        f"{missing}. {DIVERGED}"
    )


def region_diverged(i: int, forward_ran: str, region: str) -> str:
    return (
        f"sac2: recompute diverged from forward at op {i} of the region: forward ran {forward_ran}, recompute ran "
        f"region {region!r}. {DIVERGED}"
    )


def regions_ended_early(cursor: int, n: int, missing: str) -> str:
    return (
        f"sac2: recompute ended after {cursor} regions, but the forward ran {n}; the first one missing is "
        f"{missing}. {DIVERGED}"
    )


# --- saved values sac2 cannot keep --------------------------------------------------------------------------------


def unseen_writes(op: str) -> str:
    return (
        f"sac2: the policy saves {op}, which returns nothing yet takes tensors, so it can only have "
        f"written into them in ways sac2 cannot see or write back; it is recomputed in backward instead of saved."
    )


def overlapping_write(op: str) -> str:
    return (
        f"sac2: the policy saves {op}, which wrote into a tensor whose elements overlap in memory (an "
        f"expanded view), so what it wrote cannot be copied back; it is recomputed in backward instead of saved. "
        f"Have the policy recompute it, or write into a contiguous tensor, to silence this warning."
    )


def stale_in_forward(position: str, wrote: bool) -> str:
    return (
        f"sac2: the policy saves {position}, but a tensor it {'wrote' if wrote else 'returned'} was modified in "
        f"place later in the forward, so the saved value is stale; sac2 recomputes this op in backward instead. "
        f"Have the policy recompute it to silence this warning."
    )


def stale_after_region(position: str) -> str:
    return (
        f"sac2: the policy saves {position}, but a tensor it returned or wrote was modified in "
        f"place after it ran, so the saved value is stale; sac2 runs the region again in backward instead. "
        f"Have the policy recompute it to silence this warning."
    )


def saved_output_modified(position: str) -> str:
    return (
        "one of the variables needed for gradient computation has been modified by an inplace operation: "
        f"sac2: the output of {position} that selective checkpointing saved was "
        f"modified in place after the checkpointed forward ended, so serving it would give wrong "
        f"gradients. Don't modify the region's outputs in place, have the policy recompute this op, "
        f"or pass allow_cache_entry_mutation=True to recompute it in backward."
    )
