"""``debug=True`` on sac2's frame: the ops the forward and its recompute ran, side by side, in the error.

torch's ``debug=True`` records operator traces on torch's frame; sac2's frame is the one that runs, so it keeps its
own: a pass-through dispatch mode innermost in the forward and in each recompute lists every op the checkpointed
function dispatched (served ones too). When recompute fails (the determinism check, a divergence sac2's replay
found), the error gains both lists, numbered, with the first position where they differ marked, and what sac2's
selective modes saved. A recompute that differs from its forward (what it saved, the ops it ran) leads with torch's
own debug wording (its "Detected non-determinism" error), as torch's ``debug=True`` does, and drops torch's tip to
pass ``debug=True``, which was passed.
"""

from __future__ import annotations

from types import TracebackType
from typing import Any, ContextManager

from sac2 import _compat, messages
from sac2.core.decisions import op_name
from sac2.core.opinfo import IGNORE, info

__all__ = ["OpTrace"]


class _TraceMode(_compat.TorchDispatchMode):
    """Lists the ops that reach it, and runs them."""

    supports_higher_order_operators = True

    def __init__(self, ops: list[str]) -> None:
        super().__init__()
        self.ops = ops

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if info(func).kind != IGNORE:  # detach (the frame's own) and metadata queries are not the program's ops
            self.ops.append(op_name(func))
        return func(*args, **(kwargs or {}))


class OpTrace:
    """The op lists of one checkpointed call: its forward's, and its latest recompute's."""

    def __init__(self) -> None:
        self.forward: list[str] = []
        self.recompute: list[str] = []
        self.record: object = None  # sac2's record of the forward, where sac2's selective modes ran

    def around(self, forward_context: ContextManager[object] | None) -> ContextManager[object]:
        """``forward_context`` (may be None), with the forward's trace mode innermost."""
        self.record = getattr(forward_context, "record", None)
        return _Within(forward_context, _TraceMode(self.forward))

    def recompute_mode(self) -> _TraceMode:
        self.recompute = []
        return _TraceMode(self.recompute)

    def explain(self, error: str, differs: bool) -> str:
        """``error`` with both lists, and what sac2's modes saved; led by torch's own debug wording where the
        recompute ``differs`` from the forward."""
        record, saved = self.record, []
        for i in getattr(record, "saved_at", ()):
            saved.append(record.describe(i))  # type: ignore[attr-defined]  # a Record: it has saved_at
        return messages.debug_trace(error, self.forward, self.recompute, saved, differs)


class _Within:
    """``outer`` then ``inner`` entered, left in reverse; ``outer``'s ``__exit__`` answer is the answer."""

    def __init__(self, outer: ContextManager[object] | None, inner: ContextManager[object]) -> None:
        self.outer, self.inner = outer, inner

    def __enter__(self) -> None:
        if self.outer is not None:
            self.outer.__enter__()
        try:
            self.inner.__enter__()
        except BaseException as error:
            if self.outer is not None:
                self.outer.__exit__(type(error), error, error.__traceback__)
            raise

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> bool:
        self.inner.__exit__(kind, error, tb)
        return bool(self.outer is not None and self.outer.__exit__(kind, error, tb))
