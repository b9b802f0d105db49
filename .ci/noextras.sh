#!/usr/bin/env bash
# A release a user can install. Build the sdist and the wheel (python -m build, from a throwaway venv), check their
# metadata against pyproject.toml and sac2.__version__ and what each carries, then install the wheel (not the source
# tree) without extras into a fresh venv and, from outside the source tree, import sac2 and every sac2.* submodule,
# check the installed version and py.typed, and run the `sac2` command. All outputs live in a temp dir. Exits
# non-zero on failure.
set -euo pipefail
cd "$(dirname "$0")/.."
root="$PWD"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

python3 -m venv "$tmp/build-venv"
"$tmp/build-venv/bin/pip" install -q build
"$tmp/build-venv/bin/python" -m build --outdir "$tmp/dist" . >"$tmp/build.log" 2>&1 || { cat "$tmp/build.log"; exit 1; }

# The metadata and contents of both distributions (build brings packaging, and tomli before Python 3.11).
"$tmp/build-venv/bin/python" - "$root" "$tmp/dist" <<'PY'
import ast
import email
import pathlib
import sys
import tarfile
import zipfile

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

root, dist = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
readme = (root / "README.md").read_text().strip()
project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
init = ast.parse((root / "sac2" / "__init__.py").read_text())
version = next(
    node.value.value for node in init.body
    if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["__version__"]
)
package = sorted(  # what the sac2 package is made of in the source tree
    str(p.relative_to(root)) for p in (root / "sac2").rglob("*")
    if p.is_file() and "__pycache__" not in p.parts and p.suffix in (".py", ".typed")
)
(wheel,), (sdist,) = dist.glob("*.whl"), dist.glob("*.tar.gz")
with zipfile.ZipFile(wheel) as z:
    wheel_files = z.namelist()
    (info,) = {f.split("/")[0] for f in wheel_files if f.split("/")[0].endswith(".dist-info")}
    wheel_meta = email.message_from_string(z.read(f"{info}/METADATA").decode())
with tarfile.open(sdist) as t:
    (top,) = {m.name.split("/")[0] for m in t.getmembers()}
    sdist_files = [m.name.removeprefix(f"{top}/") for m in t.getmembers() if m.isfile()]
    sdist_meta = email.message_from_string(t.extractfile(f"{top}/PKG-INFO").read().decode())


def check(what: str, found: object, expected: object) -> None:
    assert found == expected, f"{what}: {found!r}, expected {expected!r}"


def check_files(what: str, found: list[str], expected: list[str]) -> None:
    missing, extra = sorted(set(expected) - set(found)), sorted(set(found) - set(expected))
    assert not missing and not extra, f"{what}: missing {missing}, not expected {extra}"


for name, meta in (("wheel", wheel_meta), ("sdist", sdist_meta)):
    check(f"{name} Name", meta["Name"], project["name"])
    check(f"{name} Version (sac2.__version__)", meta["Version"], version)
    check(f"{name} Requires-Python", SpecifierSet(meta["Requires-Python"]), SpecifierSet(project["requires-python"]))
    requires = [Requirement(r) for r in meta.get_all("Requires-Dist")]
    check(f"{name} Requires-Dist without extras", sorted(str(r) for r in requires if r.marker is None),
          sorted(str(Requirement(r)) for r in project["dependencies"]))
    check(f"{name} Provides-Extra", sorted(meta.get_all("Provides-Extra")),
          sorted(canonicalize_name(e) for e in project["optional-dependencies"]))
    check(f"{name} License-Expression", meta["License-Expression"], project["license"])
    check(f"{name} License-File", meta.get_all("License-File"), project["license-files"])
    check(f"{name} Description-Content-Type", meta["Description-Content-Type"], "text/markdown")
    check(f"{name} long description is README.md", meta.get_payload().strip() == readme, True)
check_files("wheel: the sac2 package", [f for f in wheel_files if f.startswith("sac2/")], package)
check("wheel: files outside sac2/ and its .dist-info", [f for f in wheel_files if not f.startswith(("sac2/", info))], [])
check("wheel: LICENSE shipped", f"{info}/licenses/LICENSE" in wheel_files, True)
check_files("sdist: the sac2 package", [f for f in sdist_files if f.startswith("sac2/")], package)
for name in ("LICENSE", "README.md", "pyproject.toml", "PKG-INFO", "constraints.txt", "tests/conftest.py",
             "tests/helpers.py", "tests/fuzz/programs.py", "docs/concepts.md", "benchmarks/overhead.py"):
    check(f"sdist: {name} shipped", name in sdist_files, True)
print(f"noextras: built {sdist.name} and {wheel.name}; metadata and contents as pyproject.toml says")
PY

# The wheel, not the source tree, into a fresh venv; everything below runs outside the source tree.
python3 -m venv "$tmp/venv"
"$tmp/venv/bin/pip" install -q "$tmp"/dist/*.whl -c constraints.txt
cd "$tmp"
"$tmp/venv/bin/python" - "$tmp/venv" <<'PY'
import importlib
import importlib.metadata
import importlib.resources
import pathlib
import pkgutil
import sys

import sac2

venv = pathlib.Path(sys.argv[1]).resolve()
assert venv in pathlib.Path(sac2.__file__).resolve().parents, f"imported {sac2.__file__}, not the installed wheel"
names = [m.name for m in pkgutil.walk_packages(sac2.__path__, "sac2.")]
for name in names:
    importlib.import_module(name)
installed = importlib.metadata.version("sac2")
assert sac2.__version__ == installed, f"sac2.__version__ is {sac2.__version__}, the installed distribution {installed}"
assert (importlib.resources.files("sac2") / "py.typed").is_file(), "the wheel lacks sac2/py.typed"
print(f"noextras: imported sac2 and {len(names)} submodules from the installed wheel; version {installed}")
PY
"$tmp/venv/bin/sac2" bench --help >/dev/null
echo "noextras: the sac2 command answers 'sac2 bench --help'"
