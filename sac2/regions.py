"""``sac2.region`` calls in the record, and selective checkpointing with no dispatch mode for region-only policies.

A region call is one entry of the record, decided before it runs. Saved, it runs with its backward state kept for
real and its outputs recorded; in recompute it is served (outputs, writes, generator) and its body does not run.
Recomputed, it runs under the checkpoint like any code and runs once more in recompute. ``record_region`` and
``replay_region`` do this for both sac2 modes and for the dispatch-free contexts below.

A policy that can only ever save regions (a save list of ``sac2.Region``s) needs no per-op dispatch at all:
``RegionForward``/``RegionReplay`` are plain context managers that only regions talk to, so ops between
regions run at full eager speed. What sac2 checks per op (op-level divergence, writes through other aliases) is
then checked per region: the sequence of regions, their outputs' versions, what they wrote, their RNG.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

import torch

from sac2 import _compat, offload, writes
from sac2.answers import SaveList
from sac2.keys import Region
from sac2.notices import DIVERGED, count_forward, unseen_writes, warn_once
from sac2.record import Record, Saved, keep, rng_before, rng_moved, served, stored_leaves

__all__ = ["record_region", "replay_region", "RegionForward", "RegionReplay", "region_only", "active"]

Tensor = torch.Tensor


def record_region(
    record: Record, key: Region, save: bool, offload: bool, run: Callable, run_kept: Callable, args: tuple, kwargs: dict
) -> Any:
    """Run a region call in forward and append its entry to ``record``: its key, or a ``Saved`` entry."""
    log = record.log
    if not save:
        out = run(*args, **kwargs)
        log.append(key)
        return out
    before = writes.tensor_versions(args, kwargs)
    with _compat.no_modes():
        rng = rng_before(True, args, kwargs)
    out = run_kept(*args, **kwargs)
    entry = Saved(key)
    written = writes.writes_of(key, args, kwargs, out, before)
    keep(entry, out, written or [])
    # Which outputs required grad: served ones must too, or recompute saves less than forward did.
    ids = {id(t) for _, t in written or []}
    leaves = (out,) if type(out) is Tensor else _compat.tree_leaves(out)
    grads = tuple(t.requires_grad for t in leaves if isinstance(t, Tensor) and id(t) not in ids)
    entry.out = (entry.out, grads)
    with _compat.no_modes():
        entry.rng = rng_moved(rng)  # recompute skips the region: skip the numbers it drew, too
    entry.record_versions()
    if written is None:
        warn_once("unseen-writes", key, unseen_writes(key))
        entry.writes = None  # what it wrote is unknown: replay runs it again instead of serving
    elif offload:
        entry.offload = True
        record.saved_at.append(len(log))
    log.append(entry)
    return out


def replay_region(
    record: Record, i: int, key: Region, run: Callable, run_kept: Callable, args: tuple, kwargs: dict
) -> Any:
    """The region call at position ``i`` of recompute: serve what forward saved, else run it."""
    log = record.log
    entry = log[i] if i < len(log) else None
    if entry is key:
        return run(*args, **kwargs)
    if type(entry) is not Saved or entry.key is not key:
        ran = record.describe(i) if entry is not None else f"only {len(log)} ops"
        raise RuntimeError(
            f"sac2: recompute diverged from forward at op {i} of the region: forward ran {ran}, recompute ran "
            f"region {key.name!r}. {DIVERGED}"
        )
    if entry.writes is None:
        return run_kept(*args, **kwargs)  # forward kept its backward state: the checkpoint expects none
    if entry.modified():
        warn_once(
            "modified-after-region",
            key,
            f"sac2: the policy saves {record.describe(i)}, but a tensor it returned or wrote was modified in "
            f"place after it ran, so the saved value is stale; sac2 runs the region again in backward instead. "
            f"Have the policy recompute it to silence this warning.",
        )
        return run_kept(*args, **kwargs)
    if entry.offload is not None:
        offload.ready(entry)
    with torch.no_grad(), _compat.no_modes():  # a region runs above autograd and the modes
        entry.restore(args, kwargs)
    out, grads = entry.out
    result = served(out, args, kwargs)
    fresh = [t for o, t in zip(stored_leaves(out), _compat.tree_leaves(result)) if isinstance(o, Tensor)]
    for t, requires_grad in zip(fresh, grads):
        t.requires_grad_(requires_grad)
    if entry.offload is not None:
        offload.release(entry)
    return result


_local = threading.local()


def active() -> Any:
    """The innermost dispatch-free context of this thread, or None."""
    stack = getattr(_local, "stack", None)
    return stack[-1] if stack else None


class _Context:
    """Pushed on this thread's stack of dispatch-free contexts while the checkpointed code runs."""

    def __init__(self, record: Record) -> None:
        self.record = record

    def __enter__(self) -> _Context:
        stack = getattr(_local, "stack", None)
        if stack is None:
            stack = _local.stack = []
        stack.append(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        _local.stack.remove(self)


class RegionForward(_Context):
    """Forward of a region-only policy: regions ask ``saves`` and are recorded; nothing else is intercepted."""

    def __init__(self, saves: frozenset, record: Record) -> None:
        super().__init__(record)
        self.saves = saves
        #: As ``CachingMode.saved_tensors_hooks``: the user's hooks saved regions go through, or None.
        self.saved_tensors_hooks: tuple[Callable, Callable] | None = None

    def __enter__(self) -> RegionForward:
        count_forward()
        return super().__enter__()  # type: ignore[return-value]

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        super().__exit__(exc_type, *exc)
        if exc_type is None and self.saved_tensors_hooks is not None:
            self.record.pack(self.saved_tensors_hooks)

    def region(self, key: Region, run: Callable, run_kept: Callable, args: tuple, kwargs: dict) -> Any:
        return record_region(self.record, key, key in self.saves, False, run, run_kept, args, kwargs)


class RegionReplay(_Context):
    """Recompute of a region-only policy: serves saved regions in order, runs the others, checks the sequence."""

    def __init__(self, record: Record) -> None:
        super().__init__(record)
        self._cursor = 0

    def __enter__(self) -> RegionReplay:
        self._cursor = 0
        self.record.unpack()
        return super().__enter__()  # type: ignore[return-value]

    def region(self, key: Region, run: Callable, run_kept: Callable, args: tuple, kwargs: dict) -> Any:
        i = self._cursor
        self._cursor = i + 1
        return replay_region(self.record, i, key, run, run_kept, args, kwargs)

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        super().__exit__(exc_type, *exc)
        cursor, n = self._cursor, len(self.record.log)
        if exc_type is None and cursor < n:
            raise RuntimeError(
                f"sac2: recompute ended after {cursor} regions, but the forward ran {n}; the first one missing is "
                f"{self.record.describe(cursor)}. {DIVERGED}"
            )


def region_only(policy: Any) -> frozenset | None:
    """The regions a policy saves if it can only ever save ``sac2.region`` calls, else None.

    That is a save list of ``sac2.Region``s while compiled code does not run as ``inductor_compiled_code``
    (``wrap_inductor_compiled_regions`` off): then no op but a ``sac2.region`` call can match a ``Region``.
    """
    if type(policy) is SaveList and policy.ops and all(type(op) is Region for op in policy.ops):
        if not _compat.compiled_regions_wrapped():
            return policy.ops
    return None
