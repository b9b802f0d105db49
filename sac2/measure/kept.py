"""``sac2.activation_memory``: the bytes one checkpointed call keeps for backward under a policy, counted from what
sac2's record holds and autograd saves around it (a measurement: it runs the call once, without backward)."""

from __future__ import annotations

from typing import Any, Callable

import torch

from sac2.api.checkpointing import checkpoint
from sac2.core.decisions import Policy, as_policy
from sac2.modes.forward import CachingMode
from sac2.modes.replay import ReplayMode
from sac2.policies.profile import as_inputs, outside_storages, storage_key
from sac2.record.record import Record
from sac2.record.saved import Saved

__all__ = ["activation_memory"]

Tensor = torch.Tensor


def activation_memory(fn: Callable[..., Any], example_inputs: Any, policy: Policy) -> int:
    """Bytes kept for backward when ``fn(*example_inputs)`` runs under ``sac2.checkpoint`` with ``policy``.

    Counts unique storages of what the checkpoint's record saves plus what autograd saves outside the
    checkpoint, excluding parameters and inputs (anything that existed before the forward). Runs no backward.

    Args:
        fn: the function or module to run.
        example_inputs: its positional arguments (a tuple or list); one tensor alone is one argument.
        policy: a policy callable or a list of ops to save, as ``sac2.create_selective_checkpoint_contexts``
            takes.

    Returns:
        The bytes of the unique storages kept for backward.

    Raises:
        ValueError: ``policy`` is a list holding something that is not an op or a ``sac2.Region``.
        TypeError: ``policy`` is neither callable nor a list; the policy answered something other than a
            ``CheckpointPolicy`` or a bool.
    """
    inputs = as_inputs(example_inputs)
    before = outside_storages(fn, inputs)
    records: list[Record] = []

    def context_fn() -> tuple[CachingMode, ReplayMode]:
        record = Record()
        records.append(record)
        return CachingMode(as_policy(policy), record), ReplayMode(record)

    outside: dict[int, int] = {}

    def pack(t: Tensor) -> Tensor:
        outside[storage_key(t)] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        # The hooks here only count what autograd saves outside sac2's record: sac2's own saves bypass them.
        out = checkpoint(fn, *inputs, use_reentrant=False, context_fn=context_fn, respect_saved_tensors_hooks=False)
    kept = dict(outside)
    for record in records:
        for entry in record.log:
            if type(entry) is Saved:
                for t in entry.tensors:
                    kept[storage_key(t)] = t.untyped_storage().nbytes()
    del out
    return sum(n for k, n in kept.items() if k not in before)
