"""Shared test set-up: deterministic single-threaded CPU runs, Triton's CPU interpreter, warnings reset, and
``from helpers import ...`` working in every test file (this folder on ``sys.path``, whatever the import mode)."""

import os
import sys
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # must be set before triton is imported anywhere

_TESTS = str(Path(__file__).resolve().parent)
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _fresh_sac2_warnings():
    """sac2 warns once per op per process; each test sees its own warnings."""
    from sac2.core import notices

    notices._warned.clear()
    yield
    notices._warned.clear()
