#!/usr/bin/env bash
# CI step: the seam matrix (tests/seams) with SAC2_SEAMS=ci: every valid route x policy x backward cell in eager
# and aot_eager (where sac2's modes run and tag what the partitioner sees), and a pairwise cover of what only
# inductor, fullgraph and dynamic=True add. On torch 2.13 with the client frameworks, so the transformers and
# torchtitan routes run too (build/clients-venv, made by .ci/clients.sh), and on torch 2.15 (build/torch215-venv,
# made by .ci/torch215.sh), side by side, each under its own time limit. Run from a clean clone's root after those
# two steps; exits non-zero when a venv is missing or either run fails. The default suite runs the pairwise slice.
# SAC2_SEAMS=full (all 1,580 valid cells, about an hour per torch on 2 cores) runs alone: SEAMS_MODE=full.
# Limits in seconds: SEAMS_LIMIT_213, SEAMS_LIMIT_215. Extra pytest arguments: $SEAMS_PYTEST_ARGS.
set -euo pipefail
cd "$(dirname "$0")/.."
CLIENTS_VENV="${CLIENTS_VENV:-build/clients-venv}"
TORCH215_VENV="${TORCH215_VENV:-build/torch215-venv}"

for venv in "$CLIENTS_VENV:.ci/clients.sh" "$TORCH215_VENV:.ci/torch215.sh"; do
    if [ ! -x "${venv%%:*}/bin/python" ]; then
        echo "seams: ${venv%%:*} is missing; run bash ${venv##*:} first (it creates it)." >&2
        exit 2
    fi
done

run() {  # run VENV LIMIT LOG: the selected cells on VENV's torch under LIMIT seconds, output to LOG
    local venv=$1 limit=$2 log=$3 start=$SECONDS status=0
    # shellcheck disable=SC2086
    SAC2_SEAMS="${SEAMS_MODE:-ci}" OMP_NUM_THREADS=1 timeout "$limit" "$venv/bin/python" -m pytest -q \
        -p no:cacheprovider tests/seams ${SEAMS_PYTEST_ARGS:-} >"$log" 2>&1 || status=$?
    echo "$status $((SECONDS - start))" >"$log.status"
}

# The two torches run side by side, one intra-op thread each: a cell's time is mostly Python (tracing, compiling),
# so two processes on two cores take about as long as the longer one alone.
logs=$(mktemp -d)
run "$CLIENTS_VENV" "${SEAMS_LIMIT_213:-1500}" "$logs/213" &
run "$TORCH215_VENV" "${SEAMS_LIMIT_215:-1500}" "$logs/215" &
wait
failed=0
for part in "213:torch 2.13 + transformers + torchtitan" "215:torch 2.15"; do
    log="$logs/${part%%:*}"
    read -r status seconds <"$log.status"
    echo "--- seams, SAC2_SEAMS=${SEAMS_MODE:-ci}, ${part#*:}: exit $status in $seconds s ---"
    cat "$log"
    [ "$status" = 0 ] || failed=1
done
rm -rf "$logs"
exit "$failed"
