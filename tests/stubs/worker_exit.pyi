# As helpers.pyi: the workers import tests/worker_exit.py as `worker_exit`.
from tests.worker_exit import *  # noqa: F403
