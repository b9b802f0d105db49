#!/usr/bin/env bash
# CI step: sac2 with its client frameworks (transformers, TRL, torchtitan, Accelerate, Lightning, DeepSpeed; the
# versions pyproject.toml's `clients` extra pins), run from the repo root: tests/clients in $CLIENTS_VENV (default
# build/clients-venv). A venv that does not exist yet is made and gets '.[clients]' on torch 2.13's CPU wheel; CI
# passes the README's .venv, which its 2.13 lane has given the extras already (environments are built once).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${CLIENTS_VENV:-build/clients-venv}"  # build/ is git-ignored
if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install -q -e '.[clients]' -c constraints.txt
fi
"$VENV/bin/python" -m pytest -q -p no:cacheprovider tests/clients
