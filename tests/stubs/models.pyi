# As helpers.pyi: the distributed workers import tests/distributed/models.py as `models` (their folder is on the path).
from tests.distributed.models import *  # noqa: F403
