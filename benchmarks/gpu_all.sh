#!/usr/bin/env bash
# Every GPU check in one run, for a lent GPU machine (one H200: about 6 minutes in all).
# Results (tables and JSON) go to the folder given as $1 (default: gpu-results).
set -uo pipefail
out=$(realpath -m "${1:-gpu-results}")
mkdir -p "$out"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # sac2 from this checkout
status=0
run() {  # run NAME SECONDS CMD...: one check, its output teed to NAME.txt; a failure is reported, not fatal
    local name=$1 limit=$2
    shift 2
    echo "== $name"
    timeout "$limit" "$@" 2>&1 | tee "$out/$name.txt" || { echo "!! $name failed"; status=1; }
}
run bench 120 python -m sac2 bench --device cuda --config medium --steps 10 --json "$out/bench.json"
run flex 240 python benchmarks/gpu_flex_sac.py --json "$out/flex.json"
run offload 150 python benchmarks/gpu_offload.py --json "$out/offload.json"
exit $status
