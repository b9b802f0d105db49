# As helpers.pyi: tests/seams imports tests/clients as `clients`, the name pytest gives it.
from tests.clients import *  # noqa: F403
