"""Write docs/api.md, the API reference, from the signatures and docstrings of sac2's public names.

Run from the repository root: ``python docs/gen_api.py`` rewrites the page, ``python docs/gen_api.py --check``
exits 1 when it is stale. The page follows ``sac2.__all__`` and then ``sac2.policies.__all__``, in their order, so
the same sources always give the same page, on every torch sac2 supports. tests/test_api_reference.py checks that
the page is current and that every public name documents its arguments and what it returns.

Docstrings are Google style: a summary line, a few lines of why, then ``Args:``, ``Returns:`` and ``Raises:``
sections. Here they become markdown: a heading per section, Args and Raises as lists, ``code`` in backticks.
"""

from __future__ import annotations

import argparse
import enum
import inspect
import re
import sys
import types
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "api.md"
MODULES = ("sac2", "sac2.policies")
#: Sections whose body is a list of ``name: text`` items.
LIST_SECTIONS = ("Args", "Attributes", "Raises")
SECTIONS = (*LIST_SECTIONS, "Returns", "Yields", "Example", "Examples", "Note")
_SECTION = re.compile(rf"^({'|'.join(SECTIONS)}):\s*$")
#: An item of a list section: ``name: text``, ``*args: text``, ``torch.utils.checkpoint.CheckpointError: text``.
_ITEM = re.compile(r"^(\*{0,2}[A-Za-z_][\w.]*)(?: \([^)]*\))?:(?: (.*))?$")
#: One-line signatures longer than this get one parameter per line.
WIDTH = 100

#: Names sac2 re-exports from torch: the very objects (not copies), so values and ``isinstance`` checks mean the
#: same in both libraries. Their docstrings are torch's, and differ between torch versions, so the page says what
#: they are in sac2's words instead.
TORCH_OBJECTS: dict[str, tuple[str, str]] = {
    "sac2.CheckpointPolicy": (
        "torch.utils.checkpoint.CheckpointPolicy",
        "What a policy answers per op: `MUST_SAVE`, `PREFER_SAVE`, `MUST_RECOMPUTE`, `PREFER_RECOMPUTE`, "
        "`MUST_CPU_OFFLOAD`, `PREFER_CPU_OFFLOAD` (a bool also works: True is `MUST_SAVE`, False "
        "`PREFER_RECOMPUTE`). `MUST_*` answers are not overridden by torch.compile or by a later policy in "
        "`sac2.policies.compose`.",
    ),
    "sac2.SelectiveCheckpointContext": (
        "torch.utils.checkpoint.SelectiveCheckpointContext",
        "The `ctx` a policy receives. sac2 passes one per checkpointed forward (a subclass, with per-forward "
        "state for counting policies); `ctx.op_output` holds the current op's output during the policy's call.",
    ),
    "sac2.CheckpointImpl": (
        "torch.distributed.algorithms._checkpoint.checkpoint_wrapper.CheckpointImpl",
        "How `sac2.checkpoint_wrapper` checkpoints: `NO_REENTRANT` (the default) is `sac2.checkpoint`, with "
        "selective policies; `REENTRANT` is torch's reentrant checkpoint, which recomputes the whole module.",
    ),
}


def public_names() -> list[tuple[str, object]]:
    """(qualified public name, object) for every name of ``MODULES``' ``__all__``, in that order."""
    import importlib

    out = []
    for module_name in MODULES:
        module = importlib.import_module(module_name)
        out += [(f"{module_name}.{name}", getattr(module, name)) for name in module.__all__]
    return out


def is_torch_object(obj: object) -> bool:
    """Whether ``obj`` is one of torch's own objects that sac2 re-exports."""
    return not isinstance(obj, types.ModuleType) and getattr(obj, "__module__", "").split(".")[0] == "torch"


def kind(obj: object) -> str:
    """What a public name is, in a word or two."""
    if isinstance(obj, types.ModuleType):
        return "module"
    if isinstance(obj, type) and issubclass(obj, enum.Enum):
        return "enum"
    if isinstance(obj, type) and issubclass(obj, Warning):
        return "warning"
    if isinstance(obj, type):
        return "context manager" if hasattr(obj, "__enter__") else "class"
    return "function"


def documented_signature(obj: object) -> inspect.Signature | None:
    """The signature the docstring documents: a function's, a class's ``__init__`` (without ``self``); none for a
    warning, which sac2 gives and the user filters or catches, never calls."""
    if isinstance(obj, types.ModuleType) or is_torch_object(obj):
        return None
    if isinstance(obj, type) and issubclass(obj, Warning):
        return None
    return inspect.signature(obj)  # type: ignore[arg-type]


# --- docstrings ------------------------------------------------------------------------------------------------


def sections(doc: str) -> dict[str, list[str]]:
    """A Google-style docstring split into sections: ``""`` holds the text before the first section, each section
    its lines dedented by one level (4 spaces)."""
    out: dict[str, list[str]] = {"": []}
    current = ""
    for line in inspect.cleandoc(doc).splitlines():
        match = _SECTION.match(line)
        if match:
            current = match.group(1)
            out[current] = []
        elif current and line.strip() and not line.startswith(" "):
            current = ""  # text after a section, at the left margin: free text again
            out[""].append(line)
        else:
            out[current].append(line[4:] if current else line)
    return out


def items(lines: list[str]) -> list[tuple[str, str]]:
    """The ``(name, text)`` items of a list section; continuation lines join the item they follow."""
    out: list[tuple[str, str]] = []
    for line in lines:
        match = _ITEM.match(line) if not line.startswith(" ") else None
        if match:
            out.append((match.group(1), match.group(2) or ""))
        elif out and line.strip():
            out[-1] = (out[-1][0], f"{out[-1][1]} {line.strip()}".strip())
    return out


def arg_names(doc: str | None) -> list[str]:
    """The parameter names an ``Args:`` section documents, without their ``*``/``**``."""
    return [name.lstrip("*") for name, _ in items(sections(doc or "").get("Args", []))]


def inline(text: str) -> str:
    """reST inline literals (````x````, also across a line break) as markdown code (```x```)."""
    return re.sub(r"``(.+?)``", r"`\1`", text, flags=re.DOTALL)


def prose(lines: list[str]) -> list[str]:
    """Free text as markdown: reST literal blocks (a paragraph ending in ``::``, then indented lines) fenced as
    Python."""
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.rstrip().endswith("::"):
            out.append(line.rstrip()[:-1])
            block, i = _literal_block(lines, i + 1)
            out += ["", "```python", *block, "```", ""]
            continue
        out.append(line)
        i += 1
    return out


def _literal_block(lines: list[str], i: int) -> tuple[list[str], int]:
    """The indented lines from ``i`` on (blank lines before them skipped), dedented; and the index after them."""
    while i < len(lines) and not lines[i].strip():
        i += 1
    block = []
    while i < len(lines) and (not lines[i].strip() or lines[i].startswith(" ")):
        block.append(lines[i])
        i += 1
    while block and not block[-1].strip():
        block.pop()
    indent = min(len(b) - len(b.lstrip()) for b in block if b.strip()) if block else 0
    return [b[indent:] for b in block], i


def render_doc(doc: str | None, level: int) -> list[str]:
    """A docstring as markdown lines, its sections under headings of ``level``."""
    if not doc:
        return ["(no docstring)"]
    parts = sections(inline(inspect.cleandoc(doc)))
    out = _strip_blank(prose(parts.pop("")))
    for name, lines in parts.items():
        out += ["", f"{'#' * level} {name}", ""]
        if name in LIST_SECTIONS:
            out += [f"- `{item}`: {text}" for item, text in items(lines)]
        else:
            out += _strip_blank(prose(lines))
    return out


def _strip_blank(lines: list[str]) -> list[str]:
    while lines and not lines[0].strip():
        lines = lines[1:]
    while lines and not lines[-1].strip():
        lines = lines[:-1]
    return lines


# --- signatures ------------------------------------------------------------------------------------------------


def _annotation(annotation: object) -> str:
    # sac2's modules use ``from __future__ import annotations``: annotations are the source's own strings.
    return annotation if isinstance(annotation, str) else inspect.formatannotation(annotation)


def _default(value: object, public: dict[int, str]) -> str:
    """A default as the source would spell it: no object addresses, so the page is the same in every process."""
    if id(value) in public:
        return public[id(value)]
    if isinstance(value, enum.Enum):
        return f"{type(value).__name__}.{value.name}"
    if isinstance(value, (types.FunctionType, type)):
        if value.__name__ == "<lambda>":
            return "lambda ..."
        return f"{value.__module__}.{value.__qualname__}"
    return repr(value)


def _parameters(sig: inspect.Signature, public: dict[int, str]) -> list[str]:
    out: list[str] = []
    starred = False
    for p in sig.parameters.values():
        if p.kind is p.KEYWORD_ONLY and not starred:
            out.append("*")
        starred = starred or p.kind in (p.VAR_POSITIONAL, p.KEYWORD_ONLY)
        text = {p.VAR_POSITIONAL: "*", p.VAR_KEYWORD: "**"}.get(p.kind, "") + p.name
        if p.annotation is not p.empty:
            text += f": {_annotation(p.annotation)}"
        if p.default is not p.empty:
            spaced = p.annotation is not p.empty  # PEP 8: ``x: int = 1`` but ``x=1``
            text += f"{' = ' if spaced else '='}{_default(p.default, public)}"
        out.append(text)
        if p.kind is p.POSITIONAL_ONLY and _last_positional_only(sig, p.name):
            out.append("/")
    return out


def _last_positional_only(sig: inspect.Signature, name: str) -> bool:
    only = [n for n, p in sig.parameters.items() if p.kind is p.POSITIONAL_ONLY]
    return only[-1] == name


def format_signature(name: str, sig: inspect.Signature, public: dict[int, str]) -> str:
    """``name(params) -> return``, wrapped one parameter per line when longer than ``WIDTH``."""
    params = _parameters(sig, public)
    ret = "" if sig.return_annotation is sig.empty else f" -> {_annotation(sig.return_annotation)}"
    line = f"{name}({', '.join(params)}){ret}"
    if len(line) <= WIDTH or not params:
        return line
    return "\n".join([f"{name}(", *(f"    {p}," for p in params), f"){ret}"])


# --- the page --------------------------------------------------------------------------------------------------


def anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but ``-`` and ``_`` dropped, spaces as ``-``."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def anchors(lines: list[str]) -> dict[str, str]:
    """Heading text -> its anchor, for every heading of ``lines`` in order: a repeated anchor gets ``-1``, ``-2``,
    ... as GitHub gives it (``sac2.Region`` and ``sac2.region`` share one otherwise)."""
    seen: dict[str, int] = {}
    out: dict[str, str] = {}
    fence = False
    for line in lines:
        fence = fence != line.startswith("```")
        if fence or not line.startswith("#"):
            continue
        text = line.lstrip("#").strip()
        slug = anchor(text)
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.setdefault(text, f"{slug}-{n}" if n else slug)
    return out


def methods(cls: type) -> list[tuple[str, Callable[..., Any] | property]]:
    """The public methods and properties ``cls`` defines itself (not ``forward``: nn.Module's protocol)."""
    out = []
    for name, value in vars(cls).items():
        if name.startswith("_") or name == "forward":
            continue
        if isinstance(value, (classmethod, staticmethod)):
            value = value.__func__
        if isinstance(value, (property, types.FunctionType)):
            out.append((name, value))
    return out


def _entry(name: str, obj: object, public: dict[int, str]) -> list[str]:
    out = [f"### `{name}`", "", f"*{kind(obj)}*"]
    if name in TORCH_OBJECTS:
        path, text = TORCH_OBJECTS[name]
        return [*out, "", f"torch's `{path}` itself, re-exported. {text}"]
    sig = documented_signature(obj)
    if sig is not None:
        if isinstance(obj, type):
            sig = sig.replace(return_annotation=sig.empty)  # ``__init__``'s ``-> None``, not what the call gives
        out += ["", "```python", format_signature(name, sig, public), "```"]
    doc = obj.__doc__ if isinstance(obj, types.ModuleType) else inspect.getdoc(obj)
    out += ["", *render_doc(doc, 4)]
    if isinstance(obj, type):
        for method_name, method in methods(obj):
            out += ["", *_method(name, method_name, method, public)]
    return out


def _method(owner: str, name: str, method: Callable[..., Any] | property, public: dict[int, str]) -> list[str]:
    """A method's or property's entry, under its class's."""
    qualified = f"{owner.rsplit('.', 1)[1]}.{name}"
    if isinstance(method, property):
        return [f"#### `{qualified}` (property)", "", *render_doc(method.__doc__, 5)]
    sig = inspect.signature(method)
    sig = sig.replace(parameters=[p for n, p in sig.parameters.items() if n not in ("self", "cls")])
    code = ["```python", format_signature(qualified, sig, public), "```"]
    return [f"#### `{qualified}`", "", *code, "", *render_doc(method.__doc__, 5)]


def render() -> str:
    """The whole of docs/api.md."""
    names = public_names()
    public = {id(obj): name for name, obj in names}
    out = [
        "# API reference",
        "",
        "<!-- Generated by `python docs/gen_api.py` from sac2's docstrings: edit those, then run it. -->",
        "",
        "Every public name of `sac2` and `sac2.policies`, in the order of their `__all__`: its signature and its",
        "docstring. Concepts and how-tos are in the other pages of `docs/`.",
    ]
    toc = "\0toc "  # a line to become a link to an entry's heading, once every heading's anchor is known
    for module_name in MODULES:
        members = [(n, obj) for n, obj in names if n.rsplit(".", 1)[0] == module_name]
        out += ["", f"## `{module_name}`", "", *(toc + n for n, _ in members)]
        for name, obj in members:
            out += ["", *_entry(name, obj, public)]
    links = anchors(out)
    out = [f"- [`{x[len(toc):]}`](#{links[f'`{x[len(toc):]}`']})" if x.startswith(toc) else x for x in out]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/api.md is not what this writes")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = PAGE.read_text() if PAGE.exists() else ""
        if current != text:
            print(f"{PAGE.relative_to(ROOT)} is stale: run python docs/gen_api.py", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(text)
    print(f"wrote {PAGE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))  # document this checkout's sac2, not another one installed
    sys.exit(main())
