#!/usr/bin/env bash
# The package without extras: install it (torch only) into a fresh virtual environment, import sac2 and every
# sac2.* submodule, check that sac2.__version__ is the installed distribution's version and that py.typed
# shipped. Exits non-zero on failure.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="$(mktemp -d)/venv"
trap 'rm -rf "$(dirname "$venv")"' EXIT
python3 -m venv "$venv"
"$venv/bin/pip" install -q . -c constraints.txt
cd "$(dirname "$venv")"  # import the installed package, not the source tree
"$venv/bin/python" - <<'PY'
import importlib
import importlib.metadata
import importlib.resources
import pkgutil

import sac2

names = [m.name for m in pkgutil.walk_packages(sac2.__path__, "sac2.")]
for name in names:
    importlib.import_module(name)
installed = importlib.metadata.version("sac2")
assert sac2.__version__ == installed, f"sac2.__version__ is {sac2.__version__}, the installed distribution {installed}"
assert (importlib.resources.files("sac2") / "py.typed").is_file(), "the wheel lacks sac2/py.typed"
print(f"noextras: imported sac2 and {len(names)} submodules; version {installed}")
PY
