"""Shared test set-up: deterministic single-threaded CPU runs, Triton's CPU interpreter, warnings reset."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # must be set before triton is imported anywhere

import pytest
import torch

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _fresh_sac2_warnings():
    """sac2 warns once per op per process; each test sees its own warnings."""
    from sac2 import modes

    modes._warned.clear()
    yield
    modes._warned.clear()
