"""Every ```python block in the README and docs/ runs as written (blocks of one file share a namespace).

docs/migration.md has its own test (tests/test_docs_migration.py), which also checks its sections.
docs/distributed.md's blocks need 2 ranks: tests/distributed/test_docs_distributed.py runs them (SAC2_DISTRIBUTED=1).
"""

import sys
import types

import pytest

from helpers import python_blocks

DOCS = ["README.md", "docs/concepts.md", "docs/compiled.md", "docs/hops.md", "docs/budgets.md", "docs/offload.md"]


@pytest.mark.parametrize("doc", DOCS)
def test_python_blocks_run(doc: str) -> None:
    blocks = python_blocks(doc)
    assert blocks, f"{doc} has no runnable example"
    # A module of its own, found by name: dynamo looks a frame's module up where it breaks a graph (compiled.md's
    # fallback example does).
    module = types.ModuleType(f"doc:{doc}")
    sys.modules[module.__name__] = module
    try:
        for i, code in enumerate(blocks):
            exec(compile(code, f"{doc}[block {i}]", "exec"), module.__dict__)
    finally:
        del sys.modules[module.__name__]
