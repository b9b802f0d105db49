"""One rank of tests/distributed/test_docs_distributed.py: run every ```python block of docs/distributed.md, in
order and in one namespace, as ``torchrun --nproc-per-node 2`` would run the page's blocks put in one file.

Run in a scratch working directory (the page's DCP block writes ``checkpoint-step-1`` there). Prints one JSON line:
the rank and how many blocks ran. A block that raises ends the rank with its traceback, named
``docs/distributed.md[block i]``.
"""

from __future__ import annotations

import json

from worker_exit import shut_down

from helpers import python_blocks

DOC = "docs/distributed.md"


def main() -> None:
    blocks = python_blocks(DOC)
    namespace: dict = {"__name__": "__main__"}
    for i, code in enumerate(blocks):
        exec(compile(code, f"{DOC}[block {i}]", "exec"), namespace)
    print(json.dumps({"rank": namespace["rank"], "blocks": len(blocks)}), flush=True)
    shut_down()


if __name__ == "__main__":
    main()
