"""The ``sac2`` command line: ``python -m sac2 bench|advise [options]`` (see ``sac2 bench --help``).

A missing or unknown command ends in one line naming the commands (exit code 2), as every misuse of a command does.
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

__all__ = ["main"]

#: Each command and what it does.
COMMANDS = {
    "bench": "compare checkpointing modes on a small model",
    "advise": "measure every checkpointing setup on your model and recommend one for your memory",
}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="sac2", description="sac2 tools.")
    parser.add_argument("command", choices=list(COMMANDS), help="; ".join(f"{k}: {v}" for k, v in COMMANDS.items()))
    commands = ", ".join(COMMANDS)
    if not argv:
        parser.error(f"no command given; the commands are: {commands}")
    if argv[0] not in (*COMMANDS, "-h", "--help"):
        parser.error(f"unknown command {argv[0]!r}; the commands are: {commands}")
    parser.parse_args(argv[:1])  # answers -h / --help
    if argv[0] == "advise":
        from sac2.advisor import cli as advisor_cli

        return advisor_cli.main(argv[1:])
    from sac2 import bench

    return bench.main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
