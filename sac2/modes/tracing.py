"""The forward mode while torch.compile traces a checkpointed region: tag each traced node with the policy.

No eager-only bookkeeping runs on fake or functional tensors. Every op is recorded so that recompute, traced
too, is served from the record (as in torch's SAC), and each FX node the op adds is tagged with the policy's
answer (``node.meta["recompute"]``); AOTAutograd's partitioner decides from the tags. Ignored ops are tagged
PREFER_RECOMPUTE and not recorded. A traced-through ``sac2.region`` (dynamo inlines it inside an annotation) is
one op for the policy: every node in it gets the answer for its ``Region``, but for the nodes of a saved region that
only rebuild its inputs (``Rebuilds``).
"""

from __future__ import annotations

import weakref
from typing import Any, Protocol

import torch

from sac2 import _compat
from sac2.core import keys
from sac2.core.decisions import SAVING, CheckpointPolicy
from sac2.core.opinfo import IGNORE, OpInfo
from sac2.record.record import Record
from sac2.record.saved import Saved

__all__ = ["Tracer", "Deciding", "Rebuilds"]


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


class Rebuilds:
    """Which ops of one traced-through saved region only rebuild its inputs, as eager's saved region does.

    Eager, a saved region keeps its outputs and what its body saves for backward, but a save that is (a view of) one
    of its inputs is rebuilt in recompute from the replayed input (``sac2.record.region_saves``). Traced, the
    partitioner sees only nodes: tagged MUST_SAVE, a view or copy of an input (the keys and values ``repeat_kv``
    expands and reshapes for grouped-query attention) would be kept as a tensor of its own, bigger than the input
    it repeats. So an op whose output only re-presents its input's values (a view, ``clone``, ``_unsafe_view``:
    ``OpInfo.free``), on tensors the region did not compute itself (its inputs, or what such ops made of them), is
    left to recompute; the partitioner keeps what it needs to rebuild them instead. What the region computes stays
    saved, and so does a view or copy of it (which may be smaller than what it views).
    """

    __slots__ = ("_made",)

    def __init__(self) -> None:
        self._made: dict[int, weakref.ref[torch.Tensor]] = {}  # what the region computed, by id

    def rebuilds(self, free: bool, args: tuple[Any, ...], kwargs: dict[str, Any], out: object) -> bool:
        """Whether an op of the region (``free``: its ``OpInfo.free``) only rebuilds the region's inputs; if not,
        its tensor outputs are the region's own from now on."""
        if free and not any(self._computed(t) for t in _compat.tree_leaves((args, kwargs))):
            return True
        for t in _compat.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._made[id(t)] = weakref.ref(t)
        return False

    def _computed(self, t: object) -> bool:
        held = self._made.get(id(t))
        return held is not None and held() is t


class Tracer:
    """Traces the ops of one forward for its ``CachingMode``."""

    def __init__(self, mode: Deciding) -> None:
        self.mode = mode
        self._span: tuple[str, CheckpointPolicy] | None = None  # the traced-through region the last op was in
        self._rebuilds = Rebuilds()  # of the span's region, when saved

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
                if policy in SAVING and self._rebuilds.rebuilds(op.free, args, kwargs, out):
                    policy = CheckpointPolicy.PREFER_RECOMPUTE
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
            self._rebuilds = Rebuilds()
        return self._span[1]
