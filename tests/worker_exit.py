"""How a gloo rank of the distributed tests ends (every worker in tests/distributed imports it)."""

from __future__ import annotations

import os
import sys

import torch.distributed as dist

__all__ = ["shut_down"]


def shut_down() -> None:
    """End this rank without a crash at exit: wait until both ranks are done with every collective (neither tears
    down gloo under a peer still using it, and rank 0's TCPStore outlives rank 1's last use of it), destroy the
    process groups, then leave with os._exit once the output is flushed. A plain interpreter exit destroys gloo's
    and the store's C++ threads in static destructors, which on a loaded machine can still be running and abort the
    process ("terminate called without an active exception", exit -6) after the rank's work succeeded."""
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
