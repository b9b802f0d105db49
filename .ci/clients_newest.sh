#!/usr/bin/env bash
# CI step: tests/clients on the newest releases of the client frameworks the registry resolves today, beside the
# pinned set (.ci/clients.sh, pyproject's [clients] extra), so that a client release that breaks sac2 shows up the
# day it ships rather than when the pins move. Run from a clean clone's root; exits with pytest's status.
#
# torch stays the CPU wheel of torch 2.13 (constraints.txt: a plain resolve picks a multi-GB CUDA build); every
# client is unpinned. Two venvs under build/ (git-ignored), because the newest releases do not install together:
#   - the Hugging Face side and the trainers: transformers, accelerate, TRL, Lightning (build/clients-newest-venv);
#     tests/clients but test_torchtitan.py, and the tests that need torchtitan too skip there;
#   - torchtitan alone (build/torchtitan-newest-venv): torchtitan 0.3.0 pins datasets<4.8, whose huggingface_hub<2
#     conflicts with transformers 5.25's huggingface_hub>=2.4, so resolved together pip falls back to torchtitan
#     0.2.2, which sac2 does not support; tests/clients/test_torchtitan.py and docs/torchtitan.md's blocks.
# DeepSpeed is left to the pinned step (its sdist builds for a minute; its tests skip here). The tests that need
# transformers and torchtitan in one venv (test_model_regions.py, test_clients_regions_script.py) run in the pinned
# step only. Each venv prints the versions it resolved. Budget: about 10 minutes on 2 cores (602 s measured with
# other work running: the two installs about 7.5 minutes, the tests 2.5); .ci/run gives it 1200 s.
set -euo pipefail
cd "$(dirname "$0")/.."
HF_VENV="${CLIENTS_NEWEST_VENV:-build/clients-newest-venv}"
TITAN_VENV="${TORCHTITAN_NEWEST_VENV:-build/torchtitan-newest-venv}"

versions() {  # versions VENV DIST...: print the version of each distribution installed in VENV
    local venv=$1
    shift
    "$venv/bin/python" - "$@" <<'EOF'
import importlib.metadata as metadata
import sys

print("resolved: " + ", ".join(f"{name} {metadata.version(name)}" for name in sys.argv[1:]))
EOF
}

python3 -m venv "$HF_VENV"
"$HF_VENV/bin/pip" install -q -U -e '.[test]' transformers accelerate trl lightning -c constraints.txt
versions "$HF_VENV" torch transformers accelerate trl lightning

python3 -m venv "$TITAN_VENV"
"$TITAN_VENV/bin/pip" install -q -U -e '.[test]' torchtitan -c constraints.txt
versions "$TITAN_VENV" torch torchtitan

status=0
"$HF_VENV/bin/python" -m pytest -q tests/clients --ignore=tests/clients/test_torchtitan.py || status=$?
"$TITAN_VENV/bin/python" -m pytest -q tests/clients/test_torchtitan.py tests/clients/test_docs_clients.py || status=$?
exit "$status"
