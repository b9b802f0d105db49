"""Command-line argument types the bench's and the advisor's command lines share: each checks its value when the
line is parsed, so a misuse ends in one line naming what is wrong (argparse's error, exit code 2) before any work."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from sac2.measure.memory import DEVICE_TYPES

__all__ = ["positive_int", "device_arg", "output_file"]


def _is_positive_int(text: str) -> bool:
    return text.strip().isdecimal() and int(text) > 0


def positive_int(text: str) -> int:
    if not _is_positive_int(text):
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return int(text)


def device_arg(text: str) -> str:
    """``--device``: a device the bench can run on and measure memory on, and that this machine has."""
    try:
        device = torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a torch device (e.g. cpu, cuda, cuda:1)") from None
    if device.type not in DEVICE_TYPES:
        raise argparse.ArgumentTypeError(
            f"the bench measures memory on {' and '.join(DEVICE_TYPES)} only, not on {text!r}"
        )
    if device.type == "cuda":
        if not torch.backends.cuda.is_built():
            raise argparse.ArgumentTypeError(f"{text!r} needs a CUDA build of torch; this one was built without CUDA")
        if not torch.cuda.is_available():
            raise argparse.ArgumentTypeError(
                f"{text!r} needs a GPU; torch sees none (torch.cuda.is_available() is False)"
            )
        count = torch.cuda.device_count()
        # torch's stubs type device.index as int; it is None for "cuda" given without one.
        if device.index is not None and device.index >= count:  # type: ignore[redundant-expr]
            visible = ", ".join(f"cuda:{i}" for i in range(count))
            raise argparse.ArgumentTypeError(f"no device {text!r}; the visible CUDA devices are {visible}")
    return text


def output_file(text: str) -> str:
    """``--json``, ``--plot``: a file that can be created, checked now rather than after the whole run."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: it is a directory")
    if not path.parent.is_dir():
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: directory {str(path.parent)!r} does not exist")
    return text
