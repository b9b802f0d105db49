"""The ``sac2`` command line: ``python -m sac2 bench [options]`` (see ``sac2 bench --help``)."""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="sac2", description="sac2 tools.")
    parser.add_argument("command", choices=["bench"], help="bench: compare checkpointing modes on a small model")
    args = parser.parse_args(argv[:1])
    if args.command == "bench":
        from sac2 import bench

        return bench.main(argv[1:])
    return 2


if __name__ == "__main__":
    sys.exit(main())
