"""The package's layout: every ``sac2.*`` submodule imports and defines each name its ``__all__`` lists, no
exported name hides a submodule, private torch names are used only in ``sac2/_compat/`` (CONTRIBUTING.md: "every
private torch API"), no module uses another module's private names, every module stays short, and the folders are
layers that import only downward (``import sac2`` loads no tool)."""

from __future__ import annotations

import ast
import importlib
import io
import pkgutil
import re
import subprocess
import sys
import tokenize
import types
from pathlib import Path

import pytest
import torch
from torch import nn

import sac2
from sac2 import _compat

PACKAGE = Path(sac2.__file__).parent
COMPAT = "_compat"

#: Private torch names as code (not comments or strings) spells them: any path segment starting with one
#: underscore under ``torch.`` (``torch._C``, ``torch.ops.aten._to_copy``,
#: ``torch.distributed.algorithms._checkpoint``).
PRIVATE_PATH = re.compile(r"\btorch(?:\.[A-Za-z]\w*)*\._(?!_)\w*")


def _torch_private_attributes() -> frozenset[str]:
    """Private attribute names of the torch objects sac2 handles (tensors, storages, modules, ops, HOPs,
    generators, modes, FX graphs), instance attributes included."""
    t = torch.randn(1)
    objects = (t, t.untyped_storage(), nn.Linear(1, 1), torch.ops.aten.mm.default, torch.ops.aten.mm,
               _compat.FLEX_ATTENTION, torch.Generator(), _compat.TorchDispatchMode(), torch.fx.Graph())
    return frozenset(n for obj in objects for n in dir(obj) if n.startswith("_") and not n.startswith("__"))


def _submodules() -> list[str]:
    return sorted(info.name for info in pkgutil.walk_packages(sac2.__path__, prefix="sac2."))


def undefined_exports(module: types.ModuleType) -> list[str] | None:
    """The names a module's ``__all__`` lists that it does not define (None where it declares no ``__all__``)."""
    names = getattr(module, "__all__", None)
    if names is None:
        return None
    return [n for n in names if not isinstance(n, str) or not hasattr(module, n)]


@pytest.mark.parametrize("name", _submodules())
def test_every_submodule_imports_and_defines_what_its_all_lists(name: str) -> None:
    assert undefined_exports(importlib.import_module(name)) == []


def test_the_all_check_sees_a_missing_all_and_an_undefined_name() -> None:
    module = types.ModuleType("pkg.a")
    assert undefined_exports(module) is None
    module.__all__ = ["here", "gone"]  # type: ignore[attr-defined]
    module.here = 1  # type: ignore[attr-defined]
    assert undefined_exports(module) == ["gone"]


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


def _own_private_names(root: Path) -> set[str]:
    """The underscore names the package defines itself: functions, classes, attributes it assigns, slots."""
    names: set[str] = set()
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.isidentifier():
                names.add(node.value)  # __slots__ entries
    return {n for n in names if n.startswith("_")}


def private_torch_names(root: Path = PACKAGE) -> list[str]:
    """``file:line: name`` for each private torch name used in code under ``root`` outside ``_compat``: private
    module paths under ``torch.``, and private attributes of torch objects the package does not define itself."""
    attributes = _torch_private_attributes() - _own_private_names(root)
    attribute = re.compile(r"\.(" + "|".join(sorted(map(re.escape, attributes))) + r")\b") if attributes else None
    found = []
    for path in sorted(root.rglob("*.py")):
        if COMPAT in path.relative_to(root).parts or path.name == f"{COMPAT}.py":
            continue
        for number, line in _code_lines(path).items():
            matches = [m.group(0) for m in PRIVATE_PATH.finditer(line)]
            if attribute is not None:
                matches += [m.group(0) for m in attribute.finditer(line)]
            found += [f"{path.relative_to(root.parent)}:{number}: {m}" for m in matches]
    return found


def test_private_torch_names_only_in_compat() -> None:
    found = private_torch_names()
    assert found == [], "private torch names outside sac2/_compat/:\n" + "\n".join(found)


def cross_module_private_names(root: Path = PACKAGE, package: str = "sac2") -> list[str]:
    """``file:line: name`` where a module imports or reads another module's private name (``_compat`` is the one
    private module meant for every module)."""
    found = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text())
        modules = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == package:
                for alias in node.names:
                    if alias.name.startswith("_") and alias.name != COMPAT and not alias.name.startswith("__"):
                        found.append(f"{path.relative_to(root.parent)}:{node.lineno}: {node.module}.{alias.name}")
                    modules.add(alias.asname or alias.name)
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules
                    and node.attr.startswith("_") and not node.attr.startswith("__") and node.value.id != COMPAT):
                found.append(f"{path.relative_to(root.parent)}:{node.lineno}: {node.value.id}.{node.attr}")
    return found


def test_no_module_uses_another_modules_private_names() -> None:
    found = cross_module_private_names()
    assert found == [], "private names used across modules:\n" + "\n".join(found)


def test_the_private_name_checks_see_code_and_not_comments_or_strings(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    (pkg / "_compat").mkdir(parents=True)
    (pkg / "_compat" / "ops.py").write_text("import torch._C\n")
    (pkg / "b.py").write_text("def _helper():\n    pass\n")
    (pkg / "a.py").write_text(
        "import torch\n"
        "from torch._ops import OpOverload  # torch._C in a comment\n"
        "x = torch.utils._pytree.tree_leaves\n"
        "y = op._schema.is_mutable\n"
        's = "torch._dynamo in a string"\n'
        "z = t.untyped_storage()._cdata\n"
        "v = t._version + torch.ops.aten._to_copy.default\n"
        "import torch.distributed.algorithms._checkpoint.checkpoint_wrapper\n"
        "from pkg.b import _helper\n"
        "from pkg import b\n"
        "b._helper()\n"
    )
    assert private_torch_names(pkg) == [
        "pkg/a.py:2: torch._ops",
        "pkg/a.py:3: torch.utils._pytree",
        "pkg/a.py:4: ._schema",
        "pkg/a.py:6: ._cdata",
        "pkg/a.py:7: torch.ops.aten._to_copy",
        "pkg/a.py:7: ._version",
        "pkg/a.py:8: torch.distributed.algorithms._checkpoint",
    ]
    assert cross_module_private_names(pkg, "pkg") == ["pkg/a.py:9: pkg.b._helper", "pkg/a.py:11: b._helper"]


#: Where message texts may be written out: the one home of user-facing messages (the ``messages`` package, every
#: module in it), and the bench's command line, whose argparse errors belong to it.
MESSAGE_PACKAGE = "messages"
MESSAGE_FILES = ("bench/cli.py", "measure/arguments.py")


def _message_home(relative: Path) -> bool:
    """Whether a file (relative to the package root) may write message texts out."""
    return relative.parts[0] == MESSAGE_PACKAGE or relative.as_posix() in MESSAGE_FILES


def _written_out(node: ast.expr) -> bool:
    """Whether an expression spells text in place (a string literal or an f-string anywhere in it)."""
    return any(isinstance(n, ast.JoinedStr) or (isinstance(n, ast.Constant) and isinstance(n.value, str))
               for n in ast.walk(node))


def inline_messages(root: Path = PACKAGE) -> list[str]:
    """``file:line`` of each exception raised, or warning given (``warnings.warn``, ``warn_once``), whose text is
    written out in place instead of taken from ``sac2.messages``."""
    found = []
    for path in sorted(root.rglob("*.py")):
        if _message_home(path.relative_to(root)):
            continue
        for node in sorted(ast.walk(ast.parse(path.read_text())), key=lambda n: getattr(n, "lineno", 0)):
            texts: list[ast.expr] = []
            if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call):
                texts = [*node.exc.args, *(k.value for k in node.exc.keywords)]
            elif isinstance(node, ast.Call):
                name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
                if name == "warn" and node.args:
                    texts = [node.args[0]]
                elif name == "warn_once" and len(node.args) == 3:
                    texts = [node.args[2]]  # (kind of warning, op, message)
            if any(_written_out(t) for t in texts):
                found.append(f"{path.relative_to(root.parent)}:{getattr(node, 'lineno', '?')}")  # a Raise's or Call's
    return found


def test_every_user_facing_message_comes_from_sac2_messages() -> None:
    found = inline_messages()
    assert found == [], "messages written out in place (build them in sac2/messages/):\n" + "\n".join(found)


def test_the_messages_package_imports_nothing_from_sac2_outside_itself() -> None:
    """Every module, ``_compat`` included, imports ``sac2.messages``: it must import none of them back."""
    found = [
        f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: {name}"
        for path in sorted((PACKAGE / MESSAGE_PACKAGE).rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for name in ([node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names])
        if name.split(".")[0] == "sac2" and name.split(".")[:2] != ["sac2", MESSAGE_PACKAGE]
    ]
    assert found == []


def test_the_inline_message_check_sees_raises_and_warnings(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    (pkg / "bench").mkdir(parents=True)
    (pkg / "messages").mkdir()
    (pkg / "messages" / "__init__.py").write_text("from pkg.messages.texts import BAD\n")
    (pkg / "messages" / "texts.py").write_text('BAD = "written here on purpose"\n')
    (pkg / "bench" / "cli.py").write_text('raise SystemExit(f"argparse errors stay in the CLI {1}")\n')
    (pkg / "a.py").write_text(
        "from pkg import messages\n"
        'raise ValueError("inline")\n'
        'raise ValueError(f"inline {1}")\n'
        "raise ValueError(messages.BAD)\n"
        'warnings.warn("inline", stacklevel=2)\n'
        'warn_once("kind", op, messages.BAD)\n'
        'warn_once("kind", op, "inline " + name)\n'
        "raise RuntimeError(messages.nested(x) + '!')\n"
    )
    assert inline_messages(pkg) == ["pkg/a.py:2", "pkg/a.py:3", "pkg/a.py:5", "pkg/a.py:7", "pkg/a.py:8"]


#: CONTRIBUTING.md: short modules, one idea each.
MODULE_LINES = 400


def test_every_module_is_under_the_line_limit() -> None:
    long = {str(p.relative_to(PACKAGE)): n for p in sorted(PACKAGE.rglob("*.py"))
            if (n := len(p.read_text().splitlines())) >= MODULE_LINES}
    assert long == {}, f"modules of {MODULE_LINES} lines or more (split them along one idea each)"


#: The folders of ``sac2``, lowest first: a module may import from its own folder and from folders before its own,
#: never from one after it (CONTRIBUTING.md, "The layers"). The flow a reader sees: api -> policies and regions ->
#: modes -> record -> frame -> core -> _compat -> messages; the tools (measure, bench, advisor) above the library,
#: which never imports them. The package's ``__init__`` and ``__main__`` sit on top.
LAYERS = (
    "messages", "_compat", "core", "offload", "frame", "record", "modes", "regions", "policies", "api", "integrations",
    "measure", "bench", "advisor",
)


def _folder(module: str) -> str | None:
    """The folder of ``sac2.<folder>...`` (None for the package's own ``__init__``/``__main__``)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in LAYERS) else None


def upward_imports(root: Path = PACKAGE, package: str = "sac2") -> list[str]:
    """``file:line: importer -> imported`` for every import, at module level or inside a function, of a folder
    later in ``LAYERS`` than the importer's own."""
    found = []
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root)
        if len(relative.parts) == 1:
            continue  # __init__.py, __main__.py: the top
        here = LAYERS.index(relative.parts[0])
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            folders = {_folder(n) for n in names if n.split(".")[0] == package} - {None}
            for folder in sorted(f for f in folders if f in LAYERS and LAYERS.index(f) > here):
                found.append(f"{relative}:{node.lineno}: {relative.parts[0]} -> {folder}")
    return found


def test_every_folder_is_a_layer() -> None:
    folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").is_file()}
    assert folders == set(LAYERS)


def test_no_module_imports_a_later_layer() -> None:
    found = upward_imports()
    assert found == [], "imports against the layers' order:\n" + "\n".join(found)


def test_the_layer_check_sees_module_and_function_level_imports(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    for folder in ("core", "api", "advisor"):
        (pkg / folder).mkdir(parents=True)
        (pkg / folder / "__init__.py").write_text("")
    (pkg / "core" / "a.py").write_text("from pkg.api.b import run\n\ndef f():\n    from pkg import advisor\n")
    (pkg / "api" / "b.py").write_text("from pkg.core import a\nimport pkg.core.a\n")
    assert upward_imports(pkg, "pkg") == ["core/a.py:1: core -> api", "core/a.py:4: core -> advisor"]


def test_import_sac2_loads_no_tool() -> None:
    code = "import sys, sac2; print(sorted(m for m in sys.modules if m.split('.')[1:2] in (['bench'], "
    code += "['advisor'], ['measure'])))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=PACKAGE.parent)
    assert out.stdout.strip() == "[]"


def test_the_tools_names_load_on_first_use() -> None:
    code = "import sys, sac2; sac2.advise; print('sac2.advisor' in sys.modules, 'sac2.bench.cli' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=PACKAGE.parent)
    assert out.stdout.split() == ["True", "False"]
