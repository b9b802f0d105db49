#!/usr/bin/env bash
# CI step: tests/distributed, sac2 where people train distributed, on 2 gloo ranks per launch (CPU): every
# torch.distributed.pipelining schedule, FSDP2 gradient accumulation and reshard_after_forward=False, DCP
# save/load between checkpointed and unwrapped models, DDP (static_graph, find_unused_parameters, no_sync). The
# default suite leaves the folder out (tests/distributed/conftest.py): it runs only with SAC2_DISTRIBUTED=1.
# Uses the README's venv (.venv; PYTHON overrides it). Extra pytest arguments: $DISTRIBUTED_PYTEST_ARGS.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
# shellcheck disable=SC2086
SAC2_DISTRIBUTED=1 exec "$PY" -m pytest -q tests/distributed ${DISTRIBUTED_PYTEST_ARGS:-}
