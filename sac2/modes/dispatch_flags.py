"""torch's process-wide "inside a dispatch mode" flags, kept right while threads run sac2's modes.

torch keeps ``_is_in_torch_dispatch_mode``, ``_is_in_non_infra_torch_dispatch_mode`` and
``_is_in_any_mode_without_ignore_compile_internals`` (mirrored in C++) as globals that each mode saves on enter
and restores on exit, so threads whose modes overlap leave them stuck True. sac2 sets each flag to the OR, over
the threads inside sac2 and the calling thread, of what that thread's own mode stack says: a thread never reads
False while it has a mode that needs True (compiled-region wrapping keys off it), and the flags drop back once
the last thread leaves.
"""

from __future__ import annotations

import threading

from sac2 import _compat

__all__ = ["sync"]

_lock = threading.Lock()
_flags_of_thread: dict[int, tuple[bool, bool, bool]] = {}  # threads inside sac2 -> what their own stack needs
_depth: dict[int, int] = {}  # threads inside sac2 -> how many sac2 modes they are in
_class_flags: dict[type[_compat.TorchDispatchMode], tuple[bool, bool]] = {}


def _own_flags() -> tuple[bool, bool, bool]:
    """What this thread's own mode stack needs the three flags to be."""
    classes = _compat.mode_classes()
    non_infra = not_ignoring = False
    for cls in classes:
        flags = _class_flags.get(cls)
        if flags is None:  # both are classmethods: ask once per mode class
            flags = _class_flags[cls] = (not cls.is_infra_mode(), not cls.ignore_compile_internals())
        non_infra |= flags[0]
        not_ignoring |= flags[1]
    return bool(classes), non_infra, not_ignoring


def sync(depth_change: int = 0) -> None:
    """Set the flags to what every thread inside sac2 needs; ``depth_change`` is +1 when the caller enters a
    sac2 mode, -1 when it leaves one, 0 when it only changed its stack (``compiled_region``)."""
    in_mode, non_infra, not_ignoring = own = _own_flags()
    tid = threading.get_ident()
    with _lock:
        depth = _depth.get(tid, 0) + depth_change
        if depth > 0:
            _depth[tid] = depth
            _flags_of_thread[tid] = own
        else:
            _depth.pop(tid, None)
            _flags_of_thread.pop(tid, None)
        for a, b, c in _flags_of_thread.values():
            in_mode, non_infra, not_ignoring = in_mode or a, non_infra or b, not_ignoring or c
        _compat.set_dispatch_flags(in_mode, non_infra, not_ignoring)
