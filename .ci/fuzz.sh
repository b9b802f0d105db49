#!/usr/bin/env bash
# CI step: the differential fuzzer's long mode, 10,000 cases (about 3 minutes on one core), on seeds derived from
# the commit, so that every commit fuzzes programs no run has tried (the default suite's slice, seeds 0-999, is the
# fixed regression set). The seed is printed first: `FUZZ_SEED=<it> bash .ci/fuzz.sh` replays the run, and each
# failing case's reproducer line goes to fuzz-report.md. Exits non-zero when any case fails.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
if [ -z "${FUZZ_SEED:-}" ]; then
    commit=$(git rev-parse --short=7 HEAD 2>/dev/null || echo 0)
    FUZZ_SEED=$(( 1000000 + (16#${commit} % 100000) * 10000 ))  # past the fixed slice; one 10,000 block per commit
fi
echo "fuzz: seed $FUZZ_SEED, ${FUZZ_CASES:-10000} cases (FUZZ_SEED=$FUZZ_SEED bash .ci/fuzz.sh replays them)"
exec timeout 1140 "$PY" -m tests.fuzz --cases "${FUZZ_CASES:-10000}" --seed "$FUZZ_SEED" --report fuzz-report.md
