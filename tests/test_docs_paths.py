"""Every ``sac2`` path the README and docs/ name exists: each dotted name (``sac2.policies.llm``,
``sac2.record.regions.RegionForward``) imports and resolves, and each file path (``sac2/frame/frame.py``) is a
file. A name that moves must take its mentions with it (or keep working)."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
DOTTED = re.compile(r"(?<![\w.])sac2(?:\.[A-Za-z_]\w*)+")
FILES = re.compile(r"(?<![\w/])sac2/[\w/]+\.py")


def _named(pattern: re.Pattern[str]) -> list[str]:
    return sorted({m.group(0).rstrip(".") for doc in DOCS for m in pattern.finditer(doc.read_text())})


def resolve(path: str) -> object:
    """The object a dotted ``sac2`` path names: its longest importable module prefix, then attributes."""
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attribute in parts[cut:]:
            obj = getattr(obj, attribute)
        return obj
    raise ModuleNotFoundError(path)


@pytest.mark.parametrize("path", _named(DOTTED))
def test_every_dotted_path_the_docs_name_resolves(path: str) -> None:
    resolve(path)


@pytest.mark.parametrize("path", _named(FILES))
def test_every_file_the_docs_name_exists(path: str) -> None:
    assert (ROOT / path).is_file()


def test_the_path_check_sees_a_missing_attribute_and_module() -> None:
    assert resolve("sac2.policies.llm") is not None
    with pytest.raises(AttributeError):
        resolve("sac2.regions.RegionForward")  # docs/compiled.md named it in 0.4; it never existed there
    with pytest.raises(AttributeError):
        resolve("sac2.region_saves.keep_inputs")  # 0.4's module, moved without a shim
