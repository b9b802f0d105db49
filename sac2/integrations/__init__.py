"""Run sac2's modes inside frameworks that call torch's checkpoint API themselves.

``install()`` rebinds torch's public checkpoint entry points, and every copy of them that an imported module
bound at import time, to sac2 for as long as it is in effect; ``installed()`` reports where each binding points.
``sac2.integrations.torchtitan`` applies torchtitan's activation-checkpointing classes with sac2.
"""

from sac2.integrations.rebinding import Installation, install, installed

__all__ = ["install", "installed", "Installation"]
