"""The ```python blocks of docs/huggingface.md and docs/torchtitan.md run as written (one namespace per file)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent.parent


@pytest.mark.parametrize("doc,client", [("docs/huggingface.md", "trl"), ("docs/torchtitan.md", "torchtitan")])
def test_python_blocks_run(doc: str, client: str) -> None:
    pytest.importorskip("transformers" if client == "trl" else client)
    pytest.importorskip(client)
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / doc).read_text(), flags=re.S)
    assert blocks, f"{doc} has no runnable example"
    namespace: dict = {"__name__": f"doc:{doc}"}
    for i, code in enumerate(blocks):
        exec(compile(code, f"{doc}[block {i}]", "exec"), namespace)
