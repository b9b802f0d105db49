"""The forward mode while torch.compile traces a checkpointed region: tag each traced node with the policy.

No eager-only bookkeeping runs on fake or functional tensors. Every op is recorded so that recompute, traced
too, is served from the record (as in torch's SAC), and each FX node the op adds is tagged with the policy's
answer (``node.meta["recompute"]``); AOTAutograd's partitioner decides from the tags. Ignored ops are tagged
PREFER_RECOMPUTE and not recorded. A traced-through ``sac2.region`` (dynamo inlines it inside an annotation) is
one op for the policy: every node in it gets the answer for its ``Region``.
"""

from __future__ import annotations

from typing import Any, Protocol

from sac2 import _compat
from sac2.core import keys
from sac2.core.decisions import CheckpointPolicy
from sac2.core.opinfo import IGNORE, OpInfo
from sac2.record.record import Record
from sac2.record.saved import Saved

__all__ = ["Tracer", "Deciding"]


class Deciding(Protocol):
    """What the tracer needs of the forward mode it traces for (``CachingMode``): its record, the policy's answers and
    the graph torch traces it into. A protocol, so ``sac2.modes.forward`` and this module do not import each other."""

    record: Record
    ac_graph_id: int | None

    def decide(
        self, func: _compat.Op, op: OpInfo, args: tuple[Any, ...], kwargs: dict[str, Any], out: object, call_index: int
    ) -> CheckpointPolicy: ...

    def ask(
        self, key: keys.PolicyOp, args: tuple[Any, ...], kwargs: dict[str, Any], out: object, call_index: int
    ) -> CheckpointPolicy: ...


class Tracer:
    """Traces the ops of one forward for its ``CachingMode``."""

    def __init__(self, mode: Deciding) -> None:
        self.mode = mode
        self._span: tuple[str, CheckpointPolicy] | None = None  # the traced-through region the last op was in

    def op(self, func: _compat.Op, op: OpInfo, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        mode, log = self.mode, self.mode.record.log
        key = keys.replay_key(func, args)
        region = _compat.traced_region()

        def policy_of(out: object) -> CheckpointPolicy:
            if op.kind == IGNORE:
                return CheckpointPolicy.PREFER_RECOMPUTE
            if region is None:
                self._span = None
                policy = mode.decide(func, op, args, kwargs, out, len(log))
            else:
                policy = self._region_policy(region, len(log))
            entry = Saved(key)
            entry.keep_traced(out)
            log.append(entry)
            return policy

        if mode.ac_graph_id is None:  # traced without a graph to tag (fake propagation, AOT's metadata pass)
            out = func(*args, **kwargs)
            policy_of(out)
            return out
        return _compat.tag_traced_nodes(lambda: func(*args, **kwargs), mode.ac_graph_id, policy_of)

    def _region_policy(self, name: str, call_index: int) -> CheckpointPolicy:
        """The answer for a traced-through region, asked once per run of consecutive ops in it (the region's
        arguments are not known there: the policy gets none)."""
        if self._span is None or self._span[0] != name:
            self._span = (name, self.mode.ask(keys.Region(name), (), {}, None, call_index))
        return self._span[1]
