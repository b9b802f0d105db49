#!/usr/bin/env bash
# CI step: sac2 with its client frameworks (transformers, TRL, torchtitan), from a clean clone, run from the repo root.
# Creates its own venv, installs '.[clients]' on the CPU wheel of torch 2.13 and runs tests/clients.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${CLIENTS_VENV:-build/clients-venv}"  # build/ is git-ignored
python3 -m venv "$VENV"
"$VENV/bin/pip" install -q -e '.[clients]' -c constraints.txt
"$VENV/bin/python" -m pytest -q tests/clients
