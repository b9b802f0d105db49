#!/usr/bin/env bash
# Lint the repository with the pinned ruff (config: ruff.toml at the root); exits with ruff's status.
# Usage: .ci/lint.sh [VENV]  - VENV (or $LINT_VENV) is a virtual environment to install ruff into or take it
# from; by default one is made in ${TMPDIR:-/tmp}/sac2-lint-venv. Extra ruff arguments go in $RUFF_ARGS.
set -euo pipefail
cd "$(dirname "$0")/.."
RUFF_VERSION=0.17.5
venv="${1:-${LINT_VENV:-${TMPDIR:-/tmp}/sac2-lint-venv}}"
if [ ! -x "$venv/bin/ruff" ] || [ "$("$venv/bin/ruff" --version)" != "ruff $RUFF_VERSION" ]; then
    [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
    "$venv/bin/python" -m pip install -q "ruff==$RUFF_VERSION"
fi
# shellcheck disable=SC2086
exec "$venv/bin/ruff" check . ${RUFF_ARGS:-}
