"""``apply_ac(offload=...)``: what to keep in host memory, as a policy on top of the one ``mode`` makes.

``offload`` names the saves that move: ``"inputs"`` (each block's checkpoint inputs: what full AC keeps), regions as
``save`` names them (``"attention"``, ``"linear"``, ``"experts"``, module classes, name globs: made regions in
place, kept whole in host memory) and op overloads (their outputs). What it names is saved, in host memory; the rest
is what ``mode`` (and ``policy`` or ``save``) says. On a machine without an accelerator it changes nothing, and
says so once.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Iterable, Sequence

from torch import nn

from sac2 import _compat, messages
from sac2.core.decisions import Offloading, Policy, SaveList, as_policy
from sac2.core.keys import PolicyOp
from sac2.offload import link as links
from sac2.offload import schedule
from sac2.policies import llm
from sac2.regions.in_models import Target, make_regions, region_keys

__all__ = ["INPUTS", "Offload", "parse", "with_offload", "offload_limits"]

#: ``offload``'s name for each block's checkpoint inputs.
INPUTS = "inputs"
_told: list[bool] = [False]


@dataclass(frozen=True)
class Offload:
    """What ``offload=`` names: the inputs or not, region targets, op overloads."""

    inputs: bool
    regions: tuple[Target, ...]
    ops: tuple[PolicyOp, ...]


def parse(offload: Iterable[object] | None, mode: str) -> Offload | None:
    """``offload`` checked; None where it is None or where there is no accelerator (said once)."""
    if offload is None:
        return None
    if mode == "none":
        raise ValueError(messages.apply_ac_offload_with_none(offload))
    if isinstance(offload, str):
        raise TypeError(messages.apply_ac_offload_is_one_name(offload))
    inputs, regions, ops = False, [], []
    for target in offload:
        if target == INPUTS:
            inputs = True
        elif isinstance(target, str) or (isinstance(target, type) and issubclass(target, nn.Module)):
            regions.append(target)
        else:
            ops.append(_op(target))
    if not (inputs or regions or ops):
        raise ValueError(messages.APPLY_AC_OFFLOAD_EMPTY)
    if not links.current().available():
        if not _told[0]:
            _told[0] = True
            warnings.warn(messages.OFFLOAD_WITHOUT_ACCELERATOR, stacklevel=3)
        return None
    return Offload(inputs, tuple(regions), tuple(ops))


def _op(target: object) -> PolicyOp:
    """An op ``offload`` names, checked."""
    if isinstance(target, _compat.OpOverloadPacket):
        raise ValueError(messages.op_list_packet(target))
    if not isinstance(target, (_compat.OpOverload, _compat.HigherOrderOperator)):
        raise TypeError(messages.apply_ac_bad_offload_target(target))
    return target


def with_offload(
    model: nn.Module, blocks: Sequence[tuple[str, nn.Module]], mode: str, policy: Policy | None, moved: Offload
) -> Policy:
    """The policy ``mode`` makes (``policy``: the user's for ``"selective"``, the save list of regions made for
    ``"regions"``, None for ``"full"``) with ``moved``'s saves in host memory. In ``"regions"`` mode its regions
    are made already (with ``save``'s); otherwise they are made here."""
    if mode == "regions":
        keys: list[PolicyOp] = list(region_keys(blocks, moved.regions))
    else:
        keys = list(make_regions(model, blocks, moved.regions)) if moved.regions else []
    keys += moved.ops
    if mode == "full":
        return SaveList(keys, offload=keys, offload_inputs=moved.inputs)
    if isinstance(policy, SaveList):  # the regions' own
        return SaveList(policy.ops, policy.keep_inputs, offload=keys, offload_inputs=moved.inputs)
    base = llm() if policy is None else policy
    if isinstance(base, (list, tuple, set, frozenset)):
        return SaveList(base, offload=keys, offload_inputs=moved.inputs)
    return Offloading(as_policy(base), keys, moved.inputs)


def offload_limits(host_memory: int | None = None, prefetch: int | None = None) -> schedule.Limits:
    """Set how much offload may hold: pinned host memory, and device memory copied back ahead of backward.

    Process-wide, for every model offloading (``apply_ac(offload=...)``, ``CPU_OFFLOAD`` policies). Offload takes
    pinned host buffers from a pool that keeps them step after step (no host allocation per tensor once warm); at
    the cap, what does not fit stays in device memory (warned once). In backward, the copy back of the block
    backward reaches next runs while the current block runs; ``prefetch`` bounds the device bytes copied back
    ahead that way.

    Args:
        host_memory: the most pinned host bytes offload holds; None (the default) is half the machine's memory.
        prefetch: the most bytes copied back ahead of the block backward runs; None (the default) copies back the
            next block whole; 0 copies each block back only when backward reaches it.

    Returns:
        The limits these replace, as ``(host_memory, prefetch)``: ``offload_limits(*old)`` puts them back.

    Raises:
        ValueError: a limit that is not None or an int >= 0.
    """
    return schedule.set_limits(schedule.Limits(host_memory, prefetch))
