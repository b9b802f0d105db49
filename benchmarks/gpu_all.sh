#!/usr/bin/env bash
# Every GPU check in one run, for a lent GPU machine (one H200: under 9.5 minutes in all; nothing is downloaded).
# Each part has its own time limit and writes its table (NAME.txt) and JSON (NAME.json) into the folder given as
# $1 (default: gpu-results); a part that fails or runs out of time is reported and the next one still runs.
#   bench    python -m sac2 bench on CUDA (every mode, torch_remat when installed, the per-op curve), config medium
#   bench_large  the same on the compute-bound config large (bf16, d=2048, seq 2048), no curve: where a block's
#            kernels outlast the dispatch modes' Python per op, and where (medium) they do not
#   flex     compiled flex attention in SAC: stock, torchtitan's wrapped-region setup, sac2 region, torch_remat
#   njt      SDPA over nested jagged tensors under stock and sac2 SAC, eager and compiled
#   offload  sac2's CPU offload against saving and recomputing, beside its floor, on a config where compute hides
#            the copies and one where it cannot (benchmarks/gpu_offload.py)
#   advise   python -m sac2 advise on CUDA, on the bench's medium model (benchmarks/gpu_advise.py)
set -uo pipefail
out=$(realpath -m "${1:-gpu-results}")
mkdir -p "$out"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # sac2 from this checkout
status=0
run() {  # run NAME SECONDS CMD...: one check, its output teed to NAME.txt; a failure is reported, not fatal
    local name=$1 limit=$2
    shift 2
    echo "== $name (limit ${limit}s)"
    timeout "$limit" "$@" 2>&1 | tee "$out/$name.txt" || { echo "!! $name failed"; status=1; }
}
# limits add up to 550 s: with unpacking the bundle, inside one call's 600 s (tests/test_gpu_smoke.py)
run bench 85 python -m sac2 bench --device cuda --config medium --steps 8 --curve 16,256,4096 --curve-repeat 3 \
    --json "$out/bench.json"
run bench_large 55 python -m sac2 bench --device cuda --config large --dtype bfloat16 --steps 5 --curve '' \
    --json "$out/bench_large.json"
run flex 220 python benchmarks/gpu_flex_sac.py --json "$out/flex.json"
run njt 65 python benchmarks/gpu_njt.py --json "$out/njt.json"
run offload 80 python benchmarks/gpu_offload.py --json "$out/offload.json"
run advise 45 python -m sac2 advise --factory benchmarks.gpu_advise:medium --device cuda --steps 5 --json "$out/advise.json"
exit $status
