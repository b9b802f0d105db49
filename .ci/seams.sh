#!/usr/bin/env bash
# CI step: the seam matrix (tests/seams) on one torch, one intra-op thread.
# Usage: bash .ci/seams.sh VENV [MODE]. MODE (default ci) is SAC2_SEAMS: `ci` is every valid route x policy x
# backward cell in eager and aot_eager (where sac2's modes run and tag what the partitioner sees) plus the pairwise
# design, which covers what only inductor, fullgraph and dynamic=True add; `ci-rest` is that less the pairwise
# cells the default suite ran already (CI's 2.13 lane, after the README's suite, with the clients installed so the
# transformers and torchtitan routes run too); `full` is every valid cell (about an hour per torch on 2 cores).
# Extra pytest arguments: $SEAMS_PYTEST_ARGS.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${1:?usage: bash .ci/seams.sh VENV [MODE]}
# shellcheck disable=SC2086
SAC2_SEAMS="${2:-ci}" OMP_NUM_THREADS=1 exec "$venv/bin/python" -m pytest -q -p no:cacheprovider tests/seams \
    ${SEAMS_PYTEST_ARGS:-}
