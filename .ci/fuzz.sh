#!/usr/bin/env bash
# CI step: the differential fuzzer's long mode, 10,000 cases (about 5 minutes on 2 cores; the limit is 19).
# Exits non-zero when any case fails; the summary and every failing case's reproducer go to fuzz-report.md.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
exec timeout 1140 "$PY" -m tests.fuzz --cases "${FUZZ_CASES:-10000}" --seed "${FUZZ_SEED:-100000}" --report fuzz-report.md
