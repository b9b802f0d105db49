"""What sac2's frame asks of a selective policy's (forward, recompute) pair of contexts, written as protocols.

Any pair a ``context_fn`` returns runs (torch's SAC modes, the user's own). sac2's own pairs (its dispatch modes,
``sac2.modes``, and the dispatch-free region contexts, ``sac2.record.regions``) also meet these protocols, and the frame
then does more with them: it tells the forward context which user saved-tensor hooks what it saves goes through (frame
rule 7), asks it whether the checkpoint's inputs go to host memory (rule 9) and whether it saved anything (torch's
FutureWarning), and early stop asks the replay which op to finish first. The frame imports no mode and no record: these
protocols are the whole contract.
"""

from __future__ import annotations

from typing import Callable, Protocol, cast, runtime_checkable

from sac2 import _compat

__all__ = ["SelectiveForward", "FinishingReplay", "selective", "finishing"]


@runtime_checkable
class SelectiveForward(Protocol):
    """A selective policy's forward context that keeps what it saves itself (sac2's)."""

    #: The user's saved-tensor hooks what it saves goes through, or None: set by the frame before it enters.
    saved_tensors_hooks: _compat.HookPair | None
    #: Whether the checkpoint's inputs go to host memory (``sac2.offload``): read by the frame as it starts.
    offload_inputs: bool

    def saves_anything(self) -> bool:
        """Whether the forward saved something (asked once it ended)."""
        ...


@runtime_checkable
class FinishingReplay(Protocol):
    """A recompute context that may let the op saving the last tensor finish before early stop (sac2's replay
    mode: an op that writes into that tensor must have written it)."""

    def finish_op(self, stop: Callable[[], BaseException]) -> bool:
        """Finish the op under way, then raise ``stop()``; False when the frame should stop at once."""
        ...


#: Per (protocol, class): whether the class's instances meet the protocol. A protocol's own ``isinstance`` reads
#: every member on every call (microseconds, per checkpointed call); the frame asks once per class.
_meets: dict[tuple[type, type], bool] = {}


def _meets_protocol(protocol: type, context: object) -> bool:
    key = (protocol, type(context))
    meets = _meets.get(key)
    if meets is None:
        meets = _meets[key] = isinstance(context, protocol)
    return meets


def selective(context: object) -> SelectiveForward | None:
    """``context`` as a ``SelectiveForward`` if its class is one (sac2's forward contexts), else None."""
    return cast(SelectiveForward, context) if _meets_protocol(SelectiveForward, context) else None


def finishing(context: object) -> FinishingReplay | None:
    """``context`` as a ``FinishingReplay`` if its class is one (sac2's replay mode), else None."""
    return cast(FinishingReplay, context) if _meets_protocol(FinishingReplay, context) else None
