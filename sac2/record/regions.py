"""Region calls in the record: a region call is one entry, decided before it runs.

Saved, it runs with its backward state kept for real (but what recompute rebuilds from its inputs:
``sac2.record.region_saves``) and its outputs recorded; in recompute it is served (outputs, writes, generator) and
its body does not run. Recomputed, it runs under the checkpoint like any code and runs once more in recompute.
``record_region`` and ``replay_region`` do this for both sac2 modes and for the dispatch-free contexts
(``sac2.modes.region_contexts``).
"""

from __future__ import annotations

from typing import Any

from sac2 import _compat, messages
from sac2.core import writes
from sac2.core.decisions import op_name
from sac2.core.notices import warn_once
from sac2.core.rng import rng_before, rng_moved
from sac2.messages.internal import InternalError
from sac2.record import region_saves
from sac2.record.record import Record
from sac2.record.region_call import RegionCall
from sac2.record.saved import Saved

__all__ = ["record_region", "replay_region"]


def record_region(record: Record, call: RegionCall, save: bool, offload: bool, keep_inputs: bool = False) -> Any:
    """Run a region call in forward and append its entry to ``record``: its key, or a ``Saved`` entry.
    ``keep_inputs``: the policy's (``SaveList.keep_inputs``); saved, the region keeps its inputs for real."""
    key, args, kwargs = call.key, call.args, call.kwargs
    if not save:
        out = call.run()
        record.log.append(key)
        return out
    before = writes.tensor_versions(args, kwargs)
    rng = None
    if not call.pure:  # a matmul or Linear on plain tensors draws nothing: no generator state to read
        with _compat.no_modes():
            rng = rng_before(True, args, kwargs)
    forward = record.region_forward
    if forward is None:  # both forward contexts start it on entry
        raise InternalError(messages.internal_error(messages.NOT_IN_FORWARD))
    out, rebuilt = region_saves.run_saved(call, before, forward, keep_inputs)
    entry = Saved(key)
    entry.rebuilt = rebuilt
    written = [] if call.pure else writes.writes_of(key, args, kwargs, out, before)  # a pure call writes nothing
    entry.keep_region(out, written)
    if rng is not None:
        with _compat.no_modes():
            entry.rng = rng_moved(rng)  # recompute skips the region: skip the numbers it drew, too
    if written is None:
        warn_once("unseen-writes", key, messages.unseen_writes(op_name(key)))
    record.add_region(entry, out, offload)
    return out


def replay_region(record: Record, i: int, call: RegionCall) -> Any:
    """The region call at position ``i`` of recompute: serve what forward saved, else run it."""
    key, args, kwargs = call.key, call.args, call.kwargs
    log = record.log
    entry = log[i] if i < len(log) else None
    if entry is key:
        return call.run()
    if type(entry) is not Saved or entry.key is not key:
        ran = record.describe(i) if entry is not None else f"only {len(log)} ops"
        raise messages.RecomputeDiverged(messages.region_diverged(i, ran, key.name))
    if entry.unseen_writes:
        return region_saves.rerun(entry, call)  # forward kept its backward state (but what it rebuilds)
    if entry.modified():
        warn_once("modified-after-region", key, messages.stale_after_region(record.describe(i)))
        return region_saves.rerun(entry, call)
    rebuilt: region_saves.Rebuilt | None = entry.rebuilt
    grad_was = _compat.set_grad_enabled(False)  # a region runs above autograd and the modes
    try:
        with _compat.no_modes():
            # First what recompute rebuilds: the checkpoint may stop recomputing once the last one is back.
            if rebuilt is None or region_saves.pack_rebuilt(rebuilt, writes.tensor_args(args, kwargs)):
                return record.serve(i, args, kwargs)
    finally:
        _compat.set_grad_enabled(grad_was)
    return region_saves.rerun(entry, call)  # an input came back with another layout: run the body again
