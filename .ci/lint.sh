#!/usr/bin/env bash
# Lint the repository with the pinned ruff (config: ruff.toml at the root), then type-check with the pinned mypy
# (config: [tool.mypy] in pyproject.toml: the sac2 package strictly, tests/ and benchmarks/ under looser rules)
# against torch 2.13, the CPU wheel constraints.txt pins; exits non-zero if either fails (both always run). The check
# against torch 2.15 runs in .ci/torch215.sh, whose venv has that torch (CI runs this step first, before that venv
# exists).
# Usage: .ci/lint.sh [VENV]  - VENV (or $LINT_VENV) is a virtual environment to install ruff, mypy and what mypy
# checks against (torch 2.13, numpy, matplotlib, and pytest and expecttest, which the tests import) into or take them
# from; by default one is made in ${TMPDIR:-/tmp}/sac2-lint-venv. Extra ruff arguments go in $RUFF_ARGS, extra mypy
# arguments in $MYPY_ARGS.
set -euo pipefail
cd "$(dirname "$0")/.."
RUFF_VERSION=0.17.5
MYPY_VERSION=2.4.1
# torch: constraints.txt's 2.13.0 CPU wheel; pytest and expecttest: the tests' imports
TYPED_DEPS=(torch numpy==2.4.6 matplotlib==3.11.2 pytest==9.2.0 expecttest==0.3.0)
venv="${1:-${LINT_VENV:-${TMPDIR:-/tmp}/sac2-lint-venv}}"
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
if [ ! -x "$venv/bin/ruff" ] || [ "$("$venv/bin/ruff" --version)" != "ruff $RUFF_VERSION" ]; then
    "$venv/bin/python" -m pip install -q "ruff==$RUFF_VERSION"
fi
if [ ! -x "$venv/bin/mypy" ] || [ "$("$venv/bin/mypy" --version | cut -d' ' -f2)" != "$MYPY_VERSION" ] \
    || ! "$venv/bin/python" -c 'import torch, numpy, matplotlib, pytest, expecttest
assert torch.__version__ == "2.13.0+cpu"' 2>/dev/null
then
    "$venv/bin/python" -m pip install -q "mypy==$MYPY_VERSION" "${TYPED_DEPS[@]}" -c constraints.txt
fi
status=0
# shellcheck disable=SC2086
"$venv/bin/ruff" check . ${RUFF_ARGS:-} || status=$?
echo "mypy $MYPY_VERSION, torch $("$venv/bin/python" -c 'import torch; print(torch.__version__)'):"
# shellcheck disable=SC2086
"$venv/bin/mypy" --cache-dir "$venv/mypy-cache" ${MYPY_ARGS:-} || status=$?
exit "$status"
