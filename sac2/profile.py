"""Profile one forward: per op call, the activation bytes it would keep if saved and what recomputing it costs.

The profile sees ops exactly as sac2's modes do (same op keys, same ignored ops), so its (op, call index) pairs
are the positions a policy decides. Memory is counted per storage, as "activation memory kept for backward":
an output costs the bytes of the storages it allocated; a view, an in-place write or an output aliasing an
input, a parameter or an earlier output allocates nothing new. Cost is measured wall time (seconds, synchronised
on accelerators), or a FLOP estimate where measuring is not possible (fake or meta tensors) or asked for:
``torch.utils.flop_counter``'s formula where it knows the op, else one FLOP per output element.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

import torch
from torch.utils.flop_counter import flop_registry

from sac2 import _compat, keys, writes
from sac2._compat import TorchDispatchMode, tree_leaves
from sac2.answers import CheckpointPolicy, ForwardContext, as_policy, decide, op_name
from sac2.checkpointing import checkpoint
from sac2.modes import CachingMode, ReplayMode, SacMode
from sac2.opinfo import IGNORE, info
from sac2.record import Record, Saved

__all__ = ["OpCall", "Profile", "profile", "activation_memory"]

Tensor = torch.Tensor


@dataclass
class OpCall:
    """One op call of the profiled forward.

    ``storages`` index ``Profile.storage_bytes``: the activation storages that saving this call keeps.
    ``view``: the op only aliases its input (nothing to keep, nothing to recompute). ``stale``: saving cannot
    hold what this call produced, because a later op of the forward writes into it or because it returns
    nothing and writes where sac2 cannot see (sac2 recomputes such calls whatever the policy says).
    ``decision`` is what the policy answered, when the forward was profiled with one.
    """

    key: Any
    index: int
    name: str
    storages: tuple[int, ...]
    cost: float
    view: bool
    stale: bool = False
    decision: CheckpointPolicy | None = None


@dataclass
class Profile:
    """The op calls of one forward, the bytes of each activation storage they allocated, and the cost unit."""

    calls: list[OpCall]
    storage_bytes: list[int]
    cost_unit: str  # "s" (measured) or "flop" (estimated)
    policy: Any = field(default=None, repr=False)

    @property
    def total_bytes(self) -> int:
        """Activation bytes kept by saving every op: the 100% that a budget fraction refers to."""
        return sum(self.storage_bytes)

    def kept_bytes(self, saved: Iterable[int]) -> int:
        """Activation bytes kept when the calls at positions ``saved`` are saved (stale ones are recomputed)."""
        kept = {s for i in saved if not self.calls[i].stale for s in self.calls[i].storages}
        return sum(self.storage_bytes[s] for s in kept)

    def recompute_cost(self, saved: Iterable[int]) -> float:
        """Cost of the calls that backward re-runs when ``saved`` are saved."""
        served = {i for i in saved if not self.calls[i].stale}
        return sum(c.cost for i, c in enumerate(self.calls) if i not in served)


def profile(
    fn: Callable[..., Any], example_inputs: Sequence[Any], cost: str | None = None, policy: Any = None
) -> Profile:
    """Run ``fn(*example_inputs)`` once and profile each op call; ask ``policy`` about each if given.

    ``cost`` is ``"time"`` or ``"flops"``; None measures time unless the inputs are fake or meta tensors.
    """
    inputs = tuple(example_inputs)
    if cost is None:
        cost = "flops" if any(_unmeasurable(t) for t in tree_leaves(inputs) if isinstance(t, Tensor)) else "time"
    if cost not in ("time", "flops"):
        raise ValueError(f"sac2.profile: cost must be 'time' or 'flops', got {cost!r}.")
    counter = _FlopCount() if cost == "flops" else None
    mode = _ProfileMode(cost, as_policy(policy) if policy is not None else None, counter)
    with counter or contextlib.nullcontext(), mode:
        fn(*inputs)
    return Profile(mode.calls, mode.storage_bytes, "s" if cost == "time" else "flop", policy)


def _unmeasurable(t: Tensor) -> bool:
    return t.device.type == "meta" or isinstance(t, _compat.FakeTensor)


def _storage_key(t: Tensor) -> int:
    k = _compat.storage_id(t)
    return id(t) if k is None else k


class _ProfileMode(SacMode):
    """Runs each op once, recording its key, call index, storages and cost (and the policy's answer).

    A ``SacMode``, so ``sac2.region`` calls reach it as one op, as they reach the forward mode, and policies get
    the per-forward context they get there. In "flops" mode a ``_FlopCount`` below it counts what each op
    (or region body) runs.
    """

    def __init__(self, cost: str, policy: Any, counter: _FlopCount | None) -> None:
        super().__init__()
        self._ctx = ForwardContext()
        self.cost = cost
        self.policy = policy
        self.counter = counter
        self.calls: list[OpCall] = []
        self.storage_bytes: list[int] = []
        self._storage_ids: dict[int, int] = {}  # storage _cdata -> index into storage_bytes
        self._writers: dict[int, list[int]] = {}  # storage index -> calls whose output references it
        self._alive: list[Any] = []  # outputs are held so no storage address is reused during the forward
        self._counts: dict[Any, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if info(func).kind == IGNORE:  # what the forward mode does not record is not an op for a policy
            return func(*args, **kwargs)
        key = keys.replay_key(func, args)
        return self._observe(func, key, lambda: func(*args, **kwargs), args, kwargs)

    def region(self, key: keys.Region, run: Callable, run_kept: Callable, args: tuple, kwargs: dict) -> Any:
        return self._observe(key, key, lambda: run(*args, **kwargs), args, kwargs)

    def _observe(self, func: Any, key: Any, run: Callable[[], Any], args: tuple, kwargs: dict) -> Any:
        is_op = isinstance(func, _compat.OpOverload)
        before = None if is_op else writes.tensor_versions(args, kwargs)
        out, cost = self._run(run, args, kwargs)
        written = writes.writes_of(func, args, kwargs, out, before)
        unseen = written is None
        written = written or []
        tensors = [t for t in tree_leaves(out) if isinstance(t, Tensor)] + [t for _, t in written]
        self._alive.append((out, tensors))
        storages = self._storages(tensors, args, kwargs)
        view = is_op and func.is_view
        i = len(self.calls)
        for _, t in written:  # what earlier calls returned in this storage is no longer what they produced
            s = self._storage_ids.get(_storage_key(t))
            for j in self._writers.get(s, ()):
                self.calls[j].stale = True
        for s in storages:
            self._writers.setdefault(s, []).append(i)
        index = self._counts.get(key, 0)
        self._counts[key] = index + 1
        call = OpCall(key, index, op_name(key), storages, 0.0 if view else cost, view, stale=unseen)
        if self.policy is not None:
            self._ctx.op_output = None if type(func) is keys.Region else out  # as the forward mode does
            call.decision = decide(self.policy(self._ctx, func, *args, **kwargs), func, i)
        self.calls.append(call)
        return out

    def _run(self, run: Callable[[], Any], args: tuple, kwargs: dict) -> tuple[Any, float]:
        if self.counter is not None:
            start = self.counter.total
            out = run()
            return out, float(self.counter.total - start)
        devices = {t.device for t in tree_leaves((args, kwargs)) if isinstance(t, Tensor) and t.device.type != "cpu"}
        for d in devices:
            torch.accelerator.synchronize(d)
        start = time.perf_counter()
        out = run()
        for d in devices:
            torch.accelerator.synchronize(d)
        return out, time.perf_counter() - start

    def _storages(self, tensors: list[Tensor], args: tuple, kwargs: dict) -> tuple[int, ...]:
        """Indices of the activation storages ``tensors`` live in; new ones are registered with their bytes."""
        inputs = None
        found: list[int] = []
        for t in tensors:
            k = _storage_key(t)
            s = self._storage_ids.get(k)
            if s is None:
                if inputs is None:
                    inputs = {_storage_key(a) for a in tree_leaves((args, kwargs)) if isinstance(a, Tensor)}
                if k in inputs:
                    continue  # aliases a tensor from outside the forward (input, parameter): not an activation
                s = self._storage_ids[k] = len(self.storage_bytes)
                self.storage_bytes.append(t.untyped_storage().nbytes())
            if s not in found:
                found.append(s)
        return tuple(found)


class _FlopCount(TorchDispatchMode):
    """Adds up estimated FLOPs of every op below the profile: torch's formula where it has one, else one per
    output element. A HOP counts as one op (its body runs below this mode, unseen)."""

    supports_higher_order_operators = True

    def __init__(self) -> None:
        super().__init__()
        self.total = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not (isinstance(func, _compat.OpOverload) and func.is_view):
            packet = _compat.op_packet(func)
            formula = flop_registry.get(_SAME_FLOPS_AS.get(packet, packet))
            self.total += formula(*args, **kwargs, out_val=out) if formula is not None else _numel(out)
        return out


#: torch's FLOP counter knows flash attention on CUDA but not the CPU kernel, which takes the same q, k, v first.
_SAME_FLOPS_AS = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: torch.ops.aten._scaled_dot_product_flash_attention,
}


def _numel(out: Any) -> int:
    return sum(t.numel() for t in tree_leaves(out) if isinstance(t, Tensor))


def activation_memory(fn: Callable[..., Any], example_inputs: Sequence[Any], policy: Any) -> int:
    """Bytes kept for backward when ``fn(*example_inputs)`` runs under ``sac2.checkpoint`` with ``policy``.

    Counts unique storages of what the checkpoint's record saves plus what autograd saves outside the
    checkpoint, excluding parameters and inputs (anything that existed before the forward). Runs no backward.
    """
    inputs = tuple(example_inputs)
    before = {_storage_key(t) for t in tree_leaves(inputs) if isinstance(t, Tensor)}
    if isinstance(fn, torch.nn.Module):
        before |= {_storage_key(t) for t in (*fn.parameters(), *fn.buffers())}
    records: list[Record] = []

    def context_fn():
        record = Record()
        records.append(record)
        return CachingMode(as_policy(policy), record), ReplayMode(record)

    outside: dict[int, int] = {}

    def pack(t: Tensor) -> Tensor:
        outside[_storage_key(t)] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        # The hooks here only count what autograd saves outside sac2's record: sac2's own saves bypass them.
        out = checkpoint(fn, *inputs, use_reentrant=False, context_fn=context_fn, respect_saved_tensors_hooks=False)
    kept = dict(outside)
    for record in records:
        for entry in record.log:
            if type(entry) is Saved:
                for t in entry.tensors:
                    kept[_storage_key(t)] = t.untyped_storage().nbytes()
    del out
    return sum(n for k, n in kept.items() if k not in before)
