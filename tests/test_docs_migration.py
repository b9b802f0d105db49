"""docs/migration.md's snippets run as written, in order, in one namespace."""

from helpers import ROOT, python_blocks

DOC = ROOT / "docs" / "migration.md"


def test_every_section_has_a_snippet():
    text = DOC.read_text()
    for heading in ("From `torch.utils.checkpoint`", "From torch's `checkpoint_wrapper`",
                    "From torchtitan's activation-checkpoint config"):
        section = text.split(heading, 1)[1].split("\n## ", 1)[0]
        assert "```python" in section, heading


def test_migration_snippets_run():
    namespace: dict = {}
    for i, code in enumerate(python_blocks(DOC)):
        exec(compile(code, f"{DOC.name}[snippet {i}]", "exec"), namespace)
