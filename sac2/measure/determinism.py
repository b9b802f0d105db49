"""Deterministic CUDA kernels while the bench and ``sac2.advise`` compare gradients bit for bit.

On CUDA the attention backward kernels (flash, memory-efficient) accumulate with atomics by default, so two runs of
one step differ in the last bits and no setup can equal no checkpointing bitwise: on an H200 every row of
``sac2 bench --device cuda`` read "NO", torch's own full AC included. torch's deterministic algorithms make the
comparison mean something again; only the strict mode (not ``warn_only``) picks the deterministic attention
backward, and cuBLAS needs ``CUBLAS_WORKSPACE_CONFIG`` for it. CPU kernels need nothing: there it is a no-op.
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator

import torch

__all__ = ["CUBLAS_WORKSPACE", "deterministic_kernels"]

#: The cuBLAS workspace setting torch's deterministic mode asks for (set only when the variable is unset).
CUBLAS_WORKSPACE = ":4096:8"
_CUBLAS_VARIABLE = "CUBLAS_WORKSPACE_CONFIG"


@contextlib.contextmanager
def deterministic_kernels(device: torch.device) -> Iterator[bool]:
    """Within the block, on a CUDA ``device``: ``torch.use_deterministic_algorithms(True)`` and cuBLAS's
    deterministic workspace; both are as they were afterwards, on errors too. Yields whether it switched anything
    (False on other devices). An op with no deterministic CUDA kernel raises torch's error naming it."""
    if device.type != "cuda":
        yield False
        return
    was_on = torch.are_deterministic_algorithms_enabled()
    was_warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    workspace = os.environ.get(_CUBLAS_VARIABLE)
    if workspace is None:
        os.environ[_CUBLAS_VARIABLE] = CUBLAS_WORKSPACE
    torch.use_deterministic_algorithms(True)
    try:
        yield True
    finally:
        torch.use_deterministic_algorithms(was_on, warn_only=was_warn_only)
        if workspace is None:
            os.environ.pop(_CUBLAS_VARIABLE, None)
