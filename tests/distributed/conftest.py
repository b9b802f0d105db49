"""tests/distributed runs only with SAC2_DISTRIBUTED=1 (`bash .ci/distributed.sh`, a CI step of its own): each test
file launches gloo ranks as subprocesses, minutes in all on 2 cores, too slow for the default suite."""

import os

if os.environ.get("SAC2_DISTRIBUTED") != "1":
    collect_ignore_glob = ["test_*.py"]
