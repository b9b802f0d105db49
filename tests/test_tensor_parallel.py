"""sac2 with tensor parallelism: two gloo ranks train FSDP2 over DTensor (Colwise/Rowwise) blocks; selective and
full AC give exactly the losses and weights of training without checkpointing."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

WORKER = Path(__file__).with_name("tp_worker.py")
TIMEOUT_S = 90


@pytest.fixture(scope="module")
def result() -> dict:
    if not torch.distributed.is_available():
        pytest.skip("torch built without torch.distributed")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER)],
            env=dict(os.environ, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                     MASTER_PORT=str(port), PYTHONPATH=str(WORKER.parent.parent)),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for r in range(2)
    ]
    try:
        outputs = [p.communicate(timeout=TIMEOUT_S) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, (_, err) in zip(procs, outputs, strict=True):
        assert p.returncode == 0, f"tensor-parallel worker exited with {p.returncode}:\n{err[-3000:]}"
    return json.loads(outputs[0][0].strip().splitlines()[-1])


@pytest.mark.parametrize("mode", ["selective", "full", "regions"])
def test_training_matches_no_checkpointing_exactly(result, mode):
    assert result[mode] == result["none"]
