"""One ``sac2.region`` call as it travels the region protocol: ``sac2.regions.calls`` makes it, the innermost sac2 mode
or dispatch-free context decides it (``SacMode.region``), ``sac2.record.regions`` records or replays it.

The call carries its key, its body and its arguments together, so each layer reads what it owns instead of
passing the same five values along.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch

from sac2 import _compat
from sac2.core.keys import Region

__all__ = ["RegionCall"]


@dataclasses.dataclass(slots=True)  # not frozen: a frozen dataclass's __init__ costs several times a plain one's
class RegionCall:
    """``key``: the region (what a policy or save list matches). ``body``: the function, run as
    ``body(*args, **kwargs)`` (``sac2.regions.calls`` wraps it in ``compiled_region()`` where a mode is on the stack).
    ``pure``: sac2 knows the body (a Linear's own forward, or a matmul, on plain tensors with no ``out=``): it draws
    no random numbers and writes none of its arguments, so saved, it reads no generator state and looks for no
    writes."""

    key: Region
    body: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    pure: bool = False

    def run(self) -> Any:
        """Run the body under the saved-tensor hooks active here (a recomputed region: the checkpoint's)."""
        return self.body(*self.args, **self.kwargs)

    def run_under(self, pack: Callable[[torch.Tensor], Any], unpack: Callable[[Any], torch.Tensor]) -> Any:
        """Run the body with what it saves for backward going to ``pack``/``unpack`` (a saved region keeps its
        backward state itself)."""
        _compat.push_saved_tensors_hooks(pack, unpack)
        try:
            return self.body(*self.args, **self.kwargs)
        finally:
            _compat.pop_saved_tensors_hooks()
