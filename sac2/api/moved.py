"""Where 0.4's modules went, for pickles written by 0.4.

A pickle names each class and function by its module path; policies, ``context_fn``s and wrapped models pickled by
0.4 name paths that moved in 0.5, when the package was laid out one folder per concept. This finder lets pickle
(and only the modules below) find them at their new homes: importing an old path gives the new module itself. Other
moved paths are gone (CHANGELOG, 0.5.0).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
from typing import Sequence

__all__ = ["MOVED", "install"]

#: 0.4 path -> 0.5 path, for every module a 0.4 pickle of a policy, a context_fn or a wrapped model names.
MOVED = {
    "sac2.answers": "sac2.core.decisions",
    "sac2.checkpointing": "sac2.api.checkpointing",
    "sac2.keys": "sac2.core.keys",
    "sac2.knapsack": "sac2.policies.knapsack",
    "sac2.module_class": "sac2.regions.module_class",
    "sac2.profile": "sac2.policies.profile",
    "sac2.wrappers": "sac2.api.wrappers",
}


class _Loader(importlib.abc.Loader):
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return importlib.import_module(MOVED[spec.name])

    def exec_module(self, module: types.ModuleType) -> None:
        """The new module ran when it was imported."""


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None  # noqa: ARG002 (finder protocol)
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, _Loader())


def install() -> None:
    """Put the finder on ``sys.meta_path`` (once)."""
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.append(_Finder())
