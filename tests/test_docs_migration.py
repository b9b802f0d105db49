"""docs/migration.md's snippets run as written, in order, in one namespace."""

import re
from pathlib import Path

DOC = Path(__file__).parent.parent / "docs" / "migration.md"


def _snippets() -> list[str]:
    return re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)


def test_every_section_has_a_snippet():
    text = DOC.read_text()
    for heading in ("From `torch.utils.checkpoint`", "From torch's `checkpoint_wrapper`",
                    "From torchtitan's activation-checkpoint config"):
        section = text.split(heading, 1)[1].split("\n## ", 1)[0]
        assert "```python" in section, heading


def test_migration_snippets_run():
    namespace: dict = {}
    for i, code in enumerate(_snippets()):
        exec(compile(code, f"{DOC.name}[snippet {i}]", "exec"), namespace)
