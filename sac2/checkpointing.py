"""The drop-in entry points: ``checkpoint`` and ``create_selective_checkpoint_contexts``.

``checkpoint`` hands the frame work (saved-tensor hooks, RNG and autocast replay, early stop, the determinism
check, debug traces) to torch's non-reentrant checkpoint, which is public and which dynamo turns into its
``tag_activation_checkpoint`` HOP under torch.compile. sac2 supplies what decides what is kept: the two modes.
"""

from __future__ import annotations

from typing import Any, Callable, ContextManager

import torch.utils.checkpoint as _tuc

from sac2 import _compat
from sac2.modes import CachingMode, ReplayMode
from sac2.record import Record
from sac2.answers import as_policy

__all__ = ["checkpoint", "create_selective_checkpoint_contexts"]


def create_selective_checkpoint_contexts(
    policy_fn_or_list: Any, allow_cache_entry_mutation: bool = False
) -> tuple[CachingMode, ReplayMode]:
    """sac2's (forward, recompute) dispatch modes for a policy function or a list of ops to save.

    A policy is called as ``policy_fn(ctx, op, *args, **kwargs)`` once per op in forward (``ctx.op_output`` holds
    the op's output) and returns a ``CheckpointPolicy`` or a bool (True saves). A list saves exactly its ops.
    One ``ctx`` serves every op of one checkpointed forward (torch makes one per op): a policy can keep
    per-forward state keyed by it, but must read ``ctx.op_output`` during its call.
    The pair works as ``context_fn`` for ``sac2.checkpoint`` and for ``torch.utils.checkpoint.checkpoint``.

    ``allow_cache_entry_mutation=True``: a saved output modified in place after the checkpointed forward is
    recomputed in backward instead of raising. (Modifications inside the forward are always handled that way.)
    """
    record = Record()
    return CachingMode(as_policy(policy_fn_or_list), record), ReplayMode(record, allow_cache_entry_mutation)


def checkpoint(
    function: Callable[..., Any],
    *args: Any,
    use_reentrant: bool | None = None,
    context_fn: Callable[[], tuple[ContextManager, ContextManager]] = _compat.noop_context_fn,
    determinism_check: str = "default",
    debug: bool = False,
    early_stop: bool = True,
    **kwargs: Any,
) -> Any:
    """Checkpoint ``function(*args, **kwargs)``: keep what ``context_fn``'s policy saves, recompute the rest.

    Same signature and semantics as ``torch.utils.checkpoint.checkpoint`` with ``use_reentrant=False``, which is
    also sac2's default (``None`` means False, without torch's warning). ``use_reentrant=True`` runs torch's
    reentrant checkpoint, which recomputes everything and cannot apply a policy, so it rejects ``context_fn``.
    ``preserve_rng_state`` (default True) is accepted as a keyword, as in torch.
    """
    if use_reentrant:
        if context_fn is not _compat.noop_context_fn:
            raise ValueError(
                "sac2.checkpoint: use_reentrant=True recomputes the whole function and cannot apply a selective "
                "policy; drop use_reentrant (sac2 defaults to False) to use context_fn."
            )
        return _tuc.checkpoint(function, *args, use_reentrant=True, debug=debug, **kwargs)
    return _tuc.checkpoint(
        function,
        *args,
        use_reentrant=False,
        context_fn=context_fn,
        determinism_check=determinism_check,
        debug=debug,
        early_stop=early_stop,
        **kwargs,
    )
