"""Profile one forward: per op call, what sac2's forward keeps if the policy saves it, and what recomputing costs.

The profile runs the forward under sac2's own forward mode (``CachingMode``): the same op keys, the same ignored
ops, the same rules for views, writes and stale outputs, the same record. It only adds a cost per recorded call
and reads the record when the forward ends, so what a report or a budget says is kept is what the forward keeps.
Memory is counted per storage, as "activation memory kept for backward": a saved call keeps the storages its
record entry holds that the forward allocated (not those of inputs, parameters or other tensors from outside).
Cost is measured wall time (seconds, synchronised on accelerators), or a FLOP estimate where measuring is not
possible (fake or meta tensors) or asked for: ``torch.utils.flop_counter``'s formula where it knows the op, else one
FLOP per output element.

Where a call's bytes live: a call the policy answers CPU_OFFLOAD for keeps in host memory the storages offload can
move (``Profile.movable``: on a device offload moves tensors off, ``sac2.offload.link``), and on the device those it
cannot (on a machine without one, an offload answer saves in place).
"""

from __future__ import annotations

import dataclasses
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch

from sac2 import _compat, messages
from sac2._compat import tree_leaves
from sac2.core import keys, writes
from sac2.core.decisions import (
    OFFLOADING,
    CheckpointPolicy,
    Policy,
    PolicyFn,
    SelectiveCheckpointContext,
    as_policy,
    is_save,
    op_name,
)
from sac2.core.opinfo import IGNORE, VIEW, OpInfo, info
from sac2.modes.forward import CachingMode
from sac2.offload import link as links
from sac2.policies.counters import Counter, FlopCount, TimeCount
from sac2.record import region_saves
from sac2.record.record import Record
from sac2.record.regions import RegionCall
from sac2.record.saved import Saved

__all__ = ["OpCall", "Profile", "profile", "as_inputs", "outside_storages", "storage_key"]

Tensor = torch.Tensor
RECOMPUTE = CheckpointPolicy.PREFER_RECOMPUTE


@dataclass
class OpCall:
    """One recorded op call of the profiled forward.

    ``index``: its call index among the calls with the same replay ``key``. ``storages`` index
    ``Profile.storage_bytes``: the activation storages that saving this call keeps; for a region, its outputs and
    what its body saved for backward, ``outputs`` the outputs' alone (what saving them op by op would keep, at
    least), ``rebuilt`` those of the body saves recompute rebuilds from its inputs, not kept (what
    ``keep_inputs=True`` would keep). ``view``: a view op (never
    saved: re-running it is free). ``stale``: the forward would not keep it although asked to (a later op writes
    into its output, or it wrote where sac2 cannot see). ``decision``: the policy's answer, when profiled with one;
    ``saved``: whether the forward kept it. ``ops``: how many ops the call ran (a region's body runs several), each
    of which costs recompute its dispatch besides its kernel (``sac2.policies.path_costs``). ``reached``: whether
    recompute gets to the call: it stops once the last tensor autograd saved is back (early stop), so a call from
    there on never runs again and keeping it saves nothing.
    """

    key: keys.Key
    index: int
    name: str
    storages: tuple[int, ...]
    cost: float
    view: bool
    stale: bool = False
    decision: CheckpointPolicy | None = None
    saved: bool = False
    outputs: tuple[int, ...] = ()
    rebuilt: tuple[int, ...] = ()
    ops: int = 1
    reached: bool = True


@dataclass
class Profile:
    """The op calls of one forward, the bytes of each activation storage they hold, and the cost unit.

    ``none_bytes``: what the forward keeps for backward without checkpointing (the storages autograd saves, but
    the inputs', parameters' and outputs'): the 100% a budget fraction refers to. ``free``: the storages of the
    forward's outputs, which whoever runs it keeps anyway (a block's output is the next block's checkpoint input),
    so saving the calls that hold them costs no memory. Both default to nothing for profiles pickled by sac2 0.4.
    ``movable``: the storages offload can move to host memory (on a device it moves tensors off); nothing for
    profiles pickled before 0.5.
    """

    calls: list[OpCall]
    storage_bytes: list[int]
    cost_unit: str  # "s" (measured) or "flop" (estimated)
    policy: Policy | None = field(default=None, repr=False)
    none_bytes: int = 0
    free: tuple[int, ...] = ()
    movable: frozenset[int] = frozenset()

    @property
    def total_bytes(self) -> int:
        """Activation bytes kept by saving every op (outputs no backward reads included)."""
        return self.kept_bytes(range(len(self.calls)))

    def kept_bytes(self, saved: Iterable[int]) -> int:
        """Activation bytes kept when the calls at positions ``saved`` are saved (stale ones are recomputed)."""
        kept = {s for i in saved if not self.calls[i].stale for s in self.calls[i].storages}
        return sum(self.storage_bytes[s] for s in kept)

    def offloaded(self, i: int) -> bool:
        """Whether the profiled policy answered CPU_OFFLOAD for call ``i``."""
        return self.calls[i].decision in OFFLOADING

    def where(self, i: int) -> list[tuple[int, bool]]:
        """Call ``i``'s storages, each with whether saving it keeps the storage in host memory (the policy offloads
        the call and offload can move the storage) rather than on the device. A storage a call saved on the device
        holds too is on both: offload copies it, and the device copy stays."""
        off = self.offloaded(i)
        movable = self.movable
        return [(s, off and s in movable) for s in self.calls[i].storages]

    def recompute_cost(self, saved: Iterable[int]) -> float:
        """Cost of the calls that backward re-runs when ``saved`` are saved (up to where recompute stops)."""
        served = {i for i in saved if not self.calls[i].stale}
        return sum(c.cost for i, c in enumerate(self.calls) if i not in served and c.reached)

    @property
    def saved(self) -> list[int]:
        """Positions of the calls the profiled forward kept (with the policy it was profiled with)."""
        return [i for i, c in enumerate(self.calls) if c.saved]


def as_inputs(example_inputs: Any) -> tuple[Any, ...]:
    """``example_inputs`` as a tuple of arguments: one tensor (or any non-sequence) is one argument."""
    return tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)


def _save_everything(
    _ctx: SelectiveCheckpointContext, _op: keys.PolicyOp, *args: Any, **kwargs: Any
) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE


def profile(
    fn: Callable[..., Any], example_inputs: Any, cost: str | None = None, policy: Policy | None = None
) -> Profile:
    """Run ``fn(*example_inputs)`` once under sac2's forward mode and profile each recorded op call.

    The forward keeps every call it can, so every call's storages show; ``policy`` is asked about each call as the
    forward mode asks it (``OpCall.decision``), and ``OpCall.saved`` says whether a forward with that policy keeps
    the call: the policy saves it and sac2 can keep it (staleness depends on writes, not on what else is saved).
    ``cost`` is ``"time"`` or ``"flops"``; None measures time unless the inputs are fake or meta tensors.
    """
    inputs = as_inputs(example_inputs)
    if cost is None:
        cost = "flops" if any(_unmeasurable(t) for t in tree_leaves(inputs) if isinstance(t, Tensor)) else "time"
    if cost not in ("time", "flops"):
        raise ValueError(messages.profile_bad_cost(cost))
    counter: Counter = FlopCount() if cost == "flops" else TimeCount(inputs)
    record = Record()
    mode = _Profiling(as_policy(policy) if policy is not None else _save_everything, record, counter)
    with counter, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # what the forward warns about shows in the profile (stale calls)
        # What autograd saves outside regions (a region's body notes its own: innermost hooks win).
        with mode, torch.autograd.graph.saved_tensors_hooks(_WeakPack(mode.note_saved), _compat.as_is):
            out = fn(*inputs)
    return _read(mode, record, inputs, fn, "s" if cost == "time" else "flop", policy, out)


def _unmeasurable(t: Tensor) -> bool:
    return t.device.type == "meta" or isinstance(t, _compat.FakeTensor)


def storage_key(t: Tensor) -> int:
    k = _compat.storage_id(t)
    return id(t) if k is None else k


class _Profiling(CachingMode):
    """sac2's forward mode, keeping every call it can (so the profile sees every call's storages) while noting
    what the policy answered for each, the cost of each recorded call, and which storages the forward allocated
    (those an op reads before any op of the forward made them came from outside)."""

    save_list_fast_path = False  # ask the policy about every call (a save list too)

    def __init__(self, policy: PolicyFn, record: Record, counter: Counter) -> None:
        super().__init__(policy, record)
        self.answers: dict[int, CheckpointPolicy] = {}
        self.costs: dict[int, float] = {}
        self.region_state: dict[int, list[Tensor]] = {}  # what each region's body saved for backward
        self.region_rebuilt: dict[int, list[Tensor]] = {}  # of those, what recompute rebuilds from its inputs
        self.outside: set[int] = set()
        self.made: set[int] = set()
        self.autograd_saved: dict[int, int] = {}  # storage -> bytes, of what backward reads without checkpointing
        self.ops: dict[int, int] = {}
        self.stop = 0  # the record's length at autograd's last pack: where an early-stopping recompute ends
        self.region_notes: dict[int, _RegionNotes] = {}
        self.counter = counter

    def note_saved(self, t: Tensor) -> None:
        """Note what autograd saves (what no checkpointing would keep). An op packs its inputs before the mode
        records it, its outputs after."""
        self.stop = len(self.record.log)
        if _compat.parameter_of(t) is None:
            self.autograd_saved[storage_key(t)] = t.untyped_storage().nbytes()

    def decide(
        self, func: _compat.Op, op: OpInfo, args: tuple[Any, ...], kwargs: dict[str, Any], out: object, call_index: int
    ) -> CheckpointPolicy:
        self.answers[len(self.record.log)] = super().decide(func, op, args, kwargs, out, call_index)
        return CheckpointPolicy.MUST_SAVE

    def __torch_dispatch__(
        self,
        func: _compat.Op,
        types: tuple[type, ...],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        log = self.record.log
        n, start, ops = len(log), self.counter.total, self.counter.ops
        if info(func).kind != IGNORE:  # detach and metadata queries read no data (sac2's own keep() detaches)
            self._note_inputs(args, kwargs)
        out = CachingMode.__torch_dispatch__(self, func, types, args, kwargs)
        if len(log) > n:
            self.costs[n] = 0.0 if info(func).kind == VIEW else self.counter.total - start
            self.ops[n] = self.counter.ops - ops
        self._note_outputs(out)
        return out

    def region(self, call: RegionCall) -> Any:
        n, start, ops = len(self.record.log), self.counter.total, self.counter.ops
        self._note_inputs(call.args, call.kwargs)
        state: list[Tensor] = []
        rebuilt: list[Tensor] = []
        self.region_state[n], self.region_rebuilt[n] = state, rebuilt
        # What recompute rebuilds from the region's inputs is not its body state (``sac2.record.region_saves``).
        keep = region_saves.keeps_inputs(call.key, self.keep_inputs)
        inputs = [] if keep else writes.tensor_versions(call.args, call.kwargs)

        notes = self.region_notes[n] = _RegionNotes(_WeakPack(self.note_saved), state, rebuilt, inputs)
        body = call.body

        def noting(*a: Any, **k: Any) -> Any:  # the body, noting what autograd keeps in it (innermost hooks)
            with torch.autograd.graph.saved_tensors_hooks(_WeakPack(notes.note), _compat.as_is):
                return body(*a, **k)

        out = super().region(dataclasses.replace(call, body=noting))
        self.costs[n] = self.counter.total - start
        self.ops[n] = self.counter.ops - ops
        self._note_outputs(out)
        return out

    def region_answer(self, call: RegionCall) -> tuple[bool, bool]:
        self.answers[len(self.record.log)] = self.ask(call.key, call.args, call.kwargs, None, len(self.record.log))
        return True, False

    def _note_inputs(self, args: tuple[Any, ...], kwargs: dict[str, Any] | None) -> None:
        for t in tree_leaves((args, kwargs)):
            if isinstance(t, Tensor) and storage_key(t) not in self.made:
                self.outside.add(storage_key(t))

    def _note_outputs(self, out: object) -> None:
        for t in tree_leaves(out):
            if isinstance(t, Tensor) and storage_key(t) not in self.outside:
                self.made.add(storage_key(t))


class _WeakPack:
    """A pack hook that notes what autograd saves through a weak reference, and keeps nothing (the profile runs no
    backward). Autograd keeps the pack hook with every tensor packed under it, so a strong reference from the hook
    to the profile's record, which holds the forward's outputs and through them their graph, would be a cycle
    through autograd that the collector cannot see: every profile would leak its forward."""

    __slots__ = ("note",)

    def __init__(self, note: Callable[[Tensor], None]) -> None:
        self.note = weakref.WeakMethod(note)

    def __call__(self, t: Tensor) -> None:
        note = self.note()
        if note is not None:
            note(t)


class _RegionNotes:
    """What one region's body saved for backward: its state, or (a view of) one of its inputs, which recompute
    rebuilds (``sac2.record.region_saves``). It reaches the profile weakly too (no cycle for the collector)."""

    def __init__(self, saved: _WeakPack, state: list[Tensor], rebuilt: list[Tensor], inputs: list[Any]) -> None:
        self.saved, self.state, self.rebuilt, self.inputs = saved, state, rebuilt, inputs

    def note(self, t: Tensor) -> None:
        self.saved(t)
        if _compat.parameter_of(t) is not None:
            return  # a parameter the body reads (or a view of one) is not an activation
        if not self.inputs or region_saves.rebuilds(t, self.inputs) is None:
            self.state.append(t)
        else:
            self.rebuilt.append(t)


def _read(
    mode: _Profiling,
    record: Record,
    inputs: tuple[Any, ...],
    fn: Callable[..., Any],
    unit: str,
    policy: Policy | None,
    out: object,
) -> Profile:
    """The profile of a finished forward, from its record and what it returned (``out``)."""
    outside = mode.outside | outside_storages(fn, inputs)
    returned = {storage_key(t) for t in tree_leaves(out) if isinstance(t, Tensor)} - outside
    storage_ids: dict[int, int] = {}
    storage_bytes: list[int] = []
    movable: list[int] = []
    link = links.current()
    counts: dict[keys.Key, int] = {}
    calls = []

    def storages_of(tensors: Iterable[Tensor]) -> list[int]:
        """The activation storages of ``tensors`` (not those from outside), numbered in first-seen order."""
        found: list[int] = []
        for t in tensors:
            k = storage_key(t)
            if k in outside:
                continue
            s = storage_ids.get(k)
            if s is None:
                s = storage_ids[k] = len(storage_bytes)
                storage_bytes.append(t.untyped_storage().nbytes())
                if link.device_of(t) is not None:
                    movable.append(s)
            if s not in found:
                found.append(s)
        return found

    for i, entry in enumerate(record.log):
        key = record.key_at(i)
        index = counts.get(key, 0)
        counts[key] = index + 1
        view = info(key).kind == VIEW if isinstance(key, _compat.OpOverload) else False
        answer = mode.answers.get(i)
        kept = entry if type(entry) is Saved and not entry.unseen_writes else None
        keepable = kept is not None
        storages: list[int] = []
        outputs: list[int] = []
        rebuilt: list[int] = []
        if kept is not None:
            storages = storages_of((*kept.tensors, *mode.region_state.get(i, ())))
            outputs = storages_of(kept.tensors)
            rebuilt = [s for s in storages_of(mode.region_rebuilt.get(i, ())) if s not in storages]
        asked = answer is not None and is_save(answer) and not view
        calls.append(OpCall(key, index, op_name(key), tuple(storages), mode.costs.get(i, 0.0), view,
                            asked and not keepable, answer if policy is not None else None, asked and keepable,
                            tuple(outputs), tuple(rebuilt), mode.ops.get(i, 1), i < mode.stop))
    none_bytes = sum(n for k, n in mode.autograd_saved.items() if k not in outside and k not in returned)
    free = tuple(sorted(storage_ids[k] for k in returned if k in storage_ids))
    return Profile(calls, storage_bytes, unit, policy, none_bytes, free, frozenset(movable))


def outside_storages(fn: Callable[..., Any], inputs: tuple[Any, ...]) -> set[int]:
    """Storages that exist before the forward: the inputs', and a module's parameters' and buffers'."""
    found = {storage_key(t) for t in tree_leaves(inputs) if isinstance(t, Tensor)}
    if isinstance(fn, torch.nn.Module):
        found |= {storage_key(t) for t in (*fn.parameters(), *fn.buffers())}
    return found


# Autograd calls the profile's pack hooks from C++, also inside compiled code (a compiled submodule of the profiled
# block), where dynamo would trace them as the user's code.
_compat.skip_dynamo_in_code(_WeakPack.__call__, _Profiling.note_saved, _RegionNotes.note)
