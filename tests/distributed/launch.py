"""Start two gloo ranks of a worker in tests/distributed (torchrun's environment, one process each) and collect
the JSON line each prints last.

The one launcher of the distributed tests: every test file of this package spawns its ranks through it (a free
port, ``RANK``/``WORLD_SIZE``/``MASTER_*`` in the environment, ``tests/`` on ``PYTHONPATH`` for ``worker_exit``).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

__all__ = ["rank0", "run_ranks"]

HERE = Path(__file__).resolve().parent
TESTS = HERE.parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_ranks(
    worker: str, *args: str, timeout_s: float, peer_may_fail: bool = False, cwd: str | None = None
) -> list[dict | None]:
    """Run ``worker`` (a file name in this folder) on 2 ranks; return each rank's last JSON line.

    ``cwd`` is the ranks' working directory (default: this process's). A rank that fails fails the call, unless
    ``peer_may_fail``: for cells where one rank is expected to raise (stock SAC under a split backward) and leave
    its peer blocked in a receive. Then a rank still running 10 s after the other ended is killed and its entry is
    None (or the JSON line it printed before).
    """
    port = _free_port()
    env = dict(os.environ, WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
               PYTHONPATH=os.pathsep.join([str(TESTS), str(TESTS.parent)]))
    procs = [
        subprocess.Popen([sys.executable, str(HERE / worker), *args],
                         env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd)
        for r in range(2)
    ]
    try:
        outputs = _wait(procs, time.monotonic() + timeout_s, peer_may_fail, f"{worker} {' '.join(args)}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    results: list[dict | None] = []
    for rank, (p, (out, err)) in enumerate(zip(procs, outputs, strict=True)):
        lines = [line for line in out.splitlines() if line.startswith("{")]
        if p.returncode != 0 and not peer_may_fail:
            raise AssertionError(f"{worker} {' '.join(args)}: rank {rank} exited with {p.returncode}:\n{err[-3000:]}")
        results.append(json.loads(lines[-1]) if lines else None)
    return results


def _wait(procs: list[subprocess.Popen[str]], deadline: float, peer_may_fail: bool, what: str) -> list[tuple[str, str]]:
    """Each rank's (stdout, stderr). With ``peer_may_fail``, once one rank has ended the other gets 10 s more."""
    if peer_may_fail:
        while all(p.poll() is None for p in procs) and time.monotonic() < deadline:
            time.sleep(0.1)
        deadline = min(deadline, time.monotonic() + 10.0)
    outputs = []
    for p in procs:
        try:
            outputs.append(p.communicate(timeout=max(0.1, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            if not peer_may_fail or all(q.poll() is None for q in procs):
                raise AssertionError(f"{what}: ranks did not finish in time") from None
            p.kill()
            outputs.append(p.communicate())
    return outputs


def rank0(worker: str, timeout_s: float) -> dict:
    """Rank 0's JSON line of ``worker`` run on 2 ranks (both must succeed); skips where torch has no distributed."""
    if not torch.distributed.is_available():
        pytest.skip("torch built without torch.distributed")
    first, _ = run_ranks(worker, timeout_s=timeout_s)
    assert first is not None
    return first
