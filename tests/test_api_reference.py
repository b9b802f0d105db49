"""docs/api.md is what ``python docs/gen_api.py`` writes now, and every public name documents its arguments and what it
returns in a Google-style docstring (``Args:``, ``Returns:``), which that page shows."""

from __future__ import annotations

import importlib.util
import inspect
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _load_generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_api", ROOT / "docs" / "gen_api.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gen_api = _load_generator()
NAMES = gen_api.public_names()
#: Public functions and classes with docstrings of their own (not torch's re-exported objects, not the module).
DOCUMENTED = [(n, obj) for n, obj in NAMES if gen_api.documented_signature(obj) is not None]


def _ids(pairs: list[tuple[str, Any]]) -> list[str]:
    return [n for n, _ in pairs]


def _parameters(obj: object) -> list[str]:
    sig = gen_api.documented_signature(obj)
    return list(sig.parameters)


def test_api_page_is_what_the_generator_writes() -> None:
    page = ROOT / "docs" / "api.md"
    current = page.read_text() if page.exists() else ""
    assert current == gen_api.render(), "docs/api.md is stale: run python docs/gen_api.py"


def test_the_page_lists_every_public_name() -> None:
    page = gen_api.render()
    missing = [n for n, _ in NAMES if f"### `{n}`" not in page]
    assert missing == []


@pytest.mark.parametrize(("name", "obj"), DOCUMENTED, ids=_ids(DOCUMENTED))
def test_every_parameter_is_in_args(name: str, obj: object) -> None:
    # Classes document their ``__init__``'s parameters in the class docstring; no-argument functions need no Args.
    documented = gen_api.arg_names(inspect.getdoc(obj))
    missing = [p for p in _parameters(obj) if p not in documented]
    assert missing == [], f"{name}'s docstring has no Args entry for {missing}"


@pytest.mark.parametrize(("name", "obj"), DOCUMENTED, ids=_ids(DOCUMENTED))
def test_args_name_only_real_parameters(name: str, obj: object) -> None:
    extra = [a for a in gen_api.arg_names(inspect.getdoc(obj)) if a not in _parameters(obj)]
    assert extra == [], f"{name}'s Args documents {extra}, which it does not take"


#: Public functions that return something (``-> None`` ones need no Returns section).
FUNCTIONS = [
    (n, obj) for n, obj in DOCUMENTED
    if not isinstance(obj, type) and gen_api.documented_signature(obj).return_annotation not in ("None", None)
]
CLASSES = [(n, obj) for n, obj in DOCUMENTED if isinstance(obj, type)]


@pytest.mark.parametrize(("name", "obj"), FUNCTIONS, ids=_ids(FUNCTIONS))
def test_every_function_that_returns_something_has_returns(name: str, obj: object) -> None:
    assert "Returns" in gen_api.sections(inspect.getdoc(obj) or ""), f"{name}'s docstring has no Returns section"


def test_only_torchs_own_objects_go_without_a_docstring_of_sac2s() -> None:
    # Re-exported torch objects carry torch's docstring; the page describes them from gen_api.TORCH_OBJECTS.
    reexported = sorted(n for n, obj in NAMES if gen_api.is_torch_object(obj))
    assert reexported == sorted(gen_api.TORCH_OBJECTS)


@pytest.mark.parametrize(("name", "obj"), CLASSES, ids=_ids(CLASSES))
def test_every_method_the_page_shows_has_a_docstring(name: str, obj: type) -> None:
    undocumented = [m for m, value in gen_api.methods(obj) if not (value.__doc__ or "").strip()]
    assert undocumented == [], f"{name}: {undocumented} have no docstring"


def test_the_parser_reads_args_across_lines_and_stops_at_the_next_section() -> None:
    doc = """Do a thing.

    Args:
        x: the first,
            over two lines.
        *rest: the others.
        **options: the options.

    Returns:
        The thing.
    """
    assert gen_api.arg_names(doc) == ["x", "rest", "options"]
    assert gen_api.items(gen_api.sections(doc)["Args"])[0] == ("x", "the first, over two lines.")
    assert gen_api.sections(doc)["Returns"] == ["The thing."]


def test_a_missing_args_entry_is_seen() -> None:
    def f(a: int, b: int) -> int:
        """Add.

        Args:
            a: one.

        Returns:
            The sum.
        """
        return a + b

    documented = gen_api.arg_names(inspect.getdoc(f))
    assert [p for p in inspect.signature(f).parameters if p not in documented] == ["b"]


def test_signatures_show_no_object_addresses() -> None:
    assert " at 0x" not in gen_api.render()
