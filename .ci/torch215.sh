#!/usr/bin/env bash
# CI step: the type check and the default suite on torch 2.15, from a clean clone's root; exits non-zero when mypy
# finds an error, else with pytest's status. tests/seams and tests/clients are left out: CI's 2.15 lane runs the
# seam matrix's CI selection (a superset of the default pairwise cells) right after, and the clients pin torch 2.13.
# Makes its venv ($TORCH215_VENV, default build/torch215-venv) if it does not exist: torch 2.15.0 and triton 3.9.0
# (constraints-2.15.txt), then sac2 with its test and lint extras on that torch (the constraints keep pip from
# resolving torch again). The registry's torch 2.15 for Linux is a CUDA build; it runs on CPU, but it loads its CUDA
# libraries (cudnn, cublas, nccl, ...) when imported, so torch --no-deps with only its pure-Python deps does not
# import: this is the full install, about 5.5 GB. PIP_CONSTRAINT=/dev/null overrides a machine-wide pip cap on torch.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${TORCH215_VENV:-build/torch215-venv}"  # build/ is git-ignored
if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
    PIP_CONSTRAINT=/dev/null "$VENV/bin/pip" install -q torch triton -c constraints-2.15.txt
    PIP_CONSTRAINT=/dev/null "$VENV/bin/pip" install -q -e '.[test,lint]' -c constraints-2.15.txt
fi
"$VENV/bin/python" -c 'import torch; assert torch.__version__.startswith("2.15."), torch.__version__'
echo "mypy $("$VENV/bin/mypy" --version | cut -d' ' -f2), torch $("$VENV/bin/python" -c 'import torch; print(torch.__version__)'):"
"$VENV/bin/mypy" --cache-dir "$VENV/mypy-cache"  # config: [tool.mypy] in pyproject.toml
exec "$VENV/bin/python" -m pytest -q -p no:cacheprovider --ignore=tests/clients --ignore=tests/seams
