"""Region calls in the record, and the dispatch-free pair of contexts that records and replays them for region-only
policies.

A region call (``RegionCall``) is one entry of the record, decided before it runs. Saved, it runs with its backward
state kept for real (but what recompute rebuilds from its inputs: ``sac2.record.region_saves``) and its outputs
recorded; in recompute it is served (outputs, writes, generator) and its body does not run. Recomputed, it runs under
the checkpoint like any code and runs once more in recompute. ``record_region`` and ``replay_region`` do this for
both sac2 modes and for the contexts below.

A policy that can only ever save regions (a save list of ``sac2.Region``s) needs no per-op dispatch at all:
``RegionForward``/``RegionReplay`` are plain context managers that only regions talk to (``sac2.regions.calls``
finds the innermost with ``active``), so ops between regions run at full eager speed: they play the role the
dispatch modes play for other policies. What sac2 checks per op (op-level divergence, writes through other aliases)
is then checked per region: the sequence of regions, their outputs' versions, what they wrote, their RNG.

A saved region call passes through this module, ``region_saves`` (its body's saves), ``saved`` (its entry) and the
frame's pack hook (for the saves the checkpoint keeps as positions): the path meant to cost nothing stays short.
"""

from __future__ import annotations

import dataclasses
import threading
from types import TracebackType
from typing import TYPE_CHECKING, Any, Callable

import torch

from sac2 import _compat, messages
from sac2.core import writes
from sac2.core.decisions import SaveList, op_name
from sac2.core.keys import Region
from sac2.core.notices import count_forward, forward_entered, forward_exited, warn_once
from sac2.core.rng import rng_before, rng_moved
from sac2.messages.internal import InternalError
from sac2.offload import schedule
from sac2.record import region_saves
from sac2.record.record import Record
from sac2.record.saved import Saved, State

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = [
    "RegionCall", "record_region", "replay_region", "RegionForward", "RegionReplay", "region_only", "active",
]

Tensor = torch.Tensor
_version = _compat.version


@dataclasses.dataclass(slots=True)  # not frozen: a frozen dataclass's __init__ costs several times a plain one's
class RegionCall:
    """One ``sac2.region`` call as it travels the region protocol: ``sac2.regions.calls`` makes it, the innermost sac2
    mode or dispatch-free context decides it, ``record_region`` or ``replay_region`` records or replays it.

    ``key``: the region (what a policy or save list matches). ``body``: the function, run as
    ``body(*args, **kwargs)`` (``sac2.regions.calls`` wraps it in ``compiled_region()`` where a mode is on the
    stack). ``pure``: sac2 knows the body (a Linear's own forward, or a matmul, on plain tensors with no ``out=``):
    it draws no random numbers and writes none of its arguments, so saved, it reads no generator state and looks for
    no writes."""

    key: Region
    body: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    pure: bool = False

    def run(self) -> Any:
        """Run the body under the saved-tensor hooks active here (a recomputed region: the checkpoint's)."""
        return self.body(*self.args, **self.kwargs)

    def tensor_versions(self) -> list[tuple[Tensor, int]]:
        """Its tensor arguments with their versions, in ``writes.tensor_args``' order (a pure call's arguments are
        flat: its positional tensors, in order)."""
        if self.pure and not self.kwargs:
            return [(a, _version(a)) for a in self.args if type(a) is Tensor]
        return writes.tensor_versions(self.args, self.kwargs)


def record_region(record: Record, call: RegionCall, save: bool, offload: bool, keep_inputs: bool = False) -> Any:
    """Run a region call in forward and append its entry to ``record``: its key, or a ``Saved`` entry.
    ``keep_inputs``: the policy's (``SaveList.keep_inputs``); saved, the region keeps its inputs for real."""
    key, args, kwargs = call.key, call.args, call.kwargs
    if not save:
        out = call.run()
        record.log.append(key)
        return out
    before = call.tensor_versions()
    rng = None
    if not call.pure:  # a matmul or Linear on plain tensors draws nothing: no generator state to read
        with _compat.no_modes():
            rng = rng_before(True, args, kwargs)
    forward = record.region_forward
    if forward is None:  # both forward contexts start it on entry
        raise InternalError(messages.internal_error(messages.NOT_IN_FORWARD))
    keep = region_saves.keeps_inputs(key, keep_inputs)
    out, rebuilt = region_saves.run_saved(call.body, args, kwargs, before, forward, keep, offload)
    entry = Saved(key)
    entry.rebuilt = rebuilt
    written = [] if call.pure else writes.writes_of(key, args, kwargs, out, before)  # a pure call writes nothing
    entry.keep_region(out, written)
    if rng is not None:
        with _compat.no_modes():
            entry.rng = rng_moved(rng)  # recompute skips the region: skip the numbers it drew, too
    if written is None:
        warn_once("unseen-writes", key, messages.unseen_writes(op_name(key)))
    if entry.state is State.HELD:  # not RERUN: a region run again has nothing to offload, and keeps nothing
        if offload:
            record.offload_at_end(entry)
        else:
            region_saves.note_outputs(forward, out)  # kept on its device until backward: later regions share it
    record.log.append(entry)
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
        return _rerun(entry, call)  # forward kept its backward state (but what it rebuilds)
    if entry.modified():
        warn_once("modified-after-region", key, messages.stale_after_region(record.describe(i)))
        return _rerun(entry, call)
    rebuilt: region_saves.Rebuilt | None = entry.rebuilt
    grad_was = _compat.set_grad_enabled(False)  # a region runs above autograd and the modes
    try:
        with _compat.no_modes():
            # First what recompute rebuilds: the checkpoint may stop recomputing once the last one is back.
            if rebuilt is None or _pack_rebuilt(rebuilt, writes.tensor_args(args, kwargs)):
                return record.serve(i, args, kwargs)
    finally:
        _compat.set_grad_enabled(grad_was)
    return _rerun(entry, call)  # an input came back with another layout: run the body again


class _Rerun:
    """The hooks a saved region's body runs under when recompute runs it again: the saves forward handed to the
    checkpoint go to the checkpoint's recompute hooks, by number, so its positions stay in step."""

    def __init__(self, numbers: frozenset[int], top: _compat.HookPair) -> None:
        self.numbers = numbers
        self.top_pack, self.top_unpack = top
        self.count = 0

    def pack(self, x: Tensor) -> object:
        n = self.count
        self.count = n + 1
        return self.top_pack(x) if n in self.numbers else (x, _compat.version(x), n)

    def unpack(self, p: object) -> Tensor:
        if type(p) is tuple:
            return region_saves.unpack_kept(p)
        t: Tensor = self.top_unpack(p)
        return t


def _rerun(entry: Saved, call: RegionCall) -> Any:
    """Run a saved region's body again in recompute (forward kept its backward state, but for the saves it handed
    to the checkpoint: those are saved again, in the same order)."""
    rebuilt: region_saves.Rebuilt | None = entry.rebuilt
    top = _compat.top_saved_tensors_hooks() if rebuilt is not None else None
    if rebuilt is None or top is None:
        return region_saves.run_under(call.body, call.args, call.kwargs, _compat.as_is, _compat.as_is)
    hooks = _Rerun(rebuilt[0], top)
    return region_saves.run_under(call.body, call.args, call.kwargs, hooks.pack, hooks.unpack)


def _pack_rebuilt(rebuilt: region_saves.Rebuilt, inputs: list[Tensor]) -> bool:
    """Serving a saved region in recompute, in no-grad mode (the views are backward's to read: no autograd node for
    them): rebuild each save forward handed to the checkpoint from the replayed ``inputs`` (``writes.tensor_args``)
    and hand it to the checkpoint's recompute hooks, in forward's order, at the region's place. False, packing
    nothing, when an input it lives in came back with another layout than in forward (then the body runs again)."""
    specs = rebuilt[1]
    for j, _, _, _, size, stride in specs:
        if j >= len(inputs) or inputs[j].shape != size or inputs[j].stride() != stride:
            return False
    top = _compat.top_saved_tensors_hooks()
    if top is None:
        return True
    pack = top[0]
    for j, view_size, view_stride, offset, _, _ in specs:
        t = inputs[j]
        if view_size is None or view_stride is None:
            pack(t)  # the input itself
        else:
            pack(t.as_strided(view_size, view_stride, t.storage_offset() + offset))
    return True


# ---- the dispatch-free contexts ------------------------------------------------------------------------------

_local = threading.local()


def active() -> RegionForward | RegionReplay | None:
    """The innermost dispatch-free context of this thread, or None."""
    stack: list[RegionForward | RegionReplay] | None = getattr(_local, "stack", None)
    return stack[-1] if stack else None


class _Context:
    """Pushed on this thread's stack of dispatch-free contexts while the checkpointed code runs."""

    def __init__(self, record: Record) -> None:
        self.record = record

    def __enter__(self) -> Self:
        stack: list[_Context] | None = getattr(_local, "stack", None)
        if stack is None:
            stack = _local.stack = []
        stack.append(self)
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        _local.stack.remove(self)


class RegionForward(_Context):
    """Forward of a region-only policy: regions ask its save list and are recorded; nothing else is intercepted."""

    def __init__(self, policy: SaveList, record: Record) -> None:
        super().__init__(record)
        #: The names of the regions the save list saves, and of those it saves in host memory (``sac2.offload``): a
        #: name is a str, so no Python-level hash per call.
        self.saved_names = frozenset(op.name for op in policy.ops if type(op) is Region)
        self.offloaded_names = frozenset(op.name for op in policy.offload if type(op) is Region)
        self.keep_inputs = policy.keep_inputs
        #: Whether the checkpoint's inputs go to host memory (read by the frame: ``sac2.frame.entry``).
        self.offload_inputs = policy.offload_inputs
        if self.offloaded_names or self.offload_inputs:
            schedule.use()
        #: As ``CachingMode.saved_tensors_hooks``: the user's hooks saved regions go through, or None.
        self.saved_tensors_hooks: _compat.HookPair | None = None
        self.fell_back = False  # entered inside a torch.compile region (``notices.forward_entered``)
        self.ac_graph_id: int | None = None  # set by torch's checkpoint operator when it runs eagerly (eager backend)

    def __enter__(self) -> Self:
        count_forward()
        if (self.offloaded_names or self.offload_inputs) and not schedule.in_frame():
            warn_once("offload-frame", "torch's frame", messages.OFFLOAD_NEEDS_SAC2_FRAME)
        self.record.start_forward(self.saved_tensors_hooks)
        entered = super().__enter__()
        # Only eager (under torch.compile the pair is dispatch modes), and not torch's checkpoint operator run eagerly
        # (the eager backend), which sets its graph id.
        self.fell_back = self.ac_graph_id is None and forward_entered()
        return entered

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        super().__exit__(exc_type, exc, tb)
        if exc_type is None:
            self.record.end_forward(self.saved_tensors_hooks)
        if self.fell_back:
            self.fell_back = False
            forward_exited(exc_type is None)

    def saves_anything(self) -> bool:
        """Whether the forward saved some region."""
        return self.record.saves_anything()

    def region(self, call: RegionCall) -> Any:
        name = call.key.name
        return record_region(self.record, call, name in self.saved_names, name in self.offloaded_names,
                             self.keep_inputs)


class RegionReplay(_Context):
    """Recompute of a region-only policy: serves saved regions in order, runs the others, checks the sequence."""

    def __init__(self, record: Record) -> None:
        super().__init__(record)
        self._cursor = 0

    def __enter__(self) -> Self:
        self._cursor = 0
        self.record.start_recompute()
        return super().__enter__()

    def region(self, call: RegionCall) -> Any:
        i = self._cursor
        self._cursor = i + 1
        return replay_region(self.record, i, call)

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        super().__exit__(exc_type, exc, tb)
        self.record.end_recompute()
        cursor, n = self._cursor, len(self.record.log)
        if exc_type is None and cursor < n:
            raise messages.RecomputeDiverged(messages.regions_ended_early(cursor, n, self.record.describe(cursor)))


def region_only(policy: object) -> SaveList | None:
    """The policy as a save list if it can only ever save ``sac2.region`` calls, else None.

    That is a save list of ``sac2.Region``s while compiled code does not run as ``inductor_compiled_code``
    (``wrap_inductor_compiled_regions`` off): then no op but a ``sac2.region`` call can match a ``Region``. A save
    list of nothing that puts the checkpoint's inputs in host memory is full AC with them there: no mode either.
    """
    if type(policy) is SaveList and (policy.ops or policy.offload_inputs) and all(
        type(op) is Region for op in policy.ops
    ):
        if not _compat.compiled_regions_wrapped():
            return policy
    return None


# Autograd calls these from C++, also inside compiled code, where dynamo would trace them as the user's code.
_compat.skip_dynamo_in_code(_Rerun.pack, _Rerun.unpack)
