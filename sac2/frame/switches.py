"""The per-thread switches sac2's checkpoint frame reads as each checkpoint starts: which frame runs
(``use_torch_frame``) and which explicit generators its recompute replays (``preserve_generators``).

Public (``sac2.use_torch_frame``, ``sac2.preserve_generators``); like ``torch.set_grad_enabled`` they hold per
thread, so a switch in one thread leaves the others' checkpoints alone.
"""

from __future__ import annotations

import threading

import torch

from sac2 import messages

__all__ = ["use_torch_frame", "torch_frame_in_use", "preserve_generators", "preserved_generators"]


class _Switch(threading.local):
    torch_frame: bool = False
    generators: tuple[torch.Generator, ...] = ()


_switch = _Switch()


class use_torch_frame:
    """Run sac2's eager checkpoints on torch's own non-reentrant frame instead of sac2's, to compare the two.

    Like ``torch.set_grad_enabled``: ``sac2.use_torch_frame()`` switches this thread until switched back
    (``sac2.use_torch_frame(False)``), and ``with sac2.use_torch_frame(): ...`` switches for the block only.
    sac2's policies and modes still decide what is kept; only the frame (hooks, recompute) is torch's.

    Args:
        enabled: True (the default) runs torch's frame from now on in this thread; False runs sac2's again.
            Leaving the ``with`` block restores whichever was in use before.
    """

    def __init__(self, enabled: bool = True) -> None:
        self.prev = _switch.torch_frame
        _switch.torch_frame = bool(enabled)

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        _switch.torch_frame = self.prev


def torch_frame_in_use() -> bool:
    """Whether ``use_torch_frame`` is on in this thread."""
    return _switch.torch_frame


class preserve_generators:
    """Checkpoints entered in this block replay these generators in recompute, as they replay the global RNG.

    sac2's selective modes see every op that draws from a generator passed as ``generator=g`` and replay it
    already; code no mode sees (full AC, the ops between one-line regions) draws from ``g`` again in recompute
    unless ``g`` is named here, and would get other numbers than the forward did. Each generator is left where the
    forward left it. ``with sac2.preserve_generators(g): loss = model(x)``; nests, per thread.

    Args:
        *generators: the ``torch.Generator``s to save at each checkpoint's start and replay in its recompute,
            added to those of enclosing ``preserve_generators`` blocks.

    Raises:
        TypeError: one of ``generators`` is not a ``torch.Generator``.
    """

    def __init__(self, *generators: torch.Generator) -> None:
        for g in generators:
            if not isinstance(g, torch.Generator):
                raise TypeError(messages.not_a_generator(g))
        self.generators = generators
        self.prev: tuple[torch.Generator, ...] = ()

    def __enter__(self) -> None:
        self.prev = _switch.generators
        _switch.generators = self.prev + self.generators

    def __exit__(self, *exc: object) -> None:
        _switch.generators = self.prev


def preserved_generators() -> tuple[torch.Generator, ...]:
    """The generators the ``preserve_generators`` blocks around this point name, outermost first."""
    return _switch.generators
