"""The package's layout: every ``sac2.*`` submodule imports as a module, no exported name hides a submodule, and
private torch names are used only in ``sac2/_compat.py`` (CONTRIBUTING.md: "every private torch API")."""

from __future__ import annotations

import importlib
import io
import pkgutil
import re
import tokenize
import types
from pathlib import Path

import pytest

import sac2

PACKAGE = Path(sac2.__file__).parent
COMPAT = PACKAGE / "_compat.py"

#: Private torch names, as code (not comments or strings) spells them.
PRIVATE = re.compile(
    r"\btorch\._(?!_)\w*"  # torch._C, torch._ops, ... (also `from torch._x import`); not torch.__version__
    r"|\btorch\.utils\._(?!_)\w*"
    r"|\.(?:_op|_schema|_cdata|_overloadpacket|_should_skip_dynamo)\b"
)


def _submodules() -> list[str]:
    return sorted(info.name for info in pkgutil.walk_packages(sac2.__path__, prefix="sac2."))


@pytest.mark.parametrize("name", _submodules())
def test_every_submodule_imports_as_a_module(name: str) -> None:
    assert isinstance(importlib.import_module(name), types.ModuleType)


@pytest.mark.parametrize("name", _submodules())
def test_no_exported_name_shadows_a_submodule(name: str) -> None:
    parent, _, leaf = name.rpartition(".")
    module = importlib.import_module(name)
    found = getattr(importlib.import_module(parent), leaf, module)
    assert found is module, f"{parent}.{leaf} is {found!r}, not the submodule {name}"


def _code_lines(path: Path) -> dict[int, str]:
    """Line number -> the line with its comments and string literals blanked out."""
    lines = path.read_text().splitlines()
    blank = {tokenize.COMMENT, tokenize.STRING} | {
        getattr(tokenize, t) for t in ("FSTRING_MIDDLE", "TSTRING_MIDDLE") if hasattr(tokenize, t)
    }
    for tok in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
        if tok.type in blank:
            (r0, c0), (r1, c1) = tok.start, tok.end
            for r in range(r0, r1 + 1):
                line = lines[r - 1]
                start = c0 if r == r0 else 0
                end = c1 if r == r1 else len(line)
                lines[r - 1] = line[:start] + " " * (end - start) + line[end:]
    return dict(enumerate(lines, start=1))


def private_torch_names(root: Path = PACKAGE) -> list[str]:
    """``file:line: name`` for each private torch name used in code under ``root`` outside ``_compat.py``."""
    found = []
    for path in sorted(root.rglob("*.py")):
        if path == root / COMPAT.name:
            continue
        for number, line in _code_lines(path).items():
            for match in PRIVATE.finditer(line):
                found.append(f"{path.relative_to(root.parent)}:{number}: {match.group(0)}")
    return found


def test_private_torch_names_only_in_compat() -> None:
    found = private_torch_names()
    assert found == [], "private torch names outside sac2/_compat.py:\n" + "\n".join(found)


def test_the_private_name_check_sees_code_and_not_comments_or_strings(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "_compat.py").write_text("import torch._C\n")
    (pkg / "a.py").write_text(
        "import torch\n"
        "from torch._ops import OpOverload  # torch._C in a comment\n"
        "x = torch.utils._pytree.tree_leaves\n"
        "y = op._schema.is_mutable\n"
        's = "torch._dynamo in a string"\n'
        "z = t.untyped_storage()._cdata\n"
    )
    assert private_torch_names(pkg) == [
        "pkg/a.py:2: torch._ops",
        "pkg/a.py:3: torch.utils._pytree",
        "pkg/a.py:4: ._schema",
        "pkg/a.py:6: ._cdata",
    ]
