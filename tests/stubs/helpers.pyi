# pytest puts tests/ on sys.path, so tests import this module as `helpers`; mypy names it from the root
# (tests.helpers, see [tool.mypy] in pyproject.toml), and this stub joins the two names.
from tests.helpers import *  # noqa: F403 (the stub re-exports helpers' __all__)
